//! Who went ahead of an IO while it waited (config `causes`): the requests its disk allocated
//! (G) between the IO's Q and its own G (a wait for a tag), and issued (D) between its I and
//! its own D (a wait in the scheduler), named by group: the cgroup the IO was charged to, or
//! the submitting command where no cgroup is known. The kernel numbers each disk's G's and D's
//! in the order they happen (`AheadRecord::getrq_seq`, `issue_seq`); this joins the numbers
//! between an IO's two to the records that carry them. Counts come from the numbers, names
//! from the records: what went ahead without a record here is counted as `unrecorded`.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;
use tracer_common::AheadRecord;

use crate::model::op::Op;

/// Which of the disk's orders an IO waited in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Order {
    /// For a request (a tag): requests allocated between its Q and its G.
    #[serde(rename = "Q2G")]
    Getrq,
    /// In the scheduler (or the dispatch list): requests issued between its I and its D.
    #[serde(rename = "I2D")]
    Issue,
}

impl Order {
    pub const ALL: [Order; 2] = [Order::Getrq, Order::Issue];

    /// The stage the wait falls in.
    pub fn stage(self) -> &'static str {
        match self {
            Order::Getrq => "Q2G",
            Order::Issue => "I2D",
        }
    }

    /// The requests that went ahead of one IO in this order; `None` where it has no number.
    pub fn count(self, a: &AheadRecord) -> Option<u32> {
        let (from, seq) = self.of(a);
        ahead_between(from, seq)
    }

    /// An IO's numbers in this order: the disk's count before it, and its own (0: none).
    fn of(self, a: &AheadRecord) -> (u32, u32) {
        match self {
            Order::Getrq => (a.getrq_from, a.getrq_seq),
            Order::Issue => (a.issue_from, a.issue_seq),
        }
    }
}

/// Requests numbered between a count and an IO's own number: from+1 ..= seq-1. `None` where
/// the IO has no number, or across a reset of the disk's numbering (the device left and came
/// back), which is no wait.
fn ahead_between(from: u32, seq: u32) -> Option<u32> {
    let ahead = seq.wrapping_sub(1).wrapping_sub(from);
    (seq != 0 && ahead <= u32::MAX / 2).then_some(ahead)
}

/// IOs kept for the join: beyond it, IOs are counted (`Ahead::past_bound`), not joined.
pub const MAX_IOS: usize = 4_000_000;

/// Numbers walked in the join at most: beyond, the remaining IOs' rows are marked partial.
const MAX_WALK: u64 = 1_000_000_000;

/// One IO as the join needs it.
struct Entry {
    disk: u32,
    group: u32,
    op: Op,
    numbers: [(u32, u32); 2],
}

/// The IOs of a capture, with their numbers and groups, until the join.
#[derive(Default)]
pub struct Ahead {
    groups: Vec<String>,
    index: HashMap<String, u32>,
    entries: Vec<Entry>,
    /// IOs past `MAX_IOS`, not joined.
    pub past_bound: u64,
}

/// The IOs of one group and op on a disk that waited in one order, and who went ahead of them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AheadRow {
    /// The waiting IOs' group: a cgroup path, or the command where no cgroup was known.
    pub group: String,
    pub op: Op,
    /// The stage of the wait (`Q2G`: for a tag, `I2D`: in the scheduler).
    pub stage: Order,
    /// IOs of this group and op numbered in this order.
    pub ios: u64,
    /// Those with at least one request ahead.
    pub waited: u64,
    /// Requests ahead of them, summed over the IOs (one request ahead of two IOs counts twice).
    pub ahead: u64,
    /// `ahead` by the group of the request that went ahead, largest first.
    pub by: Vec<AheadBy>,
    /// Requests ahead with no record here (lost, outside the capture, still in flight at its
    /// end): counted, not named.
    pub unrecorded: u64,
    /// The join stopped at its bound on work: the row covers some of its IOs only.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub partial: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AheadBy {
    pub group: String,
    pub requests: u64,
}

impl AheadRow {
    /// Share of `ahead` that `group` took (0 when nothing went ahead).
    pub fn share_of(&self, group: &str) -> f64 {
        let n = self.by.iter().find(|b| b.group == group).map_or(0, |b| b.requests);
        if self.ahead == 0 { 0.0 } else { n as f64 / self.ahead as f64 }
    }
}

impl Ahead {
    /// Keeps a completed request of `disk` (whole disk), charged to `group`, with its numbers.
    /// Numbers of none (a request never issued) are ignored.
    pub fn add(&mut self, disk: u32, op: Op, group: &str, rec: &AheadRecord) {
        if disk == 0 || (rec.getrq_seq == 0 && rec.issue_seq == 0) {
            return;
        }
        if self.entries.len() >= MAX_IOS {
            self.past_bound += 1;
            return;
        }
        let group = match self.index.get(group) {
            Some(g) => *g,
            None => {
                let g = self.groups.len() as u32;
                self.groups.push(group.to_owned());
                self.index.insert(group.to_owned(), g);
                g
            }
        };
        let numbers = Order::ALL.map(|o| o.of(rec));
        self.entries.push(Entry { disk, group, op, numbers });
    }

    /// The rows per disk, for every (group, op, order) with IOs numbered in that order.
    pub fn rows(&self) -> BTreeMap<u32, Vec<AheadRow>> {
        let mut out: BTreeMap<u32, Vec<AheadRow>> = BTreeMap::new();
        let mut walked = 0u64;
        let disks: std::collections::BTreeSet<u32> = self.entries.iter().map(|e| e.disk).collect();
        for disk in disks {
            let on_disk: Vec<&Entry> = self.entries.iter().filter(|e| e.disk == disk).collect();
            for (k, order) in Order::ALL.into_iter().enumerate() {
                let owners = Owners::of(on_disk.iter().map(|e| (e.numbers[k].1, e.group)));
                let mut rows: BTreeMap<(u32, Op), (AheadRow, BTreeMap<u32, u64>)> = BTreeMap::new();
                for e in &on_disk {
                    let (from, seq) = e.numbers[k];
                    if seq == 0 {
                        continue;
                    }
                    let (row, by) = rows.entry((e.group, e.op)).or_insert_with(|| {
                        (AheadRow::empty(self.groups[e.group as usize].clone(), e.op, order), BTreeMap::new())
                    });
                    row.ios += 1;
                    let Some(ahead) = ahead_between(from, seq).filter(|n| *n > 0) else { continue };
                    row.waited += 1;
                    row.ahead += u64::from(ahead);
                    if walked + u64::from(ahead) > MAX_WALK {
                        row.partial = true;
                        row.unrecorded += u64::from(ahead);
                        continue;
                    }
                    walked += u64::from(ahead);
                    let mut named = 0;
                    for n in 1..=ahead {
                        if let Some(g) = owners.get(from.wrapping_add(n)) {
                            *by.entry(g).or_default() += 1;
                            named += 1;
                        }
                    }
                    row.unrecorded += u64::from(ahead - named);
                }
                out.entry(disk).or_default().extend(rows.into_values().map(|(mut row, by)| {
                    row.by = by
                        .into_iter()
                        .map(|(g, requests)| AheadBy { group: self.groups[g as usize].clone(), requests })
                        .collect();
                    row.by.sort_by(|a, b| b.requests.cmp(&a.requests).then_with(|| a.group.cmp(&b.group)));
                    row
                }));
            }
        }
        out
    }
}

impl AheadRow {
    fn empty(group: String, op: Op, stage: Order) -> AheadRow {
        AheadRow {
            group,
            op,
            stage,
            ios: 0,
            waited: 0,
            ahead: 0,
            by: Vec::new(),
            unrecorded: 0,
            partial: false,
        }
    }
}

/// The group of each number of one disk's order, as its records tell.
struct Owners {
    /// The lowest number (wrapping arithmetic from here).
    base: u32,
    groups: Vec<u32>,
}

impl Owners {
    /// Numbers further apart than this are not laid out densely (a renumbered disk).
    const MAX_SPAN: u32 = 1 << 26;
    const NONE: u32 = u32::MAX;

    fn of(numbers: impl Iterator<Item = (u32, u32)> + Clone) -> Owners {
        let seen = numbers.clone().filter(|(n, _)| *n != 0);
        // The lowest number, wrapping: the one after the largest gap is where the order starts.
        let mut sorted: Vec<u32> = seen.clone().map(|(n, _)| n).collect();
        sorted.sort_unstable();
        let Some(&first) = sorted.first() else { return Owners { base: 0, groups: Vec::new() } };
        let mut base = first;
        let mut gap = first.wrapping_sub(*sorted.last().unwrap());
        for w in sorted.windows(2) {
            if w[1] - w[0] > gap {
                gap = w[1] - w[0];
                base = w[1];
            }
        }
        let span = seen.clone().map(|(n, _)| n.wrapping_sub(base)).max().unwrap_or(0);
        if span >= Owners::MAX_SPAN {
            return Owners { base, groups: Vec::new() };
        }
        let mut groups = vec![Owners::NONE; span as usize + 1];
        for (n, g) in seen {
            groups[n.wrapping_sub(base) as usize] = g;
        }
        Owners { base, groups }
    }

    fn get(&self, n: u32) -> Option<u32> {
        self.groups.get(n.wrapping_sub(self.base) as usize).copied().filter(|g| *g != Owners::NONE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(getrq: (u32, u32), issue: (u32, u32)) -> AheadRecord {
        AheadRecord {
            getrq_from: getrq.0,
            getrq_seq: getrq.1,
            issue_from: issue.0,
            issue_seq: issue.1,
            ..Default::default()
        }
    }

    #[test]
    fn the_requests_numbered_between_an_ios_two_numbers_are_named_by_their_group() {
        let mut a = Ahead::default();
        // Four of the noisy group take G's 1 to 4 while the quiet IO, queued when the count
        // was 0, waits; it gets G 5. Then it is issued after one noisy IO went ahead of it.
        for n in 1..=4 {
            a.add(7, Op::Read, "/noisy", &rec((n - 1, n), (n - 1, n)));
        }
        a.add(7, Op::Read, "/quiet", &rec((0, 5), (4, 6)));
        a.add(7, Op::Read, "/noisy", &rec((5, 6), (4, 5)));
        let rows = &a.rows()[&7];
        let quiet_g = rows.iter().find(|r| r.group == "/quiet" && r.stage == Order::Getrq).unwrap();
        assert_eq!((quiet_g.ios, quiet_g.waited, quiet_g.ahead, quiet_g.unrecorded), (1, 1, 4, 0));
        assert_eq!(quiet_g.by, vec![AheadBy { group: "/noisy".into(), requests: 4 }]);
        let quiet_d = rows.iter().find(|r| r.group == "/quiet" && r.stage == Order::Issue).unwrap();
        assert_eq!((quiet_d.ahead, quiet_d.share_of("/noisy")), (1, 1.0));
        let noisy_g = rows.iter().find(|r| r.group == "/noisy" && r.stage == Order::Getrq).unwrap();
        assert_eq!((noisy_g.ios, noisy_g.waited, noisy_g.ahead), (5, 0, 0));
    }

    #[test]
    fn a_number_without_a_record_is_counted_unrecorded_and_numbers_wrap() {
        let mut a = Ahead::default();
        a.add(1, Op::Write, "fio", &rec((u32::MAX - 1, u32::MAX), (0, 0)));
        // Ahead of this one: u32::MAX - 1 (no record), fio's u32::MAX, then 0 (the count's
        // wrap: an IO given it reads as unnumbered) and 1 (no record).
        a.add(1, Op::Write, "dd", &rec((u32::MAX - 2, 2), (0, 0)));
        let rows = &a.rows()[&1];
        let dd = rows.iter().find(|r| r.group == "dd").unwrap();
        assert_eq!((dd.ahead, dd.unrecorded), (4, 3));
        assert_eq!(dd.by, vec![AheadBy { group: "fio".into(), requests: 1 }]);
    }

    #[test]
    fn ios_without_numbers_are_not_kept() {
        let mut a = Ahead::default();
        a.add(1, Op::Read, "x", &rec((0, 0), (0, 0)));
        a.add(0, Op::Read, "x", &rec((0, 1), (0, 1)));
        assert!(a.rows().is_empty());
    }
}
