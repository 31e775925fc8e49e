//! The flight recorder: what the agent saw, interval by interval (1 s by default), for the
//! last hour (config `[recorder]`), so that a view can ask about the past.
//!
//! A frame holds one interval's IO per (device, op): requests, bytes, merged bios, errors,
//! queue depths at issue, event paths, and a histogram of every stage, of every layer phase
//! (stacked devices) and of the submit and personality times, with exact sums; and the events
//! lost in the interval; an agent with `[cgroups] label` adds the same per (device, op,
//! cgroup label). Histograms use the kernel's buckets (`tracer_common::agg`: R10
//! steps, each bound at most 1.28 times the one below), the resolution in-kernel aggregation
//! already has. Frames are stored varint-encoded, so memory follows the IO done (an idle
//! device costs nothing) and is bounded twice: by the retention and by `max_bytes`, oldest
//! frames first; both drops are counted.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::Arc,
    time::Duration,
};

use tracer_common::{IoRecord, SeriesAgg, agg, own};

use crate::model::{
    aggregate::{Aggregator, LayerStats, Lost, OpStats, PATHS, QD_BUCKETS, StageHist},
    layers::{LayerSplit, Phase},
    op::Op,
    series::{KernelSeries, Series},
    stage::Stage,
    topology::{Device, Topology},
};
use crate::store::{Gap, Reads, Store, Unreadable};

/// Bounds of the recorder (config `[recorder]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecorderLimits {
    /// The length of one frame.
    pub resolution: Duration,
    /// How far back frames are kept.
    pub retention: Duration,
    /// The most memory the frames may take (their encoded bytes and bookkeeping).
    pub max_bytes: usize,
}

impl Default for RecorderLimits {
    fn default() -> RecorderLimits {
        RecorderLimits {
            resolution: Duration::from_secs(1),
            retention: Duration::from_secs(3600),
            max_bytes: 32 << 20,
        }
    }
}

/// The ops a frame can name, by their code in the encoding.
const OPS: [Op; 5] = [Op::Read, Op::Write, Op::Flush, Op::Discard, Op::Other];

fn op_code(op: Op) -> u8 {
    OPS.iter().position(|&o| o == op).unwrap_or(OPS.len() - 1) as u8
}

/// One histogram in the kernel's buckets, with the exact sum.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buckets {
    pub sum_ns: u64,
    pub counts: [u64; agg::BUCKETS],
}

impl Buckets {
    fn new() -> Box<Buckets> {
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
    fn add_to(&self, stats: &mut OpStats) {
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

    /// Devices with IO in the frame being filled (lower devices of stacks included).
    pub fn devices(&self) -> impl Iterator<Item = u32> + '_ {
        self.series.iter().flat_map(|(&(dev, _), s)| std::iter::once(dev).chain(s.layers.keys().copied()))
    }

    /// Ends the frame `[start_ms, end_ms)` with the events lost in it.
    pub fn seal(&mut self, start_ms: u64, end_ms: u64, lost: &Lost) -> Frame {
        let mut keys: Vec<(u32, Op)> = self.series.keys().copied().collect();
        keys.sort_unstable();
        let mut w = Vec::with_capacity(64 + 400 * keys.len());
        varint(&mut w, keys.len() as u64);
        for key in keys {
            encode_series(&mut w, key, &self.series[&key]);
        }
        let lost: Vec<(usize, u64)> =
            lost.reasons().iter().enumerate().filter(|(_, r)| r.1 != 0).map(|(i, r)| (i, r.1)).collect();
        varint(&mut w, lost.len() as u64);
        for (i, n) in lost {
            w.push(i as u8);
            varint(&mut w, n);
        }
        let mut keys: Vec<&(u32, Op, Arc<str>)> = self.cgroups.keys().collect();
        keys.sort_unstable();
        varint(&mut w, keys.len() as u64);
        for key in keys {
            varint(&mut w, key.2.len() as u64);
            w.extend_from_slice(key.2.as_bytes());
            encode_series(&mut w, (key.0, key.1), &self.cgroups[key]);
        }
        self.series.clear();
        self.cgroups.clear();
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
        let mut r = Reader { data: &self.data, at: 0 };
        let damaged = |r: &Reader| Damaged { start_ms: self.start_ms, at: r.at };
        let mut out = Decoded::default();
        let n = r.varint().ok_or_else(|| damaged(&r))?;
        for _ in 0..n {
            out.series.push(decode_series(&mut r).ok_or_else(|| damaged(&r))?);
        }
        let n = r.varint().ok_or_else(|| damaged(&r))?;
        let mut counters = out.lost.counters_mut();
        for _ in 0..n {
            let i = r.byte().ok_or_else(|| damaged(&r))? as usize;
            let v = r.varint().ok_or_else(|| damaged(&r))?;
            **counters.get_mut(i).ok_or_else(|| damaged(&r))? += v;
        }
        let n = r.varint().ok_or_else(|| damaged(&r))?;
        for _ in 0..n {
            let len = r.varint().ok_or_else(|| damaged(&r))? as usize;
            let label =
                r.bytes(len).and_then(|b| String::from_utf8(b.to_vec()).ok()).ok_or_else(|| damaged(&r))?;
            let ((dev, op), series) = decode_series(&mut r).ok_or_else(|| damaged(&r))?;
            out.cgroups.push(((dev, op, label), series));
        }
        if r.at != self.data.len() {
            return Err(damaged(&r));
        }
        Ok(out)
    }
}

/// The frames of the retention window, and the devices they name.
#[derive(Debug, Default)]
pub struct Recorder {
    pub limits: RecorderLimits,
    frames: VecDeque<Frame>,
    bytes: usize,
    /// Every device a kept frame names, as it was when first seen (it may be gone since), and
    /// the end of the newest frame that names it: a device no kept frame names is forgotten.
    devices: HashMap<u32, (Device, u64)>,
    /// Frames dropped before their time because the frames took `max_bytes`.
    pub dropped_for_memory: u64,
    /// The store on disk: every frame is written to it, and windows older than the frames in
    /// memory are read from it.
    pub store: Option<Store>,
}

/// A window of frames, taken from the recorder: decoded outside its lock.
#[derive(Debug, Default)]
pub struct Window {
    pub frames: Vec<Frame>,
    pub topology: Topology,
    /// Where the window has no frames because no agent ran (from the store).
    pub gaps: Vec<Gap>,
    /// Frames of the window the store could not read back (damaged on disk): left out.
    pub damaged_frames: u64,
}

impl Window {
    /// The span the frames cover, `[start_ms, end_ms)`.
    pub fn span(&self) -> Option<(u64, u64)> {
        Some((self.frames.first()?.start_ms, self.frames.last()?.end_ms))
    }

    /// Every frame added up, as `report` aggregates a capture.
    pub fn aggregate(&self) -> Result<(Aggregator, Lost), Damaged> {
        let mut agg = Aggregator::new(false);
        let mut lost = Lost::default();
        for frame in &self.frames {
            let d = frame.decode()?;
            for ((dev, op), s) in &d.series {
                for dev in std::iter::once(*dev).chain(s.layers.keys().copied()) {
                    agg.names.entry(dev).or_insert_with(|| self.topology.name_of(dev));
                }
                s.add_to(agg.series.entry((*dev, *op)).or_default());
            }
            lost.add(&d.lost);
        }
        Ok((agg, lost))
    }

    /// Every frame's per-cgroup series added up: an aggregate per cgroup label (empty when the
    /// agent keeps none).
    pub fn aggregate_cgroups(&self) -> Result<BTreeMap<String, Aggregator>, Damaged> {
        let mut out: BTreeMap<String, Aggregator> = BTreeMap::new();
        for frame in &self.frames {
            for ((dev, op, label), s) in frame.decode()?.cgroups {
                let agg = out.entry(label).or_default();
                agg.names.entry(dev).or_insert_with(|| self.topology.name_of(dev));
                s.add_to(agg.series.entry((dev, op)).or_default());
            }
        }
        Ok(out)
    }
}

/// A window planned by `Recorder::plan_window`.
#[derive(Debug, Default)]
pub struct PlannedWindow {
    /// The store's frames to read: older than the memory's.
    reads: Option<Reads>,
    /// The start of the oldest frame in memory.
    in_memory: u64,
    memory: Vec<Frame>,
    devices: Vec<Device>,
    gaps: Vec<Gap>,
}

impl PlannedWindow {
    /// Reads the store's frames (disk IO), and what of them was damaged: the caller counts it
    /// into the store's health.
    pub fn read(self) -> (Window, Unreadable) {
        let (mut frames, bad) = self.reads.map(Reads::frames).unwrap_or_default();
        frames.retain(|f| f.start_ms < self.in_memory);
        frames.extend(self.memory);
        let window = Window {
            frames,
            topology: Topology::from_devices(self.devices),
            gaps: self.gaps,
            damaged_frames: bad.records,
        };
        (window, bad)
    }
}

impl Recorder {
    pub fn new(limits: RecorderLimits) -> Recorder {
        Recorder { limits, ..Default::default() }
    }

    /// Keeps a sealed frame, with the devices it names (from the topology of the moment), and
    /// drops what the bounds no longer allow.
    pub fn push(&mut self, frame: Frame, devices: impl IntoIterator<Item = Device>) {
        let devices: Vec<Device> = devices.into_iter().collect();
        if let Some(store) = &mut self.store {
            store.append(&frame, &devices);
        }
        for d in devices {
            self.devices.entry(d.dev).or_insert((d, 0)).1 = frame.end_ms;
        }
        self.bytes += frame.size();
        self.frames.push_back(frame);
        self.trim();
    }

    fn trim(&mut self) {
        let newest = self.frames.back().map_or(0, |f| f.end_ms);
        let keep_from = newest.saturating_sub(self.limits.retention.as_millis() as u64);
        while let Some(f) = self.frames.front() {
            let too_old = f.end_ms <= keep_from;
            // The newest frame always stays, so that a view sees the last interval.
            let too_big = self.bytes > self.limits.max_bytes && self.frames.len() > 1;
            if !too_old && !too_big {
                break;
            }
            self.dropped_for_memory += (!too_old) as u64;
            self.bytes -= f.size();
            self.frames.pop_front();
        }
        let oldest = self.frames.front().map_or(u64::MAX, |f| f.start_ms);
        self.devices.retain(|_, (_, seen)| *seen > oldest);
    }

    /// Memory the frames take (what `max_bytes` bounds).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.frames.len()
    }

    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// The span the kept frames cover, `[start_ms, end_ms)`: on disk and in memory.
    pub fn span(&self) -> Option<(u64, u64)> {
        let memory = Some((self.frames.front()?.start_ms, self.frames.back()?.end_ms));
        match (self.store.as_ref().and_then(Store::span), memory) {
            (Some(d), Some(m)) => Some((d.0.min(m.0), d.1.max(m.1))),
            (d, m) => d.or(m),
        }
    }

    /// The frames that overlap `[from_ms, to_ms)`, with the devices known: from memory, and
    /// before the oldest frame in memory from the store.
    pub fn window(&mut self, from_ms: u64, to_ms: u64) -> Window {
        let (window, bad) = self.plan_window(from_ms, to_ms).read();
        if let Some(store) = &mut self.store {
            store.count_unreadable(bad);
        }
        window
    }

    /// A window to read: what it needs of the recorder, taken under the agent's lock; the
    /// store's frames are read by `PlannedWindow::read`, outside it.
    pub fn plan_window(&self, from_ms: u64, to_ms: u64) -> PlannedWindow {
        let in_memory = self.frames.front().map_or(u64::MAX, |f| f.start_ms);
        let mut planned = PlannedWindow { in_memory, ..Default::default() };
        if let Some(store) = &self.store {
            if from_ms < in_memory {
                planned.reads = Some(store.plan_frames(from_ms, to_ms.min(in_memory)));
            }
            planned.devices.extend(store.devices().cloned());
            planned.gaps = store.gaps(from_ms, to_ms);
        }
        planned.memory =
            self.frames.iter().filter(|f| f.end_ms > from_ms && f.start_ms < to_ms).cloned().collect();
        // The memory's devices are the newest: they win over the store's.
        planned.devices.extend(self.devices.values().map(|(d, _)| d.clone()));
        planned
    }

    /// Devices the kept frames name.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }
}

fn varint(w: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        w.push(v as u8 | 0x80);
        v >>= 7;
    }
    w.push(v as u8);
}

fn encode_buckets(w: &mut Vec<u8>, b: &Buckets) {
    varint(w, b.sum_ns);
    let nonzero = b.counts.iter().filter(|&&n| n != 0).count();
    w.push(nonzero as u8);
    for (i, &n) in b.counts.iter().enumerate().filter(|(_, n)| **n != 0) {
        w.push(i as u8);
        varint(w, n);
    }
}

fn encode_series(w: &mut Vec<u8>, (dev, op): (u32, Op), s: &SeriesFrame) {
    varint(w, dev as u64);
    w.push(op_code(op));
    for v in [s.requests, s.bytes, s.merged_bios, s.errors, s.unlinked, s.qd_sum, s.qd_count] {
        varint(w, v);
    }
    let qd: Vec<(usize, u64)> = s.qd.iter().copied().enumerate().filter(|(_, n)| *n != 0).collect();
    w.push(qd.len() as u8);
    for (k, n) in qd {
        w.push(k as u8);
        varint(w, n);
    }
    w.push(s.paths.len() as u8);
    for (&path, &n) in &s.paths {
        w.push(path);
        varint(w, n);
    }
    let own: Vec<(usize, u64)> = s.own.iter().copied().enumerate().filter(|(_, n)| *n != 0).collect();
    w.push(own.len() as u8);
    for (k, n) in own {
        w.push(k as u8);
        varint(w, n);
    }
    // One bit per stage.
    const { assert!(Stage::COUNT <= 16) };
    let present = s.stages.iter().enumerate().filter(|(_, b)| b.is_some()).fold(0u16, |m, (i, _)| m | 1 << i);
    w.extend_from_slice(&present.to_le_bytes());
    for b in s.stages.iter().flatten() {
        encode_buckets(w, b);
    }
    w.push(s.submit.is_some() as u8 | (s.personality.is_some() as u8) << 1);
    for b in s.submit.iter().chain(&s.personality) {
        encode_buckets(w, b);
    }
    w.push(s.qos.len() as u8);
    for (&policies, b) in &s.qos {
        w.push(policies);
        encode_buckets(w, b);
    }
    varint(w, s.layers.len() as u64);
    for (&lower, l) in &s.layers {
        varint(w, lower as u64);
        varint(w, l.ios);
        varint(w, l.lower_ios);
        for b in &l.phases {
            encode_buckets(w, b);
        }
    }
}

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn byte(&mut self) -> Option<u8> {
        let b = *self.data.get(self.at)?;
        self.at += 1;
        Some(b)
    }

    fn varint(&mut self) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    }

    fn bytes(&mut self, n: usize) -> Option<&[u8]> {
        let b = self.data.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(b)
    }

    fn buckets(&mut self) -> Option<Box<Buckets>> {
        let mut b = Buckets::new();
        b.sum_ns = self.varint()?;
        for _ in 0..self.byte()? {
            let i = self.byte()? as usize;
            *b.counts.get_mut(i)? = self.varint()?;
        }
        Some(b)
    }
}

fn decode_series(r: &mut Reader) -> Option<((u32, Op), SeriesFrame)> {
    let dev = u32::try_from(r.varint()?).ok()?;
    let op = *OPS.get(r.byte()? as usize)?;
    let mut s = SeriesFrame::default();
    for v in [
        &mut s.requests,
        &mut s.bytes,
        &mut s.merged_bios,
        &mut s.errors,
        &mut s.unlinked,
        &mut s.qd_sum,
        &mut s.qd_count,
    ] {
        *v = r.varint()?;
    }
    for _ in 0..r.byte()? {
        let k = r.byte()? as usize;
        *s.qd.get_mut(k)? = r.varint()?;
    }
    for _ in 0..r.byte()? {
        let path = r.byte()?;
        s.paths.insert(path, r.varint()?);
    }
    for _ in 0..r.byte()? {
        let k = r.byte()? as usize;
        *s.own.get_mut(k)? = r.varint()?;
    }
    let present = u16::from_le_bytes([r.byte()?, r.byte()?]);
    for (i, slot) in s.stages.iter_mut().enumerate() {
        if present & 1 << i != 0 {
            *slot = Some(r.buckets()?);
        }
    }
    let extra = r.byte()?;
    if extra & 1 != 0 {
        s.submit = Some(r.buckets()?);
    }
    if extra & 2 != 0 {
        s.personality = Some(r.buckets()?);
    }
    for _ in 0..r.byte()? {
        let policies = r.byte()?;
        s.qos.insert(policies, r.buckets()?);
    }
    for _ in 0..r.varint()? {
        let lower = u32::try_from(r.varint()?).ok()?;
        let (ios, lower_ios) = (r.varint()?, r.varint()?);
        let phases = [r.buckets()?, r.buckets()?, r.buckets()?];
        s.layers.insert(lower, LayerFrame { ios, lower_ios, phases });
    }
    Some(((dev, op), s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracer_common::{event, flag, kind, qos};

    fn request(q: u64, d: u64, c: u64, bytes: u32, qd: u32) -> IoRecord {
        let mut r = IoRecord { kind: kind::REQUEST, bytes, queue_depth: qd, ..Default::default() };
        (r.ts[event::Q], r.ts[event::G], r.ts[event::D], r.ts[event::C]) = (q, q + 150, d, c);
        r
    }

    fn stacked() -> (IoRecord, [LayerSplit; 1]) {
        let mut upper = IoRecord {
            kind: kind::BIO,
            bytes: 8192,
            submit_ns: 3000,
            personality_ns: 900,
            ..Default::default()
        };
        (upper.ts[event::Q], upper.ts[event::C]) = (100, 90_100);
        let split = LayerSplit { lower: 7, ios: 2, layer_ns: 1000, lower_ns: 80_000, completion_ns: 9000 };
        (upper, [split])
    }

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
        let expected: BTreeMap<(u32, Op), SeriesFrame> = b.series.clone().into_iter().collect();
        let lost = Lost { stale_bio: 3, kernel: [0, 0, 0, 0, 0, 2], ..Default::default() };
        let frame = b.seal(1_000, 2_000, &lost);
        assert!(b.series.is_empty(), "sealing starts a new frame");
        let d = frame.decode().unwrap();
        assert_eq!(expected[&(7, Op::Write)].own, [1, 2, 0, 0, 0]);
        assert_eq!(d.series.into_iter().collect::<BTreeMap<_, _>>(), expected);
        assert_eq!(d.lost, lost);
        // Bytes: 5 series of up to 8 stages in a few hundred bytes, not kilobytes.
        assert!(frame.data.len() < 800, "{} bytes", frame.data.len());
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

    #[test]
    fn a_window_adds_up_like_the_records_at_bucket_resolution() {
        let mut rec = Recorder::new(RecorderLimits::default());
        let mut direct = Aggregator::new(false);
        let mut b = FrameBuilder::default();
        let (upper, splits) = stacked();
        for second in 0..5u64 {
            for i in 0..20 {
                let r = request(1000, 3000, 100_000 * (i + 1), 4096, 2);
                b.add_record(1, Op::Read, &r, &[]);
                direct.add(1, Op::Read, &r, &[], |_| "loop0".into());
            }
            b.add_record(9, Op::Write, &upper, &splits);
            direct.add(9, Op::Write, &upper, &splits, |_| "md0".into());
            let lost = Lost { stale_request: second, ..Default::default() };
            rec.push(b.seal(second * 1000, second * 1000 + 1000, &lost), []);
        }
        assert_eq!((rec.len(), rec.span()), (5, Some((0, 5000))));
        let w = rec.window(1000, 3000);
        assert_eq!(w.span(), Some((1000, 3000)), "frames overlapping the window");
        let (agg, lost) = w.aggregate().unwrap();
        assert_eq!(lost.stale_request, 1 + 2);
        let s = &agg.series[&(1, Op::Read)];
        assert_eq!((s.requests, s.bytes, s.queue_depth.count), (40, 40 * 4096, 40));
        let (all, _) = rec.window(0, u64::MAX).aggregate().unwrap();
        for ((key, a), stage) in
            [((1, Op::Read), Stage::D2c), ((1, Op::Read), Stage::Q2g), ((9, Op::Write), Stage::Q2c)]
                .map(|(k, s)| ((k, &all.series[&k]), s))
        {
            let d = &direct.series[&key];
            let (x, y) = (a.stage(stage).unwrap(), d.stage(stage).unwrap());
            assert_eq!((x.count(), x.sum_ns), (y.count(), y.sum_ns), "{key:?} {stage:?}");
            // Quantiles within the kernel bucket's width (bounds at most 1.28 apart).
            let (p, q) = (x.hist.value_at_quantile(0.99) as f64, y.hist.value_at_quantile(0.99) as f64);
            assert!((p / q - 1.0).abs() < 0.15, "{key:?} {stage:?} p99 {p} vs {q}");
        }
        let (a, d) = (&all.series[&(9, Op::Write)], &direct.series[&(9, Op::Write)]);
        assert_eq!((a.layers[&7].ios, a.layers[&7].lower_ios), (5, 10));
        assert_eq!(a.layers[&7].phases[1].sum_ns, d.layers[&7].phases[1].sum_ns);
        assert_eq!(a.submit.as_ref().unwrap().sum_ns, 5 * 3000);
        assert_eq!(a.paths, d.paths);
        // A window's capture is one `tracerd diff` reads back.
        use crate::commands::capture::{Capture, Meta};
        let meta = Meta { kernel: "6.18".into(), host: "h".into(), started_unix_s: 0.0, duration_s: 5.0 };
        let capture = Capture::from_aggregate(&all, &Topology::default(), &Lost::default(), meta);
        assert_eq!(Capture::parse(&serde_json::to_string(&capture).unwrap()).unwrap(), capture);
    }

    #[test]
    fn retention_and_the_byte_bound_drop_the_oldest_frames() {
        let limits = RecorderLimits {
            resolution: Duration::from_secs(1),
            retention: Duration::from_secs(10),
            max_bytes: usize::MAX,
        };
        let mut rec = Recorder::new(limits);
        let mut b = FrameBuilder::default();
        for s in 0..30u64 {
            b.add_record(1, Op::Read, &request(0, 2000, 100_000, 4096, 2), &[]);
            rec.push(b.seal(s * 1000, s * 1000 + 1000, &Lost::default()), []);
        }
        assert_eq!(rec.span(), Some((20_000, 30_000)), "the last 10 s");
        assert_eq!(rec.dropped_for_memory, 0);
        let one = rec.bytes() / rec.len();
        rec.limits.max_bytes = one * 4;
        b.add_record(1, Op::Read, &request(0, 2000, 100_000, 4096, 2), &[]);
        rec.push(b.seal(30_000, 31_000, &Lost::default()), []);
        assert!(rec.bytes() <= one * 4 && rec.len() == 4, "{} bytes in {} frames", rec.bytes(), rec.len());
        assert_eq!(rec.dropped_for_memory, 6, "the oldest went by age, six more for memory");
        rec.limits.max_bytes = 1;
        b.add_record(1, Op::Read, &request(0, 2000, 100_000, 4096, 2), &[]);
        rec.push(b.seal(31_000, 32_000, &Lost::default()), []);
        assert_eq!(rec.len(), 1, "the newest frame stays");
        // A device is forgotten with the last frame that names it (hosts that churn loop devices).
        rec.limits.max_bytes = usize::MAX;
        let gone = Device { name: "loop9".into(), dev: 9, ..Default::default() };
        rec.push(b.seal(32_000, 33_000, &Lost::default()), [gone]);
        assert_eq!(rec.device_count(), 1);
        rec.push(b.seal(44_000, 45_000, &Lost::default()), []);
        assert_eq!((rec.len(), rec.device_count()), (1, 0), "loop9's frame aged out, and loop9 with it");
    }
}
