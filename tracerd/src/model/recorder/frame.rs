//! The frame being filled and the frames sealed: per (device, op) series in the kernel's
//! buckets, each counted as `Series` says, added up into a daemon aggregate when a window is
//! read.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use tracer_common::{IoRecord, SeriesAgg, agg, own};

use crate::model::{
    aggregate::{LayerStats, Lost, OpStats, PATHS, QD_BUCKETS, StageHist},
    causes::WaitTotals,
    layers::{LayerSplit, Phase},
    op::Op,
    series::{KernelSeries, Series},
    stage::Stage,
};
use crate::store::StoredFrame;

use super::codec;

/// One histogram in the kernel's buckets, with the exact sum.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buckets {
    pub sum_ns: u64,
    pub counts: [u64; agg::BUCKETS],
}

impl Buckets {
    pub(super) fn new() -> Box<Buckets> {
        Box::new(Buckets { sum_ns: 0, counts: [0; agg::BUCKETS] })
    }

    fn record(&mut self, ns: u64) {
        self.counts[agg::bucket_of(ns)] += 1;
        self.sum_ns += ns;
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Into a daemon histogram: each bucket's IOs at the bucket's middle, the sum exact.
    fn add_to(&self, h: &mut StageHist) {
        for (b, &n) in self.counts.iter().enumerate().filter(|(_, n)| **n != 0) {
            h.record_bucket(b, n);
        }
        h.sum_ns += self.sum_ns;
    }
}

fn record_in(slot: &mut Option<Box<Buckets>>, ns: u64) {
    slot.get_or_insert_with(Buckets::new).record(ns);
}

/// One lower device's share of a stacked device's IO in one frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerFrame {
    pub ios: u64,
    pub lower_ios: u64,
    pub phases: [Box<Buckets>; 3],
}

/// One (device, op) series in one frame.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeriesFrame {
    pub requests: u64,
    pub bytes: u64,
    pub merged_bios: u64,
    pub errors: u64,
    /// IOs below a stacked device that name no upper IO.
    pub unlinked: u64,
    /// The unlinked IOs by own kind (see `OpStats::own`).
    pub own: [u64; own::COUNT],
    pub qd: [u64; QD_BUCKETS],
    pub qd_sum: u64,
    pub qd_count: u64,
    /// Requests by event path (the bitmask of the events that fired).
    pub paths: BTreeMap<u8, u64>,
    pub stages: [Option<Box<Buckets>>; Stage::COUNT],
    pub layers: BTreeMap<u32, LayerFrame>,
    pub submit: Option<Box<Buckets>>,
    pub personality: Option<Box<Buckets>>,
    /// rq-qos waits inside Q2G, by the policies waited in (`tracer_common::qos` bits).
    pub qos: BTreeMap<u8, Box<Buckets>>,
}

impl Series for SeriesFrame {
    fn count_requests(&mut self, requests: u64, bytes: u64, errors: u64) {
        self.requests += requests;
        self.bytes += bytes;
        self.errors += errors;
    }

    fn count_path(&mut self, mask: usize, requests: u64) {
        *self.paths.entry(mask as u8).or_default() += requests;
    }

    fn record_queue_depth(&mut self, depth: u32) {
        self.qd[agg::qd_bucket(depth)] += 1;
        self.qd_sum += depth as u64;
        self.qd_count += 1;
    }

    fn record_stage(&mut self, stage: Stage, ns: u64) {
        record_in(&mut self.stages[stage.index()], ns);
    }

    fn count_merged_bio(&mut self) {
        self.merged_bios += 1;
    }

    fn count_unlinked(&mut self, own: usize) {
        self.unlinked += 1;
        self.own[own] += 1;
    }

    fn record_layer(&mut self, split: &LayerSplit) {
        let l = self.layers.entry(split.lower).or_insert_with(|| LayerFrame {
            ios: 0,
            lower_ios: 0,
            phases: [Buckets::new(), Buckets::new(), Buckets::new()],
        });
        l.ios += 1;
        l.lower_ios += split.ios as u64;
        for (b, phase) in l.phases.iter_mut().zip(Phase::ALL) {
            b.record(split.phase_ns(phase));
        }
    }

    fn record_submit(&mut self, ns: u64) {
        record_in(&mut self.submit, ns);
    }

    fn record_personality(&mut self, ns: u64) {
        record_in(&mut self.personality, ns);
    }

    fn record_qos(&mut self, policies: u8, ns: u64) {
        self.qos.entry(policies).or_insert_with(Buckets::new).record(ns);
    }
}

impl KernelSeries for SeriesFrame {
    fn add_queue_depths(&mut self, buckets: &[u32; agg::QD_BUCKETS], sum: u64, count: u64) {
        for (b, &n) in self.qd.iter_mut().zip(buckets) {
            *b += n as u64;
        }
        self.qd_sum += sum;
        self.qd_count += count;
    }

    fn add_stage_buckets(&mut self, stage: Stage, counts: &[u32; agg::BUCKETS], sum_ns: u64) {
        let b = self.stages[stage.index()].get_or_insert_with(Buckets::new);
        for (to, &n) in b.counts.iter_mut().zip(counts) {
            *to += n as u64;
        }
        b.sum_ns += sum_ns;
    }
}

impl SeriesFrame {
    /// Adds this series into the daemon's aggregate of `dev` and `op`.
    pub(super) fn add_to(&self, stats: &mut OpStats) {
        stats.requests += self.requests;
        stats.bytes += self.bytes;
        stats.merged_bios += self.merged_bios;
        stats.errors += self.errors;
        stats.unlinked += self.unlinked;
        for (to, &n) in stats.own.iter_mut().zip(&self.own) {
            *to += n;
        }
        for (&path, &n) in &self.paths {
            stats.paths[path as usize % PATHS] += n;
        }
        for (to, &n) in stats.queue_depth.buckets.iter_mut().zip(&self.qd) {
            *to += n;
        }
        stats.queue_depth.sum += self.qd_sum;
        stats.queue_depth.count += self.qd_count;
        for (slot, b) in stats.stages.iter_mut().zip(&self.stages) {
            if let Some(b) = b {
                b.add_to(slot.get_or_insert_with(StageHist::default_range));
            }
        }
        for (&lower, l) in &self.layers {
            let to = stats.layers.entry(lower).or_insert_with(|| LayerStats {
                ios: 0,
                lower_ios: 0,
                phases: [StageHist::default_range(), StageHist::default_range(), StageHist::default_range()],
            });
            to.ios += l.ios;
            to.lower_ios += l.lower_ios;
            for (h, b) in to.phases.iter_mut().zip(&l.phases) {
                b.add_to(h);
            }
        }
        for (slot, b) in [(&mut stats.submit, &self.submit), (&mut stats.personality, &self.personality)] {
            if let Some(b) = b {
                b.add_to(slot.get_or_insert_with(StageHist::default_range));
            }
        }
        for (&policies, b) in &self.qos {
            b.add_to(stats.qos.entry(policies).or_insert_with(StageHist::default_range));
        }
    }
}

/// The frame being filled: what happened since the last one was sealed.
#[derive(Debug, Default)]
pub struct FrameBuilder {
    series: HashMap<(u32, Op), SeriesFrame>,
    /// Per-cgroup series (an agent with `[cgroups] label`), by the label they were counted under.
    cgroups: HashMap<(u32, Op, Arc<str>), SeriesFrame>,
    /// Waits inside IOs' phases (config `causes`), per (device, op, phase, cause).
    waits: WaitTotals,
}

impl FrameBuilder {
    pub fn add_record(&mut self, dev: u32, op: Op, rec: &IoRecord, layers: &[LayerSplit]) {
        self.series.entry((dev, op)).or_default().add_record(rec, layers);
    }

    /// The record again, in its cgroup's series.
    pub fn add_cgroup_record(&mut self, dev: u32, op: Op, label: Arc<str>, rec: &IoRecord) {
        self.cgroups.entry((dev, op, label)).or_default().add_record(rec, &[]);
    }

    pub fn add_kernel(&mut self, dev: u32, op: Op, counted: &SeriesAgg) {
        if counted.requests != 0 {
            self.series.entry((dev, op)).or_default().add_kernel(counted);
        }
    }

    /// What the kernel counted in a cgroup's series, under the label it was counted under.
    pub fn add_cgroup_kernel(&mut self, dev: u32, op: Op, label: Arc<str>, counted: &SeriesAgg) {
        if counted.requests != 0 {
            self.cgroups.entry((dev, op, label)).or_default().add_kernel(counted);
        }
    }

    /// Waits counted per (device, op, phase, cause).
    pub fn add_waits(&mut self, waits: &WaitTotals) {
        for (&key, &sum) in waits {
            self.waits.entry(key).or_default().add(sum);
        }
    }

    /// Devices with IO in the frame being filled (lower devices of stacks included).
    pub fn devices(&self) -> impl Iterator<Item = u32> + '_ {
        self.series.iter().flat_map(|(&(dev, _), s)| std::iter::once(dev).chain(s.layers.keys().copied()))
    }

    /// Ends the frame `[start_ms, end_ms)` with the events lost in it.
    pub fn seal(&mut self, start_ms: u64, end_ms: u64, lost: &Lost) -> Frame {
        let w = codec::encode(&self.series, lost, &self.cgroups, &self.waits);
        self.series.clear();
        self.cgroups.clear();
        self.waits.clear();
        Frame { start_ms, end_ms, data: w.into() }
    }
}

/// One sealed interval, encoded.
#[derive(Clone, Debug)]
pub struct Frame {
    /// Wall-clock start and end (ms since the Unix epoch).
    pub start_ms: u64,
    pub end_ms: u64,
    data: Arc<[u8]>,
}

/// What one frame holds, decoded.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Decoded {
    pub series: Vec<((u32, Op), SeriesFrame)>,
    pub lost: Lost,
    /// Per-cgroup series: ((device, op, cgroup label), series).
    pub cgroups: Vec<((u32, Op, String), SeriesFrame)>,
    /// Waits inside IOs' phases (config `causes`); none in a frame of an agent without them.
    pub waits: WaitTotals,
}

/// A frame that does not decode: a bug, reported instead of a wrong answer.
#[derive(Debug, thiserror::Error)]
#[error("the recorder's frame at {start_ms} ms is damaged at byte {at}; please report this as a bug")]
pub struct Damaged {
    pub start_ms: u64,
    pub at: usize,
}

impl Frame {
    /// A frame read back from the store.
    pub fn from_parts(start_ms: u64, end_ms: u64, data: Arc<[u8]>) -> Frame {
        Frame { start_ms, end_ms, data }
    }

    /// The encoded bytes (what the store writes).
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Memory the frame takes: its bytes, the shared allocation's header, the entry.
    pub fn size(&self) -> usize {
        self.data.len() + 16 + std::mem::size_of::<Frame>()
    }

    pub fn decode(&self) -> Result<Decoded, Damaged> {
        codec::decode(&self.data).map_err(|at| Damaged { start_ms: self.start_ms, at })
    }
}

impl StoredFrame for Frame {
    fn span_ms(&self) -> (u64, u64) {
        (self.start_ms, self.end_ms)
    }

    fn data(&self) -> &[u8] {
        &self.data
    }

    fn from_stored(start_ms: u64, end_ms: u64, data: &[u8]) -> Frame {
        Frame::from_parts(start_ms, end_ms, data.into())
    }
}

#[cfg(test)]
mod tests {
    use tracer_common::{event, flag, kind, qos};

    use super::super::{
        Window,
        testing::{request, stacked},
    };
    use super::*;

    #[test]
    fn a_frame_decodes_to_what_was_added() {
        let mut b = FrameBuilder::default();
        for i in 0..100 {
            b.add_record(
                1,
                Op::Read,
                &request(1000, 5000 + i, 50_000 + i * 1000, 4096, 1 + i as u32 % 40),
                &[],
            );
        }
        let mut merge = IoRecord { kind: kind::MERGE, bytes: 512, ..Default::default() };
        (merge.ts[event::Q], merge.ts[event::M]) = (10, 2010);
        b.add_record(1, Op::Write, &merge, &[]);
        let (upper, splits) = stacked();
        b.add_record(9, Op::Write, &upper, &splits);
        // Waits in io.cost, and in wbt and io.cost at once, inside Q2G.
        for (policies, ns) in [(qos::IOCOST, 7000), (qos::IOCOST, 9000), (qos::WBT | qos::IOCOST, 30_000)] {
            let r = IoRecord { qos: policies, qos_ns: ns, ..request(1000, 50_000, 60_000, 4096, 1) };
            b.add_record(3, Op::Write, &r, &[]);
        }
        // md's own IO below it, by kind.
        for own in [own::PARITY, own::PARITY, own::UNSTATED] {
            b.add_record(
                7,
                Op::Write,
                &IoRecord { flags: flag::UNLINKED, own, ..request(10, 20, 30, 4096, 1) },
                &[],
            );
        }
        let mut counted = SeriesAgg::default();
        counted.add_record(&request(0, 1_000_000, 3_000_000_000, 65536, 7), &[]);
        b.add_kernel(2, Op::Write, &counted);
        // Waits by cause (config `causes`), added twice.
        use crate::model::causes::{Cause, Phase as WaitPhase, WaitSum};
        let waits: crate::model::causes::WaitTotals = [
            ((3, Op::Write, WaitPhase::Q2g, Cause::Tag), WaitSum { waits: 4, ns: 90_000 }),
            ((9, Op::Write, WaitPhase::Submit, Cause::MdSuperblock), WaitSum { waits: 1, ns: 1_200_000 }),
        ]
        .into();
        b.add_waits(&waits);
        b.add_waits(&waits);
        let expected: BTreeMap<(u32, Op), SeriesFrame> = b.series.clone().into_iter().collect();
        let lost = Lost { stale_bio: 3, kernel: [0, 0, 0, 0, 0, 2, 0, 0], ..Default::default() };
        let frame = b.seal(1_000, 2_000, &lost);
        assert!(b.series.is_empty() && b.waits.is_empty(), "sealing starts a new frame");
        let d = frame.decode().unwrap();
        assert_eq!(d.waits.len(), 2);
        assert_eq!(d.waits[&(3, Op::Write, WaitPhase::Q2g, Cause::Tag)], WaitSum { waits: 8, ns: 180_000 });
        let w = Window { frames: vec![frame.clone()], ..Default::default() };
        let (agg, _) = w.aggregate().unwrap();
        assert_eq!(
            agg.series[&(9, Op::Write)].waits[&(WaitPhase::Submit, Cause::MdSuperblock)],
            WaitSum { waits: 2, ns: 2_400_000 }
        );
        assert_eq!(expected[&(7, Op::Write)].own, [1, 2, 0, 0, 0, 0, 0]);
        assert_eq!(d.series.into_iter().collect::<BTreeMap<_, _>>(), expected);
        assert_eq!(d.lost, lost);
        // Bytes: 5 series of up to 8 stages in a few hundred bytes, not kilobytes.
        assert!(frame.data.len() < 800, "{} bytes", frame.data.len());
    }

    #[test]
    fn a_frame_without_waits_has_no_wait_section_and_a_bad_one_is_damage() {
        use crate::model::causes::{Cause, Phase as WaitPhase, WaitSum};
        let mut b = FrameBuilder::default();
        b.add_record(1, Op::Read, &request(1000, 5000, 50_000, 4096, 3), &[]);
        let plain = b.seal(0, 1000, &Lost::default());
        assert!(plain.decode().unwrap().waits.is_empty());
        b.add_record(1, Op::Read, &request(1000, 5000, 50_000, 4096, 3), &[]);
        b.add_waits(&[((1, Op::Read, WaitPhase::Q2g, Cause::Tag), WaitSum { waits: 1, ns: 10 })].into());
        let with = b.seal(0, 1000, &Lost::default());
        assert_eq!(&with.data[..plain.data.len()], &plain.data[..], "the section only follows");
        // A cause this version does not know is damage, not a guess.
        let mut bad = with.data.to_vec();
        let at = plain.data.len() + 3;
        bad[at] = Cause::ALL.len() as u8;
        assert!(Frame { data: bad.into(), ..with }.decode().is_err());
    }

    #[test]
    fn cgroup_series_ride_in_the_frames_and_add_up_per_label() {
        let mut b = FrameBuilder::default();
        let r = request(1000, 2000, 9000, 4096, 1);
        for label in ["/a", "/a", "/b"] {
            b.add_record(7, Op::Read, &r, &[]);
            b.add_cgroup_record(7, Op::Read, label.into(), &r);
        }
        let frames = [b.seal(0, 1000, &Lost::default()), {
            b.add_cgroup_record(7, Op::Write, "/a".into(), &r);
            b.seal(1000, 2000, &Lost::default())
        }];
        let d = frames[0].decode().unwrap();
        assert_eq!(d.cgroups.len(), 2);
        assert_eq!(d.cgroups[0].0, (7, Op::Read, "/a".to_owned()));
        assert_eq!(d.cgroups[0].1.requests, 2);
        let w = Window { frames: frames.to_vec(), ..Default::default() };
        let per = w.aggregate_cgroups().unwrap();
        assert_eq!(per.keys().collect::<Vec<_>>(), ["/a", "/b"]);
        assert_eq!(per["/a"].series[&(7, Op::Read)].requests, 2);
        assert_eq!(per["/a"].series[&(7, Op::Write)].requests, 1);
        assert_eq!(per["/b"].series[&(7, Op::Read)].stage(Stage::D2c).unwrap().count(), 1);
    }

    #[test]
    fn damaged_frames_are_errors_not_panics() {
        let mut b = FrameBuilder::default();
        b.add_record(1, Op::Read, &request(1000, 5000, 50_000, 4096, 3), &[]);
        let frame = b.seal(0, 1000, &Lost::default());
        for cut in 0..frame.data.len() {
            let f = Frame { data: frame.data[..cut].into(), ..frame.clone() };
            assert!(f.decode().is_err(), "cut at {cut}");
        }
        let mut long = frame.data.to_vec();
        long.push(0);
        assert!(Frame { data: long.into(), ..frame }.decode().is_err(), "trailing bytes");
    }
}
