//! Captures: what `tracerd report --save` writes and `tracerd diff` reads. A versioned JSON file
//! with every histogram of a report (its non-empty buckets and exact sum) and what is needed to
//! compare two captures later: kernel, host, devices, start and duration. Loading checks
//! everything, so a damaged, foreign or newer file is a clear error, never a panic or a wrong diff.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs, io,
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracer_common::own;

use crate::{
    model::aggregate::{Aggregator, HIGHEST_NS, LOWEST_NS, LayerStats, Lost, OpStats, SIGFIG, StageHist},
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

/// Why a text is not a capture this tracerd can read. Each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    #[error("the file is empty (was the capture interrupted while it was written?); {}", SAVE_AGAIN)]
    Empty,
    #[error(
        "truncated or not JSON (byte {0} is not UTF-8 text); a capture is the JSON file that \
         `tracerd report --save FILE` writes"
    )]
    NotText(usize),
    #[error(
        "truncated or not JSON ({0}); a capture is the JSON file that `tracerd report --save FILE` writes"
    )]
    NotJson(String),
    #[error("not a tracerd capture: {0}; diff takes files written by `tracerd report --save FILE`")]
    NotCapture(String),
    #[error("{0}")]
    Version(String),
    #[error(
        "its histograms are {0}, but version-1 captures use 100 ns to 60 s at 3 significant digits: \
         the file was edited or damaged; {save}",
        save = SAVE_AGAIN
    )]
    HistogramConfig(String),
    #[error("not a valid capture: {0}; the file was edited or damaged: {save}", save = SAVE_AGAIN)]
    Invalid(String),
}

/// A capture that could not be loaded or saved: the file and what went wrong.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    // `error`, not `source`: the message already includes it, and anyhow would print it twice.
    #[error("cannot read capture {}: {error}; check the path and its permissions", .path.display())]
    Unreadable { path: PathBuf, error: io::Error },
    #[error("capture {}: {problem}", .path.display())]
    Invalid { path: PathBuf, problem: Problem },
    #[error(
        "cannot save a capture to {}: {why}; give --save a path in an existing directory",
        .path.display()
    )]
    SaveTarget { path: PathBuf, why: String },
    #[error("cannot write capture {}: {error}", .path.display())]
    Write { path: PathBuf, error: io::Error },
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
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

    /// Reads and checks a capture file.
    pub fn load(path: &Path) -> Result<Capture, CaptureError> {
        let bytes =
            fs::read(path).map_err(|error| CaptureError::Unreadable { path: path.to_owned(), error })?;
        let invalid = |problem| CaptureError::Invalid { path: path.to_owned(), problem };
        let text = std::str::from_utf8(&bytes).map_err(|e| invalid(Problem::NotText(e.valid_up_to())))?;
        Capture::parse(text).map_err(invalid)
    }

    /// Checks a capture's text in the order that gives the most useful error: JSON at all, a
    /// capture at all, a version this tracerd reads, then every field and histogram.
    pub fn parse(text: &str) -> Result<Capture, Problem> {
        if text.trim().is_empty() {
            return Err(Problem::Empty);
        }
        let value: Value = serde_json::from_str(text).map_err(|e| Problem::NotJson(e.to_string()))?;
        let Some(top) = value.as_object() else {
            return Err(Problem::NotCapture(format!(
                "it is {}, not an object with \"format\": \"{FORMAT}\"",
                json_kind(&value)
            )));
        };
        match top.get("format") {
            Some(Value::String(f)) if f == FORMAT => {}
            Some(other) => return Err(Problem::NotCapture(format!("its \"format\" is {other}"))),
            None if top.contains_key("schema_version") => {
                return Err(Problem::NotCapture(
                    "this looks like `tracerd report --json` output, which has no histograms".into(),
                ));
            }
            None => return Err(Problem::NotCapture("it has no \"format\" field".into())),
        }
        let writer = top.get("tracerd_version").and_then(Value::as_str).unwrap_or("unknown");
        let ours = env!("CARGO_PKG_VERSION");
        match top.get("version").and_then(Value::as_u64) {
            Some(VERSION) => {}
            Some(v) if v > VERSION => {
                return Err(Problem::Version(format!(
                    "capture format version {v} was written by a newer tracerd ({writer}); this tracerd \
                     ({ours}) reads version {VERSION}: use a tracerd at least as new as the one that wrote it"
                )));
            }
            Some(v) => {
                return Err(Problem::Version(format!(
                    "capture format version {v} was written by an older tracerd ({writer}); this tracerd \
                     ({ours}) reads version {VERSION}: diff it with the tracerd that wrote it"
                )));
            }
            None => {
                let found = top.get("version").map_or_else(|| "missing".to_owned(), Value::to_string);
                return Err(Problem::Version(format!(
                    "the capture's \"version\" is {found}, not a format version; this tracerd reads \
                     version {VERSION}: {SAVE_AGAIN}"
                )));
            }
        }
        match top.get("histograms").map(|h| serde_json::from_value::<HistogramConfig>(h.clone())) {
            Some(Ok(c)) if c == HistogramConfig::CURRENT => {}
            Some(Ok(c)) => {
                return Err(Problem::HistogramConfig(format!(
                    "{} ns to {} ns at {} significant digits",
                    c.lowest_ns, c.highest_ns, c.significant_digits
                )));
            }
            Some(Err(e)) => return Err(Problem::Invalid(format!("\"histograms\": {e}"))),
            None => return Err(Problem::Invalid("the \"histograms\" field is missing".into())),
        }
        // Parsed again from the text, not the Value, so errors say line and column.
        let capture: Capture = serde_json::from_str(text).map_err(|e| Problem::Invalid(e.to_string()))?;
        capture.validate().map_err(Problem::Invalid)?;
        Ok(capture)
    }

    /// What serde cannot check: numbers in range, names given and not repeated.
    fn validate(&self) -> Result<(), String> {
        for (name, v) in [("started_unix_s", self.started_unix_s), ("duration_s", self.duration_s)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("\"{name}\" is {v}, not a time"));
            }
        }
        let mut devices = BTreeSet::new();
        for d in &self.devices {
            if d.device.is_empty() {
                return Err("a device has an empty name".into());
            }
            if !devices.insert(d.device.as_str()) {
                return Err(format!("device {} appears twice", d.device));
            }
            let mut ops = BTreeSet::new();
            for op in &d.ops {
                if !ops.insert(op.op) {
                    return Err(format!("{} {} appears twice", d.device, op.op.as_str()));
                }
            }
        }
        Ok(())
    }

    /// Fails now, before a capture is taken, if `path` cannot be saved to later.
    pub fn check_save_path(path: &Path) -> Result<(), CaptureError> {
        let why = |why: String| CaptureError::SaveTarget { path: path.to_owned(), why };
        if path.is_dir() {
            return Err(why("that is a directory; name a file in it".into()));
        }
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            return Err(why(format!("the directory {} does not exist", dir.display())));
        }
        Ok(())
    }

    /// Writes the capture to `path` atomically: to `path.tmp`, then renamed over `path`, so a
    /// reader never sees half a capture.
    pub fn save(&self, path: &Path) -> Result<(), CaptureError> {
        Capture::check_save_path(path)?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let write_err = |error| CaptureError::Write { path: path.to_owned(), error };
        // Compact: a histogram has up to thousands of buckets, one line each would be unreadable
        // anyway; `jq` shows it.
        let mut json = serde_json::to_vec(self).map_err(|e| write_err(io::Error::other(e)))?;
        json.push(b'\n');
        fs::write(&tmp, &json).and_then(|()| fs::rename(&tmp, path)).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            write_err(e)
        })
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

    fn problem(text: &str) -> String {
        Capture::parse(text).expect_err("must be refused").to_string()
    }

    /// A valid capture's JSON with `f` applied to it.
    fn edited(f: impl FnOnce(&mut Value)) -> String {
        let mut v = serde_json::to_value(capture(100)).unwrap();
        f(&mut v);
        v.to_string()
    }

    #[test]
    fn each_kind_of_bad_file_gets_its_own_message() {
        assert!(problem("").contains("the file is empty"));
        assert!(problem(" \n").contains("the file is empty"));
        let e = problem("hello");
        assert!(e.contains("truncated or not JSON") && e.contains("line 1 column 1"), "{e}");
        let full = serde_json::to_string(&capture(100)).unwrap();
        let e = problem(&full[..full.len() / 2]);
        assert!(e.contains("truncated or not JSON") && e.contains("EOF"), "{e}");
        assert!(problem("[1, 2]").contains("not a tracerd capture: it is an array"));
        assert!(problem("{}").contains("not a tracerd capture: it has no \"format\" field"));
        assert!(problem("{\"format\": \"pcap\"}").contains("its \"format\" is \"pcap\""));
        let e = problem("{\"schema_version\": 1, \"devices\": []}");
        assert!(e.contains("`tracerd report --json` output"), "{e}");
        let e = problem(&edited(|v| {
            v["version"] = 2.into();
            v["tracerd_version"] = "0.9.0".into();
        }));
        assert!(e.contains("version 2 was written by a newer tracerd (0.9.0)"), "{e}");
        assert!(e.contains("reads version 1"), "{e}");
        assert!(problem(&edited(|v| v["version"] = 0.into())).contains("older tracerd"));
        let e = problem(&edited(|v| v["version"] = "1".into()));
        assert!(e.contains("\"version\" is \"1\", not a format version"), "{e}");
        let e = problem(&edited(|v| v["histograms"]["significant_digits"] = 5.into()));
        assert!(e.contains("100 ns to 60000000000 ns at 5 significant digits"), "{e}");
    }

    fn stage_hist(v: &mut Value) -> &mut Value {
        &mut v["devices"][1]["ops"][0]["stages"]["d2c"]
    }

    #[test]
    fn damaged_histograms_and_fields_are_refused_with_the_reason() {
        type Edit = Box<dyn FnOnce(&mut Value)>;
        let cases: [(&str, Edit); 9] = [
            ("beyond the histogram's range", Box::new(|v| stage_hist(v)["buckets"][0][0] = u64::MAX.into())),
            ("count is 1 but the buckets add up to", Box::new(|v| stage_hist(v)["count"] = 1.into())),
            ("has a count of 0", Box::new(|v| stage_hist(v)["buckets"][0][1] = 0.into())),
            (
                "bucket values must increase",
                Box::new(|v| stage_hist(v)["buckets"].as_array_mut().unwrap().reverse()),
            ),
            ("cannot be the sum", Box::new(|v| stage_hist(v)["sum_ns"] = 3.into())),
            ("invalid value: integer `-5`, expected u64", Box::new(|v| stage_hist(v)["count"] = (-5).into())),
            (
                "more than 1125899906842624 samples",
                Box::new(|v| stage_hist(v)["buckets"][0][1] = u64::MAX.into()),
            ),
            (
                "unknown variant `readwrite`",
                Box::new(|v| v["devices"][1]["ops"][0]["op"] = "readwrite".into()),
            ),
            ("\"duration_s\" is -1, not a time", Box::new(|v| v["duration_s"] = (-1.0).into())),
        ];
        for (want, edit) in cases {
            let e = problem(&edited(edit));
            assert!(e.contains("not a valid capture") && e.contains(want), "want '{want}' in: {e}");
            assert!(e.contains("tracerd report --save"), "says what to do: {e}");
        }
        let e = problem(&edited(|v| {
            let d = v["devices"][1].clone();
            v["devices"].as_array_mut().unwrap().push(d);
        }));
        assert!(e.contains("device loop0 appears twice"), "{e}");
        let e = problem(&edited(|v| {
            v["devices"][1]["ops"][0]["stages"]["d2c"]["buckets"] = Value::Array(vec![])
        }));
        assert!(e.contains("no buckets"), "{e}");
        // serde's errors point into the file.
        let e = problem(&edited(|v| stage_hist(v)["count"] = 1.into()));
        assert!(e.contains("at line 1 column"), "{e}");
    }

    #[test]
    fn load_names_the_file_and_handles_unreadable_and_binary_files() {
        let dir = tempdir::Dir::new();
        let missing = dir.0.join("nope.json");
        let e = Capture::load(&missing).unwrap_err().to_string();
        assert!(e.contains("cannot read capture") && e.contains("nope.json"), "{e}");
        let garbage = dir.0.join("garbage.bin");
        let mut rng = Rng(42);
        let bytes: Vec<u8> = (0..4096).map(|_| rng.next() as u8).collect();
        fs::write(&garbage, &bytes).unwrap();
        let e = Capture::load(&garbage).unwrap_err().to_string();
        assert!(e.starts_with(&format!("capture {}: truncated or not JSON", garbage.display())), "{e}");
        let empty = dir.0.join("empty.json");
        fs::write(&empty, "").unwrap();
        assert!(Capture::load(&empty).unwrap_err().to_string().contains("empty.json: the file is empty"));
    }

    #[test]
    fn save_refuses_a_missing_directory_before_capturing() {
        let dir = tempdir::Dir::new();
        let e = Capture::check_save_path(&dir.0.join("no/such/dir/a.json")).unwrap_err().to_string();
        assert!(e.contains("directory") && e.contains("does not exist") && e.contains("--save"), "{e}");
        let e = Capture::check_save_path(&dir.0).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        assert!(Capture::check_save_path(Path::new("relative.json")).is_ok());
        // Overwriting a previous capture is fine.
        let path = dir.0.join("a.json");
        capture(10).save(&path).unwrap();
        capture(20).save(&path).unwrap();
        assert_eq!(Capture::load(&path).unwrap().devices[1].ops[0].requests, 20);
    }

    #[test]
    fn garbage_never_panics() {
        let mut rng = Rng(7);
        for len in [1usize, 2, 7, 100, 5000] {
            for _ in 0..20 {
                let text: String =
                    (0..len).map(|_| char::from_u32(rng.next() as u32 % 0x250).unwrap_or('x')).collect();
                assert!(Capture::parse(&text).is_err());
            }
        }
        let full = serde_json::to_string(&capture(200)).unwrap();
        for cut in (0..full.len()).step_by(97) {
            assert!(Capture::parse(&full[..cut]).is_err(), "a capture cut at {cut} must be refused");
        }
        for text in ["null", "0", "\"x\"", "[]", "{}", "{\"format\":\"tracerd-capture\"}", "[[[[[[[[[["] {
            assert!(Capture::parse(text).is_err(), "{text}");
        }
        assert!(
            Capture::parse(&"[".repeat(100_000)).is_err(),
            "deep nesting is an error, not a stack overflow"
        );
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        /// Every leaf of a JSON value, as a JSON pointer.
        fn leaves(v: &Value, at: String, out: &mut Vec<String>) {
            match v {
                Value::Object(m) if !m.is_empty() => m.iter().for_each(|(k, v)| {
                    leaves(v, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), out)
                }),
                Value::Array(a) if !a.is_empty() => {
                    a.iter().enumerate().for_each(|(i, v)| leaves(v, format!("{at}/{i}"), out))
                }
                _ => out.push(at),
            }
        }

        fn any_json() -> impl Strategy<Value = Value> {
            prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::from),
                any::<u64>().prop_map(Value::from),
                any::<i64>().prop_map(Value::from),
                any::<f64>().prop_map(Value::from),
                (0u64..100_000).prop_map(Value::from),
                ".{0,12}".prop_map(Value::from),
                Just(Value::Array(vec![])),
                Just(serde_json::json!([[100, 1]])),
                Just(serde_json::json!({})),
            ]
        }

        static VALID: std::sync::LazyLock<String> =
            std::sync::LazyLock::new(|| serde_json::to_string(&capture(50)).unwrap());

        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

            #[test]
            fn arbitrary_text_is_refused_without_panic(text in any::<String>()) {
                prop_assert!(Capture::parse(&text).is_err());
            }

            #[test]
            fn byte_edits_of_a_capture_never_panic(
                at in any::<prop::sample::Index>(),
                cut in any::<prop::sample::Index>(),
                insert in ".{0,8}",
            ) {
                let valid = VALID.as_bytes();
                let (i, j) = (at.index(valid.len()), cut.index(valid.len()));
                let (from, to) = (i.min(j), i.max(j).min(i.min(j) + 16));
                let mut bytes = valid[..from].to_vec();
                bytes.extend_from_slice(insert.as_bytes());
                bytes.extend_from_slice(&valid[to..]);
                let _ = Capture::parse(&String::from_utf8_lossy(&bytes));
            }

            #[test]
            fn field_edits_of_a_capture_are_ok_or_err_never_panic(
                which in any::<prop::sample::Index>(),
                replacement in any_json(),
            ) {
                let mut v: Value = serde_json::from_str(&VALID).unwrap();
                let mut paths = vec![];
                leaves(&v, String::new(), &mut paths);
                let path = &paths[which.index(paths.len())];
                *v.pointer_mut(path).unwrap() = replacement;
                if let Ok(c) = Capture::parse(&v.to_string()) {
                    // Whatever loads is usable: every histogram rebuilds and answers quantiles.
                    for d in &c.devices {
                        for op in &d.ops {
                            for h in op.stages.values() {
                                prop_assert_eq!(h.histogram().len(), h.count);
                            }
                        }
                    }
                }
            }
        }
    }
}
