//! Captures: what `tracerd report --save` writes and `tracerd diff` reads. A versioned JSON file
//! with every histogram of a report (its non-empty buckets and exact sum) and what is needed to
//! compare two captures later: kernel, host, devices, start and duration. Loading checks
//! everything, so a damaged, foreign or newer file is a clear error, never a panic or a wrong diff.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    time::{SystemTime, UNIX_EPOCH},
};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use tracer_common::own;

use crate::{
    model::aggregate::{Aggregator, HIGHEST_NS, LOWEST_NS, LayerStats, Lost, OpStats, SIGFIG, StageHist},
    model::causes::{self, WaitSum},
    model::layers::Phase,
    model::op::Op,
    model::stage::{self, Stage},
    model::topology::{Device, Topology},
};

/// The `format` field: says what the file is before anything else is read.
pub const FORMAT: &str = "tracerd-capture";
/// The format version this tracerd writes and the only one it reads.
pub const VERSION: u64 = 1;
/// More samples than this in one histogram is no real capture (2^50: 35 years at a million
/// IOPS); the bound keeps hdrhistogram's u64 running sums from overflowing.
const MAX_SAMPLES: u64 = 1 << 50;
/// The advice every "this file is damaged" error ends with.
const SAVE_AGAIN: &str = "save it again with `tracerd report --save FILE`";

/// One capture, as written to and read from the file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Capture {
    /// Always `tracerd-capture`.
    pub format: String,
    /// Always [`VERSION`] in a loaded capture.
    pub version: u64,
    /// The tracerd that wrote it.
    pub tracerd_version: String,
    /// Kernel release (`uname -r`).
    pub kernel: String,
    pub host: String,
    /// When the capture started (seconds since the Unix epoch, UTC).
    pub started_unix_s: f64,
    pub duration_s: f64,
    /// The layout every histogram below was recorded with.
    pub histograms: HistogramConfig,
    pub devices: Vec<DeviceCapture>,
    /// Lost events during the capture, by reason (docs/reference/metrics.md, Lost events).
    pub lost: BTreeMap<String, u64>,
}

/// HdrHistogram bounds; a version-1 capture always has [`HistogramConfig::CURRENT`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistogramConfig {
    pub lowest_ns: u64,
    pub highest_ns: u64,
    pub significant_digits: u8,
}

impl HistogramConfig {
    pub const CURRENT: HistogramConfig =
        HistogramConfig { lowest_ns: LOWEST_NS, highest_ns: HIGHEST_NS, significant_digits: SIGFIG };
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceCapture {
    /// Kernel name (`loop0`, `dm-0`).
    pub device: String,
    /// `dm-0 (lin0)`, `md0 (raid1)`: the name with the dm name or md level.
    pub label: String,
    /// Devices directly below this one (stacked devices).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lowers: Vec<String>,
    pub ops: Vec<OpCapture>,
}

/// For `skip_serializing_if`: a count that is 0 is left out.
pub(crate) fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpCapture {
    pub op: Op,
    pub requests: u64,
    pub bytes: u64,
    pub merged_bios: u64,
    pub errors: u64,
    /// IOs below a traced stacked device that named no upper IO.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub unlinked: u64,
    /// The unlinked IOs by the kind of own IO the kernel said they are (`parity`, `resync`,
    /// ..., `unstated`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub unlinked_kinds: BTreeMap<String, u64>,
    pub stages: BTreeMap<Stage, Hist>,
    /// Queue depth at issue: sum and count of the requests issued with one known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<QueueDepthCapture>,
    /// Stacked devices: the upper IOs' Q2C split against each lower device.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<LayerCapture>,
    /// rq-qos waits inside Q2G, by policy (`wbt`, `iocost`, ...; config `rq_qos`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub qos_wait: BTreeMap<String, Hist>,
    /// Submitters' waits inside these IOs' phases, by phase and cause (config `causes`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waits: Vec<WaitCapture>,
}

/// Waits of one phase and cause: how many, and their off-CPU time added up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitCapture {
    pub phase: causes::Phase,
    pub cause: causes::Cause,
    pub waits: u64,
    pub wait_ns: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueDepthCapture {
    pub sum: u64,
    pub count: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerCapture {
    pub lower: String,
    pub ios: u64,
    pub lower_ios: u64,
    pub phases: BTreeMap<Phase, Hist>,
}

/// One latency distribution: HdrHistogram's non-empty buckets as `[value_ns, count]` (the value
/// is the bucket's highest, `value_iterated_to`), their total and the exact sum. `bucketed`
/// (written only when true): the samples are known only by the kernel aggregation's buckets
/// (a window of the agent's recorder), each recorded at its bucket's middle.
///
/// Kept as buckets rather than as a `Histogram`: a loaded capture then takes memory in
/// proportion to its file, and [`Hist::histogram`] rebuilds the full histogram where quantiles
/// are needed. Deserializing checks it (`TryFrom<RawHist>`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawHist")]
pub struct Hist {
    pub count: u64,
    pub sum_ns: u64,
    pub buckets: Vec<(u64, u64)>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bucketed: bool,
}

/// A histogram as it stands in the file, before it is checked.
#[derive(Deserialize)]
struct RawHist {
    count: u64,
    sum_ns: u64,
    buckets: Vec<(u64, u64)>,
    #[serde(default)]
    bucketed: bool,
}

fn empty_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(LOWEST_NS, HIGHEST_NS, SIGFIG).expect("valid bounds")
}

impl TryFrom<RawHist> for Hist {
    type Error = String;

    /// Rebuilds the histogram once and checks that it is one tracerd could have written:
    /// samples, increasing bucket values in range, counts that add up, and a sum that lies
    /// between what the buckets allow (each sample lies inside its bucket's value range).
    fn try_from(raw: RawHist) -> Result<Hist, String> {
        if raw.buckets.is_empty() {
            return Err("a histogram has no buckets (tracerd writes only stages that have samples)".into());
        }
        let mut h = empty_histogram();
        let top_bucket = h.lowest_equivalent(h.high());
        let (mut total, mut min_sum, mut max_sum, mut saturated) = (0u64, 0u128, 0u128, false);
        let mut previous: Option<u64> = None;
        for &(value, count) in &raw.buckets {
            if let Some(p) = previous
                && value <= p
            {
                return Err(format!("bucket values must increase, but {value} follows {p}"));
            }
            previous = Some(value);
            if count == 0 {
                return Err(format!("the bucket at {value} ns has a count of 0"));
            }
            total = total
                .checked_add(count)
                .filter(|&t| t <= MAX_SAMPLES)
                .ok_or_else(|| format!("a histogram has more than {MAX_SAMPLES} samples"))?;
            h.record_n(value, count).map_err(|_| {
                format!("bucket value {value} ns is beyond the histogram's range (100 ns to 60 s)")
            })?;
            min_sum += h.lowest_equivalent(value) as u128 * count as u128;
            max_sum += h.highest_equivalent(value) as u128 * count as u128;
            // Samples over 60 s are clamped into the top bucket, but their sum is exact.
            saturated |= h.lowest_equivalent(value) >= top_bucket;
        }
        if total != raw.count {
            return Err(format!("count is {} but the buckets add up to {total}", raw.count));
        }
        let sum = raw.sum_ns as u128;
        // Bucketed samples come from per-CPU counters the daemon reads while the kernel writes
        // them: a frame's sum can hold an IO whose bucket count falls in the next frame, so
        // their sum is not held to the buckets.
        if !raw.bucketed && (sum < min_sum || (!saturated && sum > max_sum)) {
            return Err(format!(
                "sum_ns {} cannot be the sum of these buckets' samples ({min_sum} to {max_sum})",
                raw.sum_ns
            ));
        }
        Ok(Hist { count: raw.count, sum_ns: raw.sum_ns, buckets: raw.buckets, bucketed: raw.bucketed })
    }
}

impl Hist {
    pub fn of(s: &StageHist) -> Hist {
        Hist {
            count: s.count(),
            sum_ns: s.sum_ns,
            buckets: s.hist.iter_recorded().map(|v| (v.value_iterated_to(), v.count_at_value())).collect(),
            bucketed: s.bucketed,
        }
    }

    /// The full histogram, for quantiles.
    pub fn histogram(&self) -> Histogram<u64> {
        let mut h = empty_histogram();
        for &(value, count) in &self.buckets {
            // Cannot fail: every value was recorded into the same layout when it was loaded
            // (or comes from such a histogram).
            let _ = h.record_n(value, count);
        }
        h
    }

    pub fn mean_ns(&self) -> f64 {
        self.sum_ns as f64 / self.count.max(1) as f64
    }
}

/// What the capture describes, beside the histograms.
#[derive(Clone, Debug)]
pub struct Meta {
    pub kernel: String,
    pub host: String,
    pub started_unix_s: f64,
    pub duration_s: f64,
}

/// The host name, as the kernel has it.
pub fn hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname").map_or_else(|_| "unknown".into(), |s| s.trim().into())
}

/// Now, in seconds since the Unix epoch.
pub fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

impl Capture {
    /// A capture of what `report` aggregated; devices sorted by name, ops in order.
    pub fn from_aggregate(agg: &Aggregator, topo: &Topology, lost: &Lost, meta: Meta) -> Capture {
        let mut devices: Vec<DeviceCapture> = Vec::new();
        for (device, op, s) in agg.sorted() {
            let op_capture = OpCapture {
                op,
                requests: s.requests,
                bytes: s.bytes,
                merged_bios: s.merged_bios,
                errors: s.errors,
                unlinked: s.unlinked,
                unlinked_kinds: own_kinds(&s.own),
                stages: Stage::ALL
                    .iter()
                    .filter_map(|&st| Some((st, Hist::of(s.stage(st)?))))
                    .filter(|(_, h)| h.count > 0)
                    .collect(),
                queue_depth: (s.queue_depth.count > 0)
                    .then_some(QueueDepthCapture { sum: s.queue_depth.sum, count: s.queue_depth.count }),
                layers: s
                    .layers
                    .iter()
                    .map(|(&lower, l)| LayerCapture {
                        lower: agg.name(lower).to_owned(),
                        ios: l.ios,
                        lower_ios: l.lower_ios,
                        phases: Phase::ALL.iter().zip(&l.phases).map(|(&p, h)| (p, Hist::of(h))).collect(),
                    })
                    .collect(),
                qos_wait: s.qos.iter().map(|(&p, h)| (stage::qos_name(p), Hist::of(h))).collect(),
                waits: s
                    .waits
                    .iter()
                    .map(|(&(phase, cause), w)| WaitCapture { phase, cause, waits: w.waits, wait_ns: w.ns })
                    .collect(),
            };
            match devices.last_mut() {
                Some(d) if d.device == device => d.ops.push(op_capture),
                _ => {
                    let known = topo.by_name(device);
                    devices.push(DeviceCapture {
                        device: device.to_owned(),
                        label: known.map_or_else(|| device.to_owned(), |d| d.label()),
                        lowers: known.map(|d| d.lowers.clone()).unwrap_or_default(),
                        ops: vec![op_capture],
                    });
                }
            }
        }
        Capture {
            format: FORMAT.into(),
            version: VERSION,
            tracerd_version: env!("CARGO_PKG_VERSION").into(),
            kernel: meta.kernel,
            host: meta.host,
            started_unix_s: meta.started_unix_s,
            duration_s: meta.duration_s,
            histograms: HistogramConfig::CURRENT,
            devices,
            lost: lost.reasons().into_iter().map(|(r, n)| (r.to_owned(), n)).collect(),
        }
    }

    /// The capture back as an aggregate, for `report` to show: devices get made-up numbers,
    /// and a topology of their names, labels and stacks.
    pub fn to_aggregate(&self) -> (Aggregator, Topology, Lost) {
        let mut agg = Aggregator::new(false);
        let mut ids: BTreeMap<String, u32> = BTreeMap::new();
        let mut id_of = |name: &str, agg: &mut Aggregator| {
            let next = ids.len() as u32 + 1;
            let id = *ids.entry(name.to_owned()).or_insert(next);
            agg.names.entry(id).or_insert_with(|| name.to_owned());
            id
        };
        let boxed =
            |h: &Hist| Box::new(StageHist { hist: h.histogram(), sum_ns: h.sum_ns, bucketed: h.bucketed });
        for d in &self.devices {
            let dev = id_of(&d.device, &mut agg);
            for o in &d.ops {
                let mut stats = OpStats {
                    requests: o.requests,
                    bytes: o.bytes,
                    merged_bios: o.merged_bios,
                    errors: o.errors,
                    unlinked: o.unlinked,
                    own: own_counts(&o.unlinked_kinds),
                    ..Default::default()
                };
                for (stage, h) in &o.stages {
                    stats.stages[stage.index()] = Some(boxed(h));
                }
                if let Some(q) = o.queue_depth {
                    (stats.queue_depth.sum, stats.queue_depth.count) = (q.sum, q.count);
                }
                for (policy, h) in &o.qos_wait {
                    if let Some(bits) = stage::qos_bits(policy) {
                        stats.qos.insert(bits, boxed(h));
                    }
                }
                for w in &o.waits {
                    stats.add_wait(w.phase, w.cause, WaitSum { waits: w.waits, ns: w.wait_ns });
                }
                for l in &o.layers {
                    let lower = id_of(&l.lower, &mut agg);
                    let phase = |p: Phase| l.phases.get(&p).map_or_else(StageHist::default_range, boxed);
                    let phases = [phase(Phase::Layer), phase(Phase::Lower), phase(Phase::Completion)];
                    stats.layers.insert(lower, LayerStats { ios: l.ios, lower_ios: l.lower_ios, phases });
                }
                agg.series.insert((dev, o.op), stats);
            }
        }
        let devices = self.devices.iter().map(|d| Device {
            name: d.device.clone(),
            dev: ids[d.device.as_str()],
            disk: d.device.clone(),
            partition: false,
            request_based: false,
            lowers: d.lowers.clone(),
            uppers: self
                .devices
                .iter()
                .filter(|u| u.lowers.contains(&d.device))
                .map(|u| u.device.clone())
                .collect(),
            // The label's part in brackets (a dm name or an md level) comes back as it was shown.
            dm_name: d
                .label
                .strip_prefix(&format!("{} (", d.device))
                .and_then(|r| r.strip_suffix(')'))
                .map(str::to_owned),
            md_level: None,
            hidden: false,
        });
        let mut lost = Lost::default();
        for (counter, (reason, _)) in lost.counters_mut().into_iter().zip(Lost::default().reasons()) {
            *counter = self.lost.get(reason).copied().unwrap_or(0);
        }
        (agg, Topology::from_devices(devices.collect::<Vec<_>>()), lost)
    }
}

/// Unlinked IO counts by own kind, by name (the non-zero ones).
pub fn own_kinds(counts: &[u64; own::COUNT]) -> BTreeMap<String, u64> {
    (0..own::COUNT as u8)
        .filter(|&k| counts[k as usize] != 0)
        .map(|k| (own::name(k).to_owned(), counts[k as usize]))
        .collect()
}

/// [`own_kinds`] back; a kind this version does not know counts as unstated.
pub fn own_counts(kinds: &BTreeMap<String, u64>) -> [u64; own::COUNT] {
    let mut counts = [0; own::COUNT];
    for (name, &n) in kinds {
        let k = (0..own::COUNT as u8).find(|&k| own::name(k) == name).unwrap_or(own::UNSTATED);
        counts[k as usize] += n;
    }
    counts
}

mod file;

pub use file::{CaptureError, Problem};

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::topology::tests::tempdir;
    use tracer_common::{IoRecord, event, kind};

    /// Deterministic pseudo-random numbers (xorshift), so tests need no extra crate.
    pub struct Rng(pub u64);
    impl Rng {
        pub fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// An aggregate of `n` reads on loop0 with log-spread latencies (1 µs to ~1 s), a few
    /// writes, and one stacked device.
    pub fn aggregate(n: u64) -> Aggregator {
        let mut agg = Aggregator::new(false);
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..n {
            let d2c = (1000 << (rng.next() % 20)) | (rng.next() % 1000);
            let mut r = IoRecord { kind: kind::REQUEST, bytes: 4096, ..Default::default() };
            (r.ts[event::Q], r.ts[event::G], r.ts[event::D]) = (1000, 1500 + rng.next() % 500, 3000);
            r.ts[event::C] = 3000 + d2c;
            agg.add(7, Op::Read, &r, &[], |_| "loop0".into());
        }
        let mut w = IoRecord { kind: kind::REQUEST, bytes: 8192, ..Default::default() };
        (w.ts[event::Q], w.ts[event::G], w.ts[event::I], w.ts[event::D], w.ts[event::C]) =
            (10, 20, 30, 40, 200_000_000_000); // over 60 s: clamped into the top bucket
        agg.add(7, Op::Write, &w, &[], |_| unreachable!());
        let mut upper = IoRecord { kind: kind::BIO, ..Default::default() };
        (upper.ts[event::Q], upper.ts[event::C]) = (0, 10_000);
        let split = crate::model::layers::LayerSplit {
            lower: 7,
            ios: 1,
            layer_ns: 1000,
            lower_ns: 8000,
            completion_ns: 1000,
        };
        agg.add(9, Op::Read, &upper, &[split], |_| "dm-0".into());
        // Waits by cause (config `causes`).
        use crate::model::causes::{Cause, Phase};
        let waits = [
            ((7, Op::Read, Phase::Q2g, Cause::Tag), WaitSum { waits: 3, ns: 42_000 }),
            ((9, Op::Read, Phase::Submit, Cause::MdSuperblock), WaitSum { waits: 1, ns: 5_000 }),
        ];
        agg.add_waits(&waits.into(), |_| unreachable!());
        agg
    }

    fn meta() -> Meta {
        Meta { kernel: "6.18.44".into(), host: "vm1".into(), started_unix_s: 1.7e9, duration_s: 5.0 }
    }

    pub fn capture(n: u64) -> Capture {
        Capture::from_aggregate(&aggregate(n), &Topology::default(), &Lost::default(), meta())
    }

    #[test]
    fn bucketed_histograms_keep_their_flag_and_sum() {
        let mut s = StageHist::default_range();
        s.record_bucket(tracer_common::agg::bucket_of(1_000_000), 10); // (800 µs, 1 ms]
        s.sum_ns = 10 * 999_000; // every sample near the top of its bucket
        let h = Hist::of(&s);
        assert!(h.bucketed);
        let text = serde_json::to_string(&h).unwrap();
        assert_eq!(serde_json::from_str::<Hist>(&text).unwrap(), h);
        let exact = text.replace(",\"bucketed\":true", "");
        assert!(serde_json::from_str::<Hist>(&exact).unwrap_err().to_string().contains("cannot be the sum"));
    }

    #[test]
    fn a_capture_comes_back_as_the_aggregate_it_was_made_of() {
        let mut c = capture(500);
        c.devices[0].label = "dm-0 (lin0)".into();
        c.devices[0].lowers = vec!["loop0".into()];
        c.lost.insert("stale_bio".into(), 4);
        c.devices[0].ops[0].unlinked = 5;
        c.devices[0].ops[0].unlinked_kinds = BTreeMap::from([("parity".into(), 3), ("unstated".into(), 2)]);
        let (agg, topo, lost) = c.to_aggregate();
        assert_eq!(lost.stale_bio, 4);
        let again = Capture::from_aggregate(&agg, &topo, &lost, meta());
        assert_eq!(again, c, "capture -> aggregate -> capture is the identity");
        assert_eq!(topo.by_name("loop0").unwrap().uppers, vec!["dm-0".to_string()]);
    }

    #[test]
    fn round_trip_keeps_counts_sums_and_quantiles() {
        let agg = aggregate(5000);
        let c = Capture::from_aggregate(&agg, &Topology::default(), &Lost::default(), meta());
        let dir = tempdir::Dir::new();
        let path = dir.0.join("a.json");
        c.save(&path).unwrap();
        assert!(!dir.0.join("a.json.tmp").exists(), "the temporary file is renamed");
        let loaded = Capture::load(&path).unwrap();
        assert_eq!(loaded, c);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(r#"{"phase":"q2g","cause":"tag","waits":3,"wait_ns":42000}"#), "{text}");
        assert_eq!((loaded.format.as_str(), loaded.version, loaded.host.as_str()), (FORMAT, 1, "vm1"));
        assert_eq!(loaded.devices.iter().map(|d| d.device.as_str()).collect::<Vec<_>>(), ["dm-0", "loop0"]);
        let loop0 = &loaded.devices[1];
        let read = &loop0.ops[0];
        assert_eq!((read.op, read.requests, read.bytes), (Op::Read, 5000, 5000 * 4096));
        let original = &agg.series[&(7, Op::Read)];
        for stage in [Stage::Q2g, Stage::G2d, Stage::D2c, Stage::Q2c] {
            let (orig, hist) = (original.stage(stage).unwrap(), &read.stages[&stage]);
            let rebuilt = hist.histogram();
            assert_eq!((hist.count, hist.sum_ns), (orig.count(), orig.sum_ns), "{stage:?}");
            for q in [0.0, 0.5, 0.9, 0.99, 0.999, 1.0] {
                assert_eq!(rebuilt.value_at_quantile(q), orig.hist.value_at_quantile(q), "{stage:?} q{q}");
            }
            assert_eq!(rebuilt.max(), orig.hist.max());
        }
        // A stage that did not fire is absent, not empty.
        assert!(!read.stages.contains_key(&Stage::G2i));
        // Over 60 s: clamped into the top bucket, the sum still exact, and it loads.
        let write = &loop0.ops[1];
        assert_eq!(write.stages[&Stage::Q2c].sum_ns, 199_999_999_990);
        assert_eq!(loaded.devices[0].ops[0].layers[0].lower, "loop0");
        assert_eq!(loaded.devices[0].ops[0].layers[0].phases[&Phase::Lower].sum_ns, 8000);
        assert_eq!(loaded.lost["ringbuf_full"], 0);
    }
}
