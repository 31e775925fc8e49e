//! Per-layer attribution on stacked devices (md, dm). Lower IOs name their upper bio
//! (`parent`); they complete before it, so their times wait here until the upper IO's record
//! arrives. Its time is then split, for each device below it, into: time in this layer before
//! the first lower IO was queued, time in the lower device, and time after the last lower
//! completion. The three add up to the upper IO's Q2C exactly.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use tracer_common::{IoRecord, event, kind};

/// Distinct lower devices kept per upper IO (raid members, dm table devices).
pub const MAX_LOWERS: usize = 8;
/// Upper IOs waiting for completion; beyond this the oldest knowledge is dropped and counted.
const MAX_PENDING: usize = 65_536;
/// Lower IOs with more than one upper IO ([`kind::LINK`]) waiting for their record.
const MAX_SHARED: usize = 4_096;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Upper Q to the first lower Q: time spent in this layer before any lower IO.
    Layer,
    /// First lower Q to last lower C: time in the device below.
    Lower,
    /// Last lower C to upper C: completion back up through this layer.
    Completion,
}

impl Phase {
    pub const ALL: [Phase; 3] = [Phase::Layer, Phase::Lower, Phase::Completion];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Layer => "layer",
            Phase::Lower => "lower",
            Phase::Completion => "completion",
        }
    }
}

/// One upper IO's time, split against one lower device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerSplit {
    /// The lower device (a traced device's `dev_t`).
    pub lower: u32,
    /// Lower IOs this upper IO sent to that device.
    pub ios: u32,
    pub layer_ns: u64,
    pub lower_ns: u64,
    pub completion_ns: u64,
}

impl LayerSplit {
    pub fn phase_ns(&self, phase: Phase) -> u64 {
        match phase {
            Phase::Layer => self.layer_ns,
            Phase::Lower => self.lower_ns,
            Phase::Completion => self.completion_ns,
        }
    }
}

/// When an IO entered its device: Q, or for a request that was never queued as a bio (the
/// clone request of request-based dm) its first event.
fn start(rec: &IoRecord) -> u64 {
    [event::Q, event::G, event::I, event::D].iter().map(|&e| rec.ts[e]).find(|&t| t != 0).unwrap_or(0)
}

#[derive(Clone, Copy, Debug, Default)]
struct LowerGroup {
    dev: u32,
    ios: u32,
    first_q: u64,
    last_c: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct Pending {
    groups: [LowerGroup; MAX_LOWERS],
    n: usize,
}

/// A lower IO by what its record and its link records both name: its device, its sector, and
/// its first upper IO.
type LowerKey = (u32, u64, u64);

#[derive(Debug, Default)]
pub struct Layers {
    pending: HashMap<u64, Pending>,
    /// Further upper IOs of a lower IO, from link records, until the lower IO's record.
    shared: HashMap<LowerKey, Vec<u64>>,
    /// Lower IOs whose upper IO never completed while tracked (dropped when full).
    pub orphaned: u64,
}

impl Layers {
    /// A link record: the upper IO `rec.id` also has data in the lower IO that names
    /// `rec.parent` first, on `rec.dev` at `rec.sector`.
    pub fn link_also(&mut self, rec: &IoRecord) {
        if self.shared.len() >= MAX_SHARED {
            // Lower IOs that never came (an untraced member): their knowledge goes.
            self.orphaned += self.shared.values().map(|v| v.len() as u64).sum::<u64>();
            self.shared.clear();
        }
        self.shared.entry((rec.dev, rec.sector, rec.parent)).or_default().push(rec.id);
    }

    /// A completed IO of device `lower`; kept if it was remapped from an upper bio, for its
    /// parent and for every further upper IO a link record named.
    pub fn lower_done(&mut self, lower: u32, rec: &IoRecord) {
        // A bio merged into a request ends with that request, which ends its upper IO: its
        // lower part lasts until the upper IO's C.
        let c = if rec.kind == kind::MERGE { u64::MAX } else { rec.ts[event::C] };
        let q = start(rec);
        if rec.parent == 0 || q == 0 || c == 0 {
            return;
        }
        let more = if self.shared.is_empty() {
            None
        } else {
            self.shared.remove(&(rec.dev, rec.sector, rec.parent))
        };
        self.add_lower(rec.parent, lower, q, c);
        for upper in more.into_iter().flatten() {
            self.add_lower(upper, lower, q, c);
        }
    }

    fn add_lower(&mut self, upper: u64, lower: u32, q: u64, c: u64) {
        if self.pending.len() >= MAX_PENDING && !self.pending.contains_key(&upper) {
            self.orphaned += self
                .pending
                .values()
                .map(|p| p.groups[..p.n].iter().map(|g| g.ios as u64).sum::<u64>())
                .sum::<u64>();
            self.pending.clear();
        }
        let p = self.pending.entry(upper).or_default();
        let i = match p.groups[..p.n].iter().position(|g| g.dev == lower) {
            Some(i) => i,
            None if p.n < MAX_LOWERS => {
                p.groups[p.n] = LowerGroup { dev: lower, ios: 0, first_q: q, last_c: c };
                p.n += 1;
                p.n - 1
            }
            None => return,
        };
        let g = &mut p.groups[i];
        g.ios += 1;
        g.first_q = g.first_q.min(q);
        g.last_c = g.last_c.max(c);
    }

    /// An IO completed: if lower IOs named it as parent, writes its splits into `out` and
    /// returns how many.
    pub fn upper_done(&mut self, rec: &IoRecord, out: &mut [LayerSplit; MAX_LOWERS]) -> usize {
        if rec.kind == kind::MERGE || rec.id == 0 || self.pending.is_empty() {
            return 0;
        }
        let Some(p) = self.pending.remove(&rec.id) else { return 0 };
        let (q, c) = (start(rec), rec.ts[event::C]);
        for (slot, g) in out.iter_mut().zip(&p.groups[..p.n]) {
            // Clamp into [Q, C] so the three parts always add up to Q2C.
            let first_q = g.first_q.clamp(q, c);
            let last_c = g.last_c.clamp(first_q, c);
            *slot = LayerSplit {
                lower: g.dev,
                ios: g.ios,
                layer_ns: first_q - q,
                lower_ns: last_c - first_q,
                completion_ns: c - last_c,
            };
        }
        p.n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bio(id: u64, parent: u64, q: u64, c: u64) -> IoRecord {
        let mut r = IoRecord { kind: kind::BIO, id, parent, ..Default::default() };
        (r.ts[event::Q], r.ts[event::C]) = (q, c);
        r
    }

    #[test]
    fn raid1_write_splits_per_member_and_adds_up() {
        let mut l = Layers::default();
        // md0 write (id 1) at Q=100, C=1000; members on devs 10 and 11.
        l.lower_done(10, &bio(50, 1, 200, 700));
        l.lower_done(11, &bio(51, 1, 250, 900));
        let mut out = [LayerSplit::default(); MAX_LOWERS];
        let n = l.upper_done(&bio(1, 0, 100, 1000), &mut out);
        assert_eq!(n, 2);
        assert_eq!(
            out[0],
            LayerSplit { lower: 10, ios: 1, layer_ns: 100, lower_ns: 500, completion_ns: 300 }
        );
        assert_eq!(
            out[1],
            LayerSplit { lower: 11, ios: 1, layer_ns: 150, lower_ns: 650, completion_ns: 100 }
        );
        for s in &out[..n] {
            assert_eq!(s.layer_ns + s.lower_ns + s.completion_ns, 900);
        }
        assert_eq!(l.upper_done(&bio(1, 0, 100, 1000), &mut out), 0, "an upper IO completes once");
    }

    #[test]
    fn several_lower_ios_on_one_device_form_one_group() {
        let mut l = Layers::default();
        l.lower_done(10, &bio(50, 7, 200, 400));
        l.lower_done(10, &bio(52, 7, 210, 600));
        let mut out = [LayerSplit::default(); MAX_LOWERS];
        assert_eq!(l.upper_done(&bio(7, 0, 150, 650), &mut out), 1);
        assert_eq!(out[0], LayerSplit { lower: 10, ios: 2, layer_ns: 50, lower_ns: 400, completion_ns: 50 });
    }

    #[test]
    fn a_merged_lower_bio_lasts_until_its_upper_io_completes() {
        let mut l = Layers::default();
        // Head bio 7 (Q=100) moved to path 10 at 150 and merged there at 160 into a request
        // that another bio allocated: the request ends both, so bio 7's C (900) ends its part.
        let mut merged = IoRecord { kind: kind::MERGE, id: 70, parent: 7, ..Default::default() };
        (merged.ts[event::Q], merged.ts[event::M]) = (150, 160);
        l.lower_done(10, &merged);
        let mut out = [LayerSplit::default(); MAX_LOWERS];
        assert_eq!(l.upper_done(&bio(7, 0, 100, 900), &mut out), 1);
        assert_eq!(out[0], LayerSplit { lower: 10, ios: 1, layer_ns: 50, lower_ns: 750, completion_ns: 0 });
        let unlinked = IoRecord { kind: kind::MERGE, id: 71, ..merged };
        l.lower_done(10, &IoRecord { parent: 0, ..unlinked });
        assert!(l.pending.is_empty(), "a merge that names no upper IO waits for nothing");
    }

    #[test]
    fn unlinked_ios_wait_for_nothing() {
        let mut l = Layers::default();
        let mut out = [LayerSplit::default(); MAX_LOWERS];
        l.lower_done(10, &bio(50, 0, 1, 2));
        assert!(l.pending.is_empty());
        assert_eq!(l.upper_done(&bio(9, 0, 1, 5), &mut out), 0);
    }

    #[test]
    fn request_based_dm_clone_requests_start_at_their_first_event() {
        let mut l = Layers::default();
        // The clone request on the path device: no Q, issued at 300, complete at 800.
        let mut clone = IoRecord { kind: kind::REQUEST, id: 77, parent: 5, ..Default::default() };
        (clone.ts[event::D], clone.ts[event::C]) = (300, 800);
        l.lower_done(10, &clone);
        // The upper request on dm-1: Q 100, G 150, D 250, C 900.
        let mut upper = IoRecord { kind: kind::REQUEST, id: 5, ..Default::default() };
        (upper.ts[event::Q], upper.ts[event::G], upper.ts[event::D], upper.ts[event::C]) =
            (100, 150, 250, 900);
        let mut out = [LayerSplit::default(); MAX_LOWERS];
        assert_eq!(l.upper_done(&upper, &mut out), 1);
        assert_eq!(
            out[0],
            LayerSplit { lower: 10, ios: 1, layer_ns: 200, lower_ns: 500, completion_ns: 100 }
        );
    }

    #[test]
    fn a_lower_io_shared_by_upper_ios_is_the_lower_io_of_each() {
        let mut l = Layers::default();
        // md raid5: one member write (bio 50 on dev 10 at sector 64) holds the data of upper
        // writes 1, 2 and 3 of one page; the kernel names 1 as parent, 2 and 3 in link records.
        for upper in [2, 3] {
            let link = IoRecord {
                kind: kind::LINK,
                id: upper,
                parent: 1,
                dev: 10,
                sector: 64,
                ..Default::default()
            };
            l.link_also(&link);
        }
        // Another member IO of upper 1 at another sector takes none of them.
        let mut other = bio(51, 1, 110, 300);
        (other.dev, other.sector) = (11, 8);
        l.lower_done(11, &other);
        let mut shared = bio(50, 1, 200, 700);
        (shared.dev, shared.sector) = (10, 64);
        l.lower_done(10, &shared);
        assert!(l.shared.is_empty(), "consumed by the lower IO's record");
        let mut out = [LayerSplit::default(); MAX_LOWERS];
        assert_eq!(l.upper_done(&bio(1, 0, 100, 1000), &mut out), 2);
        assert_eq!(
            out[1],
            LayerSplit { lower: 10, ios: 1, layer_ns: 100, lower_ns: 500, completion_ns: 300 }
        );
        for upper in [2, 3] {
            assert_eq!(l.upper_done(&bio(upper, 0, 150, 800), &mut out), 1, "upper {upper}");
            assert_eq!(
                out[0],
                LayerSplit { lower: 10, ios: 1, layer_ns: 50, lower_ns: 500, completion_ns: 100 }
            );
        }
    }
}
