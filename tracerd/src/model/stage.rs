//! Stages (blktrace intervals) and how each is computed from a record's event timestamps.
//! The one place that decides the stage list; metrics, report and snoop all ask here.

use serde::{Deserialize, Serialize};
use tracer_common::{IoRecord, agg, event, kind, qos};

/// An interval between two block-layer events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// blk-throttle's check to queued: the time a cgroup's `io.max` (v1 `blkio.throttle.*`)
    /// held the bio, before Q2C starts. Only bios of groups with limits have it.
    H2q,
    /// Queued to request allocated.
    Q2g,
    /// Request allocated to inserted into the scheduler.
    G2i,
    /// Inserted to issued to the driver.
    I2d,
    /// Allocated to issued, for requests dispatched directly (no I).
    G2d,
    /// Queued to issued: all time spent above the driver.
    Q2d,
    /// Issued to complete: driver and device.
    D2c,
    /// Queued to complete: end to end.
    Q2c,
    /// Queued to merged into an existing request.
    Q2m,
}

impl Stage {
    /// Q2M last: a completed IO has every stage before it.
    pub const ALL: [Stage; 9] = [
        Stage::H2q,
        Stage::Q2g,
        Stage::G2i,
        Stage::I2d,
        Stage::G2d,
        Stage::Q2d,
        Stage::D2c,
        Stage::Q2c,
        Stage::Q2m,
    ];
    pub const COUNT: usize = Stage::ALL.len();
    /// The stages of the kernel's series (`SeriesAgg`), in their order there.
    pub const KERNEL: [Stage; agg::STAGES] =
        [Stage::Q2g, Stage::G2i, Stage::I2d, Stage::G2d, Stage::Q2d, Stage::D2c, Stage::Q2c];

    pub fn as_str(self) -> &'static str {
        match self {
            Stage::H2q => "h2q",
            Stage::Q2g => "q2g",
            Stage::G2i => "g2i",
            Stage::I2d => "i2d",
            Stage::G2d => "g2d",
            Stage::Q2d => "q2d",
            Stage::D2c => "d2c",
            Stage::Q2c => "q2c",
            Stage::Q2m => "q2m",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    /// The events an interval runs between.
    fn events(self) -> (usize, usize) {
        match self {
            Stage::H2q => (event::H, event::Q),
            Stage::Q2g => (event::Q, event::G),
            Stage::G2i => (event::G, event::I),
            Stage::I2d => (event::I, event::D),
            Stage::G2d => (event::G, event::D),
            Stage::Q2d => (event::Q, event::D),
            Stage::D2c => (event::D, event::C),
            Stage::Q2c => (event::Q, event::C),
            Stage::Q2m => (event::Q, event::M),
        }
    }

    /// Nanoseconds of this stage for a record, or None where one of its events did not fire
    /// (never invented: a directly dispatched request has G2D, not G2I/I2D).
    pub fn of(self, rec: &IoRecord) -> Option<u64> {
        if self == Stage::G2d && rec.ts[event::I] != 0 {
            return None;
        }
        let (from, to) = self.events();
        let (a, b) = (rec.ts[from], rec.ts[to]);
        (a != 0 && b != 0).then(|| b.saturating_sub(a))
    }

    /// Calls `f` for every stage the record has.
    pub fn each_of(rec: &IoRecord, mut f: impl FnMut(Stage, u64)) {
        let stages: &[Stage] =
            if rec.kind == kind::MERGE { &[Stage::H2q, Stage::Q2m] } else { &Stage::ALL[..Stage::COUNT - 1] };
        for &s in stages {
            if let Some(ns) = s.of(rec) {
                f(s, ns);
            }
        }
    }
}

/// The events a request went through, as blktrace letters ("QGIDC", "GDC", ...).
pub fn path(rec: &IoRecord) -> String {
    let (letters, n) = path_letters(rec);
    String::from_utf8_lossy(&letters[..n]).into_owned()
}

/// The rq-qos policies of an IO's wait (`tracer_common::qos` bits), as `tracerd_io_qos_wait_seconds`
/// labels them: `wbt`, `iocost`, ..., joined by `+` where it waited in more than one.
pub fn qos_name(policies: u8) -> String {
    let names: Vec<&str> =
        qos::NAMES.iter().filter(|(bit, _)| policies & bit != 0).map(|(_, n)| *n).collect();
    names.join("+")
}

/// The bits of a [`qos_name`]; None for a name it never gives.
pub fn qos_bits(name: &str) -> Option<u8> {
    name.split('+').try_fold(0, |bits, n| Some(bits | qos::NAMES.iter().find(|(_, m)| *m == n)?.0))
}

/// Each event's letter, in the order paths spell them.
const LETTERS: [(usize, u8); event::COUNT] = [
    (event::H, b'H'),
    (event::Q, b'Q'),
    (event::G, b'G'),
    (event::I, b'I'),
    (event::D, b'D'),
    (event::C, b'C'),
    (event::M, b'M'),
];

/// The path of an event mask (bit i: event i fired), as [`path`] spells a record's.
pub fn path_of_mask(mask: usize) -> String {
    LETTERS.iter().filter(|(e, _)| mask & 1 << e != 0).map(|&(_, c)| c as char).collect()
}

/// Event paths: one per set of events (bit i: event i fired).
pub const PATHS: usize = 1 << event::COUNT;

/// Bitmask of the events a record has (bit = `tracer_common::event` index).
pub fn path_mask(rec: &IoRecord) -> usize {
    rec.ts.iter().enumerate().filter(|(_, t)| **t != 0).fold(0, |m, (i, _)| m | 1 << i)
}

/// [`path`] without allocating: the letters, and how many there are.
pub fn path_letters(rec: &IoRecord) -> ([u8; event::COUNT], usize) {
    let mut out = ([0u8; event::COUNT], 0);
    for (e, c) in LETTERS {
        if rec.ts[e] != 0 {
            out.0[out.1] = c;
            out.1 += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(q: u64, g: u64, i: u64, d: u64, c: u64) -> IoRecord {
        IoRecord { kind: kind::REQUEST, ts: [q, g, i, d, c, 0, 0], ..Default::default() }
    }

    fn stages(r: &IoRecord) -> Vec<(Stage, u64)> {
        let mut v = vec![];
        Stage::each_of(r, |s, ns| v.push((s, ns)));
        v
    }

    #[test]
    fn full_path_has_every_request_stage_but_g2d() {
        let r = rec(100, 150, 300, 700, 1700);
        assert_eq!(
            stages(&r),
            vec![
                (Stage::Q2g, 50),
                (Stage::G2i, 150),
                (Stage::I2d, 400),
                (Stage::Q2d, 600),
                (Stage::D2c, 1000),
                (Stage::Q2c, 1600)
            ]
        );
        assert_eq!(path(&r), "QGIDC");
    }

    #[test]
    fn direct_dispatch_has_g2d_and_no_invented_insert() {
        let r = rec(100, 150, 0, 700, 1700);
        let s = stages(&r);
        assert!(s.contains(&(Stage::G2d, 550)));
        assert!(!s.iter().any(|(st, _)| matches!(st, Stage::G2i | Stage::I2d)));
        assert_eq!(path(&r), "QGDC");
    }

    #[test]
    fn a_request_without_queue_event_has_only_what_fired() {
        let r = rec(0, 0, 300, 700, 1700);
        assert_eq!(stages(&r), vec![(Stage::I2d, 400), (Stage::D2c, 1000)]);
    }

    #[test]
    fn a_held_bio_has_h2q_before_its_queue_and_q2c_without_it() {
        let mut r = rec(10_000, 10_050, 0, 10_100, 11_100);
        r.ts[event::H] = 100;
        let s = stages(&r);
        assert_eq!(s[0], (Stage::H2q, 9_900));
        assert!(s.contains(&(Stage::Q2c, 1_100)), "Q2C starts at Q, after the hold");
        assert_eq!(path(&r), "HQGDC");
        assert_eq!(path_of_mask(path_mask(&r)), "HQGDC");
        let mut m = IoRecord { kind: kind::MERGE, ..Default::default() };
        (m.ts[event::H], m.ts[event::Q], m.ts[event::M]) = (5, 10, 25);
        assert_eq!(stages(&m), vec![(Stage::H2q, 5), (Stage::Q2m, 15)]);
    }

    #[test]
    fn qos_policies_are_named_and_joined() {
        assert_eq!(qos_name(tracer_common::qos::IOCOST), "iocost");
        assert_eq!(qos_name(tracer_common::qos::WBT | tracer_common::qos::IOCOST), "wbt+iocost");
        assert_eq!(qos_name(tracer_common::qos::OTHER), "rq_qos");
        for bits in 1..16 {
            assert_eq!(qos_bits(&qos_name(bits)), Some(bits));
        }
        assert_eq!(qos_bits("wbt+nope"), None);
    }

    #[test]
    fn kernel_stages_are_the_series_order() {
        assert_eq!(Stage::KERNEL.len(), agg::STAGES);
        assert_eq!(Stage::KERNEL.map(Stage::as_str), ["q2g", "g2i", "i2d", "g2d", "q2d", "d2c", "q2c"]);
    }

    #[test]
    fn merges_have_only_q2m() {
        let mut r = IoRecord { kind: kind::MERGE, ..Default::default() };
        r.ts[event::Q] = 10;
        r.ts[event::M] = 25;
        assert_eq!(stages(&r), vec![(Stage::Q2m, 15)]);
        assert_eq!(path(&r), "QM");
    }
}
