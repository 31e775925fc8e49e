//! Per (device, op) aggregation of records into HdrHistograms, one per stage.
//! Histograms are created on first use, so memory follows the stages a device really has.

use std::collections::{BTreeMap, HashMap};

use hdrhistogram::Histogram;
use tracer_common::{IoRecord, SeriesAgg, agg, lost, own};

pub use crate::model::stage::PATHS;
use crate::{
    model::causes::{self, Cause, WaitSum, WaitTotals},
    model::layers::{LayerSplit, Phase},
    model::op::Op,
    model::series::{KernelSeries, Series},
    model::stage::Stage,
};

/// Default histogram range: 100 ns to 60 s at 3 significant digits.
pub const LOWEST_NS: u64 = 100;
pub const HIGHEST_NS: u64 = 60_000_000_000;
pub const SIGFIG: u8 = 3;

/// Range and precision of every latency histogram (config `[histogram]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistogramRange {
    pub lowest_ns: u64,
    pub highest_ns: u64,
    pub significant_digits: u8,
}

impl Default for HistogramRange {
    fn default() -> HistogramRange {
        HistogramRange { lowest_ns: LOWEST_NS, highest_ns: HIGHEST_NS, significant_digits: SIGFIG }
    }
}

/// The range chosen at start-up (once; the default until then).
static RANGE: std::sync::OnceLock<HistogramRange> = std::sync::OnceLock::new();

/// The histogram range in force.
pub fn histogram_range() -> HistogramRange {
    RANGE.get().copied().unwrap_or_default()
}

/// Sets the histogram range for the rest of the run; false if it was already set.
pub fn set_histogram_range(range: HistogramRange) -> bool {
    RANGE.set(range).is_ok()
}

/// Bounds on the series kept (config `[series]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeriesLimits {
    /// A vanished device's series are dropped after this long.
    pub expire_after: std::time::Duration,
    /// Devices with series at most; records of further devices are counted as lost.
    pub max_devices: usize,
}

impl Default for SeriesLimits {
    fn default() -> SeriesLimits {
        SeriesLimits { expire_after: std::time::Duration::from_secs(300), max_devices: 1024 }
    }
}

/// One stage's latency distribution, with the exact sum kept beside it.
#[derive(Clone, Debug)]
pub struct StageHist {
    pub hist: Histogram<u64>,
    pub sum_ns: u64,
    /// Some samples are known only by their kernel bucket (`record_bucket`): each lies in
    /// that bucket, anywhere, though it was recorded at the bucket's middle.
    pub bucketed: bool,
}

impl StageHist {
    fn new() -> Box<StageHist> {
        let r = histogram_range();
        // The config checked the bounds (lowest >= 1, highest >= 2 * lowest, 1..=5 digits).
        let hist = Histogram::new_with_bounds(r.lowest_ns, r.highest_ns, r.significant_digits)
            .expect("valid bounds");
        Box::new(StageHist { hist, sum_ns: 0, bucketed: false })
    }

    fn record(&mut self, ns: u64) {
        // Beyond 60 s is clamped to the top bucket; that is what the range documents.
        self.hist.saturating_record(ns);
        self.sum_ns += ns;
    }

    pub fn count(&self) -> u64 {
        self.hist.len()
    }

    /// An empty histogram in the default range, whatever the config says: the range captures
    /// are defined with (a window of the recorder becomes a capture).
    pub fn default_range() -> Box<StageHist> {
        let r = HistogramRange::default();
        let hist = Histogram::new_with_bounds(r.lowest_ns, r.highest_ns, r.significant_digits)
            .expect("valid bounds");
        Box::new(StageHist { hist, sum_ns: 0, bucketed: false })
    }

    /// Adds `n` IOs known only by their kernel bucket `b` (`agg::BOUNDS_NS`), at the bucket's
    /// middle; their exact sum is added by the caller.
    pub fn record_bucket(&mut self, b: usize, n: u64) {
        self.hist.saturating_record_n(bucket_middle(b), n);
        self.bucketed = true;
    }
}

pub type Stages = [Option<Box<StageHist>>; Stage::COUNT];

fn record_stage(stages: &mut Stages, stage: Stage, ns: u64) {
    stages[stage.index()].get_or_insert_with(StageHist::new).record(ns);
}

/// Everything known about one (device, op) series.
#[derive(Clone, Debug)]
pub struct OpStats {
    /// Completed requests.
    pub requests: u64,
    pub bytes: u64,
    /// Bios merged into another request (counted in Q2M, not in `requests`).
    pub merged_bios: u64,
    /// Requests completed with a non-zero `blk_status_t`.
    pub errors: u64,
    /// IOs of a device below a traced stacked device that name no upper IO: the stacked
    /// driver's own IO (metadata, zeroing, resync), or a link the kernel does not state.
    pub unlinked: u64,
    /// The unlinked IOs by the kind of own IO the kernel said they are (indexed by
    /// `tracer_common::own`; 0: it did not say).
    pub own: [u64; own::COUNT],
    pub stages: Stages,
    /// Requests per event path, indexed by the bitmask of events that fired.
    pub paths: [u64; PATHS],
    /// Stages per queue depth at issue (only when enabled).
    pub by_qd: BTreeMap<u32, Stages>,
    /// Stacked devices: per lower device, the upper IOs' time split into phases.
    pub layers: BTreeMap<u32, LayerStats>,
    /// Stacked devices: time inside the driver's submit function, and the md personality's.
    pub submit: Option<Box<StageHist>>,
    pub personality: Option<Box<StageHist>>,
    /// rq-qos waits inside Q2G, by the policies waited in (`tracer_common::qos` bits).
    pub qos: BTreeMap<u8, Box<StageHist>>,
    /// Queue depth at issue of requests issued with one known.
    pub queue_depth: QueueDepths,
    /// Its submitters' waits inside its IOs' phases, by phase and cause (config `causes`):
    /// counted from every wait the kernel reported, also of IOs it aggregated itself.
    pub waits: BTreeMap<(causes::Phase, Cause), WaitSum>,
}

/// Queue depths at issue in power-of-two buckets: bucket k counts depths in (2^(k-1), 2^k],
/// the last one everything above 2^(QD_BUCKETS-2).
pub const QD_BUCKETS: usize = agg::QD_BUCKETS;

#[derive(Clone, Debug, Default)]
pub struct QueueDepths {
    pub buckets: [u64; QD_BUCKETS],
    pub sum: u64,
    pub count: u64,
}

impl QueueDepths {
    /// Upper bound of bucket `k` (None for the last, unbounded one).
    pub fn le(k: usize) -> Option<u32> {
        (k < QD_BUCKETS - 1).then(|| 1 << k)
    }

    fn record(&mut self, depth: u32) {
        // The kernel's bucketing (no overflow for depths past 2^31, which a damaged record has).
        let k = agg::qd_bucket(depth);
        self.buckets[k] += 1;
        self.sum += depth as u64;
        self.count += 1;
    }
}

/// Upper IOs' time against one lower device, by phase.
#[derive(Clone, Debug)]
pub struct LayerStats {
    /// Upper IOs that went to this lower device.
    pub ios: u64,
    /// Lower IOs they sent there (2 per upper IO where a bio is split in two, ...).
    pub lower_ios: u64,
    pub phases: [Box<StageHist>; 3],
}

impl Default for OpStats {
    fn default() -> Self {
        OpStats {
            requests: 0,
            bytes: 0,
            merged_bios: 0,
            errors: 0,
            unlinked: 0,
            own: [0; own::COUNT],
            stages: Default::default(),
            paths: [0; PATHS],
            by_qd: BTreeMap::new(),
            layers: BTreeMap::new(),
            submit: None,
            personality: None,
            qos: BTreeMap::new(),
            queue_depth: QueueDepths::default(),
            waits: BTreeMap::new(),
        }
    }
}

impl OpStats {
    pub fn stage(&self, stage: Stage) -> Option<&StageHist> {
        self.stages[stage.index()].as_deref()
    }

    pub fn add_wait(&mut self, phase: causes::Phase, cause: Cause, sum: WaitSum) {
        self.waits.entry((phase, cause)).or_default().add(sum);
    }
}

impl Series for OpStats {
    fn count_requests(&mut self, requests: u64, bytes: u64, errors: u64) {
        self.requests += requests;
        self.bytes += bytes;
        self.errors += errors;
    }

    fn count_path(&mut self, mask: usize, requests: u64) {
        self.paths[mask] += requests;
    }

    fn record_queue_depth(&mut self, depth: u32) {
        self.queue_depth.record(depth);
    }

    fn record_stage(&mut self, stage: Stage, ns: u64) {
        record_stage(&mut self.stages, stage, ns);
    }

    fn count_merged_bio(&mut self) {
        self.merged_bios += 1;
    }

    fn count_unlinked(&mut self, own: usize) {
        self.unlinked += 1;
        self.own[own] += 1;
    }

    fn record_layer(&mut self, split: &LayerSplit) {
        let l = self.layers.entry(split.lower).or_insert_with(|| LayerStats {
            ios: 0,
            lower_ios: 0,
            phases: [StageHist::new(), StageHist::new(), StageHist::new()],
        });
        l.ios += 1;
        l.lower_ios += split.ios as u64;
        for (hist, phase) in l.phases.iter_mut().zip(Phase::ALL) {
            hist.record(split.phase_ns(phase));
        }
    }

    fn record_submit(&mut self, ns: u64) {
        self.submit.get_or_insert_with(StageHist::new).record(ns);
    }

    fn record_personality(&mut self, ns: u64) {
        self.personality.get_or_insert_with(StageHist::new).record(ns);
    }

    fn record_qos(&mut self, policies: u8, ns: u64) {
        self.qos.entry(policies).or_insert_with(StageHist::new).record(ns);
    }
}

/// Each kernel bucket's IOs go into the histogram at the bucket's middle: the Prometheus
/// buckets are unions of the kernel's, so they come out exact; quantiles are within the kernel
/// bucket's width. Sums are the kernel's exact ones.
impl KernelSeries for OpStats {
    fn add_queue_depths(&mut self, buckets: &[u32; agg::QD_BUCKETS], sum: u64, count: u64) {
        let qd = &mut self.queue_depth;
        for (b, &n) in qd.buckets.iter_mut().zip(buckets) {
            *b += n as u64;
        }
        qd.sum += sum;
        qd.count += count;
    }

    fn add_stage_buckets(&mut self, stage: Stage, counts: &[u32; agg::BUCKETS], sum_ns: u64) {
        let h = self.stages[stage.index()].get_or_insert_with(StageHist::new);
        for (b, &n) in counts.iter().enumerate() {
            if n != 0 {
                h.record_bucket(b, n as u64);
            }
        }
        h.sum_ns += sum_ns;
    }
}

/// Lost events by reason: the kernel's counters plus the daemon's own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lost {
    pub kernel: [u64; lost::KERNEL_COUNT as usize],
    pub stale_bio: u64,
    pub stale_request: u64,
    pub decode_error: u64,
    /// Lower IOs of a stacked device whose upper IO was never seen to complete.
    pub orphaned_lower: u64,
    /// Records of devices beyond `series.max_devices`.
    pub series_limit: u64,
    /// IOs in flight on a device when it vanished.
    pub device_gone: u64,
    /// Program runs the kernel skipped (nested on one CPU); each may have lost an event.
    pub recursion: u64,
    /// Waits (config `causes`) that ended with no wakeup seen though the task slept: a wakeup
    /// that came in the window before its sleeper's sched_switch that the hooks cannot see.
    pub wakeup_unseen: u64,
}

impl Lost {
    /// New reasons go last: the recorder stores counters by their place here.
    pub fn reasons(&self) -> [(&'static str, u64); 16] {
        [
            ("ringbuf_full", self.kernel[lost::RINGBUF_FULL as usize]),
            ("bio_map_full", self.kernel[lost::BIO_MAP_FULL as usize]),
            ("request_map_full", self.kernel[lost::REQUEST_MAP_FULL as usize]),
            ("complete_without_start", self.kernel[lost::COMPLETE_WITHOUT_START as usize]),
            ("link_map_full", self.kernel[lost::LINK_MAP_FULL as usize]),
            ("missed_completion", self.kernel[lost::MISSED_COMPLETION as usize]),
            ("stale_bio", self.stale_bio),
            ("stale_request", self.stale_request),
            ("decode_error", self.decode_error),
            ("orphaned_lower", self.orphaned_lower),
            ("recursion", self.recursion),
            ("series_limit", self.series_limit),
            ("device_gone", self.device_gone),
            ("wait_map_full", self.kernel[lost::WAIT_MAP_FULL as usize]),
            ("stack", self.kernel[lost::STACK as usize]),
            ("wakeup_unseen", self.wakeup_unseen),
        ]
    }

    /// Every counter, in the order of `reasons`.
    pub fn counters_mut(&mut self) -> [&mut u64; 16] {
        let [a, b, c, d, e, f, wait_map_full, stack] = &mut self.kernel;
        [
            a,
            b,
            c,
            d,
            e,
            f,
            &mut self.stale_bio,
            &mut self.stale_request,
            &mut self.decode_error,
            &mut self.orphaned_lower,
            &mut self.recursion,
            &mut self.series_limit,
            &mut self.device_gone,
            wait_map_full,
            stack,
            &mut self.wakeup_unseen,
        ]
    }

    /// What was lost since `base` (the counters at the start of a capture).
    pub fn since(&self, base: &Lost) -> Lost {
        let mut d = *self;
        for (a, (_, b)) in d.counters_mut().into_iter().zip(base.reasons()) {
            *a = a.saturating_sub(b);
        }
        d
    }

    /// Adds another count of lost events (frames of a window).
    pub fn add(&mut self, other: &Lost) {
        for (a, (_, b)) in self.counters_mut().into_iter().zip(other.reasons()) {
            *a += b;
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Aggregator {
    pub by_qd: bool,
    pub series: HashMap<(u32, Op), OpStats>,
    /// Device names, taken when a device is first seen (they outlive the device in sysfs).
    pub names: HashMap<u32, String>,
    pub lost: Lost,
    pub limits: SeriesLimits,
    /// Records refused because `limits.max_devices` devices already have series.
    pub over_limit: u64,
    /// When each device with series was last seen present.
    last_present: HashMap<u32, std::time::Instant>,
    /// Devices whose series were dropped after they vanished.
    pub expired_devices: u64,
}

impl Aggregator {
    pub fn new(by_qd: bool) -> Aggregator {
        Aggregator { by_qd, ..Default::default() }
    }

    pub fn with_limits(by_qd: bool, limits: SeriesLimits) -> Aggregator {
        Aggregator { by_qd, limits, ..Default::default() }
    }

    /// Drops the series of devices absent from `present` for longer than the expiry; returns
    /// how many devices went.
    pub fn expire(&mut self, present: impl Fn(u32) -> bool, now: std::time::Instant) -> usize {
        let devs: std::collections::HashSet<u32> = self.series.keys().map(|&(dev, _)| dev).collect();
        let mut gone = Vec::new();
        for dev in devs {
            if present(dev) {
                self.last_present.insert(dev, now);
            } else {
                let seen = *self.last_present.entry(dev).or_insert(now);
                if now.duration_since(seen) >= self.limits.expire_after {
                    gone.push(dev);
                }
            }
        }
        for dev in &gone {
            self.series.retain(|&(d, _), _| d != *dev);
            self.last_present.remove(dev);
            self.names.remove(dev);
        }
        self.expired_devices += gone.len() as u64;
        gone.len()
    }

    /// Adds one record for the traced device `dev`, with its layer splits (stacked devices);
    /// `name` is asked once per new device.
    pub fn add(
        &mut self,
        dev: u32,
        op: Op,
        rec: &IoRecord,
        layers: &[LayerSplit],
        name: impl Fn(u32) -> String,
    ) {
        if !self.admit(dev, &name) {
            self.over_limit += 1;
            return;
        }
        for split in layers {
            self.names.entry(split.lower).or_insert_with(|| name(split.lower));
        }
        let by_qd = self.by_qd;
        let stats = self.series.entry((dev, op)).or_default();
        stats.add_record(rec, layers);
        if by_qd && rec.queue_depth != 0 {
            let per_qd = stats.by_qd.entry(rec.queue_depth).or_default();
            Stage::each_of(rec, |stage, ns| record_stage(per_qd, stage, ns));
        }
    }

    /// Whether `dev` has series, or may get them within `max_devices`.
    fn admit(&mut self, dev: u32, name: &impl Fn(u32) -> String) -> bool {
        let known = self.names.len();
        if let std::collections::hash_map::Entry::Vacant(slot) = self.names.entry(dev) {
            if known >= self.limits.max_devices {
                return false;
            }
            slot.insert(name(dev));
        }
        true
    }

    /// Adds what the kernel counted for `dev` and `op` since its last fold (in-kernel
    /// aggregation), at the kernel's bucket resolution (see `KernelSeries for OpStats`).
    pub fn add_kernel(&mut self, dev: u32, op: Op, counted: &SeriesAgg, name: impl Fn(u32) -> String) {
        if !self.admit(dev, &name) {
            self.over_limit += counted.requests;
            return;
        }
        self.series.entry((dev, op)).or_default().add_kernel(counted);
    }

    /// Adds waits counted per (device, op, phase, cause); `name` is asked once per new device.
    pub fn add_waits(&mut self, waits: &WaitTotals, name: impl Fn(u32) -> String) {
        for (&(dev, op, phase, cause), &sum) in waits {
            if self.admit(dev, &name) {
                self.series.entry((dev, op)).or_default().add_wait(phase, cause, sum);
            }
        }
    }

    pub fn name(&self, dev: u32) -> &str {
        self.names.get(&dev).map_or("?", String::as_str)
    }

    /// Series sorted by device name then op, for stable output.
    pub fn sorted(&self) -> Vec<(&str, Op, &OpStats)> {
        let mut v: Vec<_> = self.series.iter().map(|(&(dev, op), s)| (self.name(dev), op, s)).collect();
        v.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        v
    }
}

/// A value inside kernel bucket `b` (see `agg::BOUNDS_NS`); above the top, past the range.
pub fn bucket_middle(b: usize) -> u64 {
    let lo = if b == 0 { 0 } else { agg::BOUNDS_NS[b - 1] };
    match agg::BOUNDS_NS.get(b) {
        Some(&hi) => lo + (hi - lo) / 2,
        None => u64::MAX,
    }
}

#[cfg(test)]
mod tests {
    use tracer_common::{event, kind};

    use super::*;

    fn request(q: u64, d: u64, c: u64, bytes: u32, qd: u32) -> IoRecord {
        let mut r = IoRecord { kind: kind::REQUEST, bytes, queue_depth: qd, ..Default::default() };
        (r.ts[event::Q], r.ts[event::G], r.ts[event::D], r.ts[event::C]) = (q, q + 100, d, c);
        r
    }

    #[test]
    fn series_are_bounded_and_vanished_devices_expire() {
        use std::time::{Duration, Instant};
        let limits = SeriesLimits { expire_after: Duration::from_secs(10), max_devices: 2 };
        let mut a = Aggregator::with_limits(false, limits);
        for dev in [1, 2, 3, 3] {
            a.add(dev, Op::Read, &request(0, 10, 20, 512, 1), &[], |d| format!("dev{d}"));
        }
        assert_eq!((a.series.len(), a.over_limit), (2, 2), "the third device is refused and counted");
        let t0 = Instant::now();
        assert_eq!(a.expire(|d| d == 1, t0), 0, "dev2 just vanished");
        assert_eq!(a.expire(|d| d == 1, t0 + Duration::from_secs(9)), 0);
        assert_eq!(a.expire(|d| d == 1, t0 + Duration::from_secs(10)), 1);
        assert!(a.series.keys().all(|&(d, _)| d == 1) && !a.names.contains_key(&2));
        assert_eq!(a.expired_devices, 1);
        a.add(3, Op::Read, &request(0, 10, 20, 512, 1), &[], |d| format!("dev{d}"));
        assert_eq!(a.names.len(), 2, "room again after the expiry");
    }

    #[test]
    fn queue_depth_buckets_are_powers_of_two() {
        let mut q = QueueDepths::default();
        for d in [1, 2, 3, 4, 5, 1024, 1025, 100_000] {
            q.record(d);
        }
        assert_eq!(q.buckets[..4], [1, 1, 2, 1]);
        assert_eq!((q.buckets[10], q.buckets[11]), (1, 2));
        assert_eq!(
            (QueueDepths::le(0), QueueDepths::le(10), QueueDepths::le(11)),
            (Some(1), Some(1024), None)
        );
    }

    #[test]
    fn counts_bytes_stages_and_paths() {
        let mut a = Aggregator::new(true);
        a.add(1, Op::Read, &request(1000, 5000, 105_000, 4096, 1), &[], |_| "loop0".into());
        a.add(1, Op::Read, &request(1000, 5000, 205_000, 4096, 2), &[], |_| unreachable!());
        let mut merge = IoRecord { kind: kind::MERGE, bytes: 512, ..Default::default() };
        (merge.ts[event::Q], merge.ts[event::M]) = (10, 2010);
        a.add(1, Op::Read, &merge, &[], |_| unreachable!());
        assert_eq!(a.name(1), "loop0");
        let s = &a.series[&(1, Op::Read)];
        assert_eq!((s.requests, s.bytes, s.merged_bios), (2, 8192, 1));
        assert_eq!(s.stage(Stage::D2c).unwrap().count(), 2);
        assert_eq!(s.stage(Stage::D2c).unwrap().sum_ns, 300_000);
        assert_eq!(s.stage(Stage::Q2m).unwrap().count(), 1);
        assert!(s.stage(Stage::G2i).is_none(), "no I fired, so no G2I");
        assert_eq!(s.stage(Stage::G2d).unwrap().count(), 2);
        assert_eq!(s.paths[0b11011], 2);
        assert_eq!(s.by_qd.len(), 2);
        assert_eq!((s.queue_depth.buckets[0], s.queue_depth.buckets[1]), (1, 1), "depth 1 and 2");
        assert_eq!((s.queue_depth.sum, s.queue_depth.count), (3, 2));
        let max = s.by_qd[&2][Stage::D2c.index()].as_ref().unwrap().hist.max();
        assert!(max.abs_diff(200_000) <= 200, "3 significant digits: {max}");
    }

    #[test]
    fn stacked_ios_keep_layer_phases_and_submit_time() {
        let mut a = Aggregator::new(false);
        let mut upper = IoRecord {
            kind: kind::BIO,
            bytes: 4096,
            submit_ns: 3000,
            personality_ns: 2000,
            ..Default::default()
        };
        (upper.ts[event::Q], upper.ts[event::C]) = (100, 1000);
        let splits = [
            LayerSplit { lower: 10, ios: 1, layer_ns: 100, lower_ns: 500, completion_ns: 300 },
            LayerSplit { lower: 11, ios: 1, layer_ns: 150, lower_ns: 650, completion_ns: 100 },
        ];
        a.add(9, Op::Write, &upper, &splits, |d| format!("dev{d}"));
        let s = &a.series[&(9, Op::Write)];
        assert_eq!(s.requests, 1);
        assert_eq!(s.stage(Stage::Q2c).unwrap().sum_ns, 900);
        assert_eq!(s.layers.len(), 2);
        assert_eq!(s.layers[&11].phases[1].sum_ns, 650);
        assert_eq!(s.submit.as_ref().unwrap().sum_ns, 3000);
        assert_eq!(s.personality.as_ref().unwrap().count(), 1);
        assert_eq!(a.name(10), "dev10");
    }

    #[test]
    fn kernel_counts_fold_into_the_same_series_as_records() {
        let recs = [request(1000, 5000, 105_000, 4096, 1), request(1000, 5000, 2_001_000, 512, 3)];
        let (mut by_records, mut by_kernel) = (Aggregator::new(false), Aggregator::new(false));
        let mut counted = SeriesAgg::default();
        for r in &recs {
            by_records.add(1, Op::Read, r, &[], |_| "loop0".into());
            counted.add_record(r, &[]);
        }
        by_kernel.add_kernel(1, Op::Read, &counted, |_| "loop0".into());
        let (a, b) = (&by_records.series[&(1, Op::Read)], &by_kernel.series[&(1, Op::Read)]);
        assert_eq!(
            (a.requests, a.bytes, a.paths, &a.queue_depth.buckets),
            (b.requests, b.bytes, b.paths, &b.queue_depth.buckets)
        );
        for stage in &Stage::KERNEL {
            let (x, y) = (a.stage(*stage), b.stage(*stage));
            assert_eq!(x.map(|h| (h.count(), h.sum_ns)), y.map(|h| (h.count(), h.sum_ns)), "{stage:?}");
        }
        // D2C of 1.996 ms lands in the kernel's (1.6, 2] ms bucket; its middle is 1.8 ms.
        assert_eq!(b.stage(Stage::D2c).unwrap().hist.max() / 10_000, 180);
        assert_eq!(bucket_middle(0), 50);
        assert_eq!(bucket_middle(agg::BUCKETS - 1), u64::MAX);
    }

    #[test]
    fn lost_since_a_baseline() {
        let base = Lost { kernel: [1, 0, 0, 2, 0, 0, 0, 0], stale_bio: 1, ..Default::default() };
        let now = Lost { kernel: [5, 0, 1, 2, 0, 0, 0, 0], stale_bio: 3, ..Default::default() };
        let d = now.since(&base);
        assert_eq!(d.reasons()[0], ("ringbuf_full", 4));
        assert_eq!(d.reasons()[2], ("request_map_full", 1));
        assert_eq!(d.reasons()[6], ("stale_bio", 2));
    }
}
