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
//!
//! `frame` holds the series and the frames, `codec` their bytes, and `stored` what the store
//! on disk needs of them.

mod codec;
mod frame;
mod stored;

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    time::Duration,
};

pub use frame::{Buckets, Damaged, Decoded, Frame, FrameBuilder, LayerFrame, SeriesFrame};

use crate::model::{
    aggregate::{Aggregator, Lost},
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
    /// The store on disk (`attach_store`): every frame is written to it, and windows older
    /// than the frames in memory are read from it.
    store: Option<Store>,
    /// Every device the store names, as it was when written.
    stored_devices: BTreeMap<u32, Device>,
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
            agg.add_waits(&d.waits, |dev| self.topology.name_of(dev));
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
        let (mut frames, bad) = self.reads.map(Reads::frames::<Frame>).unwrap_or_default();
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
            let named = store.append(&frame, &devices);
            self.stored_devices.extend(named.into_iter().map(|d| (d.dev, d.clone())));
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
            planned.devices.extend(self.stored_devices.values().cloned());
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

/// Records as the recorder's tests count them.
#[cfg(test)]
mod testing {
    use tracer_common::{IoRecord, event, kind};

    use crate::model::layers::LayerSplit;

    pub fn request(q: u64, d: u64, c: u64, bytes: u32, qd: u32) -> IoRecord {
        let mut r = IoRecord { kind: kind::REQUEST, bytes, queue_depth: qd, ..Default::default() };
        (r.ts[event::Q], r.ts[event::G], r.ts[event::D], r.ts[event::C]) = (q, q + 150, d, c);
        r
    }

    pub fn stacked() -> (IoRecord, [LayerSplit; 1]) {
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
}

#[cfg(test)]
mod tests {
    use super::testing::{request, stacked};
    use super::*;
    use crate::model::{op::Op, stage::Stage};

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
        use crate::model::capture::{Capture, Meta};
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
