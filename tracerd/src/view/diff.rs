//! A diff of two captures (`tracerd diff A B`) side by side, per device, op and stage: the counts and
//! p50/p99/p99.9 of each, the relative change, and a `*` where the change is larger than the
//! sampling noise the two captures allow.
//!
//! Noise rule. For a quantile q estimated from n samples, the rank of the sample that holds it
//! is approximately normal with standard deviation sqrt(n q (1-q)) (the binomial count of
//! samples below the true quantile). The 95% interval of ranks, n q ± 1.96 sd clamped to
//! [0, n], is mapped through each capture's histogram to an interval of values (the value at
//! quantile rank/n, widened to the edges of its histogram bucket). A change is flagged when A's
//! and B's intervals do not overlap. The normal approximation needs samples on both sides of the
//! quantile, so a quantile is not judged ("too few samples") when either capture has fewer than
//! 20 samples in that stage, or fewer than 5 expected beyond the quantile (n (1-q) < 5: p99
//! needs 500 samples, p99.9 needs 5000).

use std::fmt::Write as _;

use anyhow::{Result, bail};

use hdrhistogram::Histogram;

use serde::Serialize;

use crate::{
    model::capture::{Capture, DeviceCapture, Hist, OpCapture},
    model::causes,
    model::op::Op,
    model::stage::Stage,
    units,
    view::style::Style,
};

/// The quantiles compared, with their column names.
pub const QUANTILES: [(&str, f64); 3] = [("p50", 0.5), ("p99", 0.99), ("p99.9", 0.999)];

/// Two-sided 95% point of the normal distribution.
const Z95: f64 = 1.96;

/// Fewer samples than this in a stage: no quantile of it is judged.
pub const MIN_SAMPLES: u64 = 20;

/// Expected samples needed beyond a quantile (on its smaller side) for the normal approximation.
pub const MIN_TAIL: f64 = 5.0;

/// The whole comparison; also what `--json` prints.
#[derive(Debug, Serialize)]
pub struct Diff {
    pub a: Side,
    pub b: Side,
    pub kernels_differ: bool,
    pub devices: Vec<DeviceDiff>,
    /// Devices, ops and stages that only one capture has.
    pub only_in_a: Vec<Missing>,
    pub only_in_b: Vec<Missing>,
}

/// What a capture is: the file and its metadata.
#[derive(Debug, Serialize)]
pub struct Side {
    pub file: String,
    pub host: String,
    pub kernel: String,
    pub tracerd_version: String,
    pub started_unix_s: f64,
    pub duration_s: f64,
}

#[derive(Debug, Serialize)]
pub struct DeviceDiff {
    pub device: String,
    pub label: String,
    pub ops: Vec<OpDiff>,
}

#[derive(Debug, Serialize)]
pub struct OpDiff {
    pub op: Op,
    pub requests_a: u64,
    pub requests_b: u64,
    pub stages: Vec<StageDiff>,
    /// Waits by phase and cause in either capture (config `causes`), per IO.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub waits: Vec<WaitDiff>,
}

/// One phase and cause's waits in both captures: time per request, and share of Q2C time.
#[derive(Debug, Serialize)]
pub struct WaitDiff {
    pub phase: causes::Phase,
    pub cause: causes::Cause,
    pub per_request_a_s: f64,
    pub per_request_b_s: f64,
    pub change_pct: Option<f64>,
    pub share_of_q2c_a: f64,
    pub share_of_q2c_b: f64,
}

#[derive(Debug, Serialize)]
pub struct StageDiff {
    pub stage: Stage,
    pub count_a: u64,
    pub count_b: u64,
    pub quantiles: Vec<QuantileDiff>,
}

/// One quantile of one stage in both captures; times in seconds.
#[derive(Debug, Serialize)]
pub struct QuantileDiff {
    pub name: &'static str,
    pub quantile: f64,
    pub a_s: f64,
    pub b_s: f64,
    /// (B - A) / A in percent.
    pub change_pct: Option<f64>,
    /// The 95% intervals of the noise rule.
    pub a_interval_s: [f64; 2],
    pub b_interval_s: [f64; 2],
    pub verdict: Verdict,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The intervals do not overlap: flagged `*`.
    Changed,
    WithinNoise,
    /// Not judged (see the module's noise rule).
    TooFewSamples,
}

/// A device (op and stage absent), an op of a device, or a stage of an op, in one capture only.
#[derive(Debug, Serialize, PartialEq)]
pub struct Missing {
    pub device: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub op: Option<Op>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage: Option<Stage>,
}

impl Missing {
    fn text(&self) -> String {
        let mut s = self.device.clone();
        if let Some(op) = self.op {
            s = format!("{s} {}", op.as_str());
        }
        if let Some(stage) = self.stage {
            s = format!("{s} {}", stage.as_str().to_uppercase());
        }
        s
    }
}

/// The values between which the q-quantile lies with 95% confidence (the noise rule above).
pub fn interval(h: &Histogram<u64>, q: f64) -> (u64, u64) {
    let n = h.len().max(1) as f64;
    let sd = (n * q * (1.0 - q)).sqrt();
    let lo = ((n * q - Z95 * sd) / n).clamp(0.0, 1.0);
    let hi = ((n * q + Z95 * sd) / n).clamp(0.0, 1.0);
    (h.lowest_equivalent(h.value_at_quantile(lo)), h.highest_equivalent(h.value_at_quantile(hi)))
}

/// Whether n samples are enough to judge the q-quantile.
pub fn enough(n: u64, q: f64) -> bool {
    // The epsilon keeps 5000 * (1 - 0.999) from falling just short of 5 in floating point.
    n >= MIN_SAMPLES && n as f64 * q.min(1.0 - q) >= MIN_TAIL - 1e-9
}

fn pct(a: f64, b: f64) -> Option<f64> {
    (a > 0.0).then(|| (b - a) / a * 100.0)
}

fn compare_quantile(a: &Histogram<u64>, b: &Histogram<u64>, name: &'static str, q: f64) -> QuantileDiff {
    let (va, vb) = (a.value_at_quantile(q), b.value_at_quantile(q));
    let (ia, ib) = (interval(a, q), interval(b, q));
    let verdict = if !enough(a.len(), q) || !enough(b.len(), q) {
        Verdict::TooFewSamples
    } else if ia.1 < ib.0 || ib.1 < ia.0 {
        Verdict::Changed
    } else {
        Verdict::WithinNoise
    };
    let s = |ns: u64| ns as f64 / 1e9;
    QuantileDiff {
        name,
        quantile: q,
        a_s: s(va),
        b_s: s(vb),
        change_pct: pct(va as f64, vb as f64),
        a_interval_s: [s(ia.0), s(ia.1)],
        b_interval_s: [s(ib.0), s(ib.1)],
        verdict,
    }
}

fn compare_stage(stage: Stage, a: &Hist, b: &Hist) -> StageDiff {
    let (ha, hb) = (a.histogram(), b.histogram());
    StageDiff {
        stage,
        count_a: a.count,
        count_b: b.count,
        quantiles: QUANTILES.iter().map(|&(name, q)| compare_quantile(&ha, &hb, name, q)).collect(),
    }
}

fn side(c: &Capture, file: &str) -> Side {
    Side {
        file: file.to_owned(),
        host: c.host.clone(),
        kernel: c.kernel.clone(),
        tracerd_version: c.tracerd_version.clone(),
        started_unix_s: c.started_unix_s,
        duration_s: c.duration_s,
    }
}

fn device_list(c: &Capture) -> String {
    if c.devices.is_empty() {
        "no device (no IO completed during that capture)".into()
    } else {
        c.devices.iter().map(|d| d.device.as_str()).collect::<Vec<_>>().join(", ")
    }
}

impl Diff {
    /// Compares what both captures have; what only one has is listed. Fails when they share
    /// no device: that is two different systems' captures, or a wrong file.
    pub fn compare(a: &Capture, a_file: &str, b: &Capture, b_file: &str) -> Result<Diff> {
        let find = |c: &'_ Capture, name: &str| c.devices.iter().find(|d| d.device == name).cloned();
        if !a.devices.iter().any(|d| find(b, &d.device).is_some()) {
            bail!(
                "these captures share no device: A ({a_file}) has {}, B ({b_file}) has {}; diff compares \
                 the same devices, so capture both with the same --device",
                device_list(a),
                device_list(b)
            );
        }
        let (mut devices, mut only_in_a, mut only_in_b) = (vec![], vec![], vec![]);
        for da in &a.devices {
            match b.devices.iter().find(|d| d.device == da.device) {
                Some(db) => devices.push(compare_device(da, db, &mut only_in_a, &mut only_in_b)),
                None => only_in_a.push(Missing { device: da.device.clone(), op: None, stage: None }),
            }
        }
        for db in b.devices.iter().filter(|db| find(a, &db.device).is_none()) {
            only_in_b.push(Missing { device: db.device.clone(), op: None, stage: None });
        }
        Ok(Diff {
            a: side(a, a_file),
            b: side(b, b_file),
            kernels_differ: a.kernel != b.kernel,
            devices,
            only_in_a,
            only_in_b,
        })
    }

    /// The comparison without colour.
    pub fn render_text(&self) -> String {
        self.render_text_styled(Style::PLAIN)
    }

    /// The comparison, emphasised by `style`: bold headings, changed rows (`*`) red where B is
    /// slower and green where it is faster, unjudged ones dim, the kernel warning yellow.
    /// Without colour, exactly `render_text`.
    pub fn render_text_styled(&self, style: Style) -> String {
        let mut out = String::new();
        for (name, s) in [("A", &self.a), ("B", &self.b)] {
            let _ = writeln!(
                out,
                "{name}: {}: host {}, kernel {}, {:.1} s from {}",
                s.file,
                s.host,
                s.kernel,
                s.duration_s,
                units::utc(s.started_unix_s)
            );
        }
        if self.kernels_differ {
            let warning = format!(
                "warning: the captures come from different kernels (A {}, B {}): a change may be the kernel's",
                self.a.kernel, self.b.kernel
            );
            let _ = writeln!(out, "{}", style.yellow(&warning));
        }
        let t = |secs: f64| units::duration_ns(secs * 1e9);
        let change = |p: Option<f64>| p.map_or_else(|| "-".to_owned(), |p| format!("{p:+.1}%"));
        for d in &self.devices {
            for op in &d.ops {
                let _ = writeln!(
                    out,
                    "\n{} {} requests in A, {} in B ({})",
                    style.bold(&format!("{} {}:", d.label, op.op.as_str())),
                    op.requests_a,
                    op.requests_b,
                    change(pct(op.requests_a as f64, op.requests_b as f64))
                );
                let header = format!("  {:<6} {:<6} {:>10} {:>10} {:>10}", "stage", "", "A", "B", "change");
                let _ = writeln!(out, "{}", style.bold(&header));
                for s in &op.stages {
                    let _ = writeln!(
                        out,
                        "  {:<6} {:<6} {:>10} {:>10} {:>10}",
                        s.stage.as_str().to_uppercase(),
                        "count",
                        s.count_a,
                        s.count_b,
                        change(pct(s.count_a as f64, s.count_b as f64))
                    );
                    for q in &s.quantiles {
                        let flag = match q.verdict {
                            Verdict::Changed => " *",
                            Verdict::WithinNoise => "",
                            Verdict::TooFewSamples => " too few samples",
                        };
                        let row = format!(
                            "  {:<6} {:<6} {:>10} {:>10} {:>10}{flag}",
                            "",
                            q.name,
                            t(q.a_s),
                            t(q.b_s),
                            change(q.change_pct)
                        );
                        let row = match q.verdict {
                            Verdict::Changed if q.b_s > q.a_s => style.red(&row),
                            Verdict::Changed => style.green(&row),
                            Verdict::WithinNoise => row,
                            Verdict::TooFewSamples => style.dim(&row),
                        };
                        let _ = writeln!(out, "{row}");
                    }
                }
                if !op.waits.is_empty() {
                    let _ = writeln!(out, "  waits per request, by cause (share of Q2C time):");
                    for w in &op.waits {
                        let cell = |s: f64, share: f64| format!("{} ({:.0}%)", t(s), 100.0 * share);
                        let _ = writeln!(
                            out,
                            "  {:<6} {:<13} {:>16} {:>16} {:>10}",
                            w.phase.name(),
                            w.cause.name(),
                            cell(w.per_request_a_s, w.share_of_q2c_a),
                            cell(w.per_request_b_s, w.share_of_q2c_b),
                            change(w.change_pct)
                        );
                    }
                }
            }
        }
        for (name, list) in [("A", &self.only_in_a), ("B", &self.only_in_b)] {
            if !list.is_empty() {
                let items: Vec<String> = list.iter().map(Missing::text).collect();
                let _ = writeln!(out, "\nonly in {name}: {}", items.join(", "));
            }
        }
        let _ = writeln!(
            out,
            "\n* the change is larger than sampling noise: the 95% intervals of the quantile in A and B do \
             not overlap."
        );
        let mut quantiles =
            self.devices.iter().flat_map(|d| &d.ops).flat_map(|o| &o.stages).flat_map(|s| &s.quantiles);
        if quantiles.any(|q| q.verdict == Verdict::TooFewSamples) {
            let _ = writeln!(
                out,
                "too few samples: under {MIN_SAMPLES} in the stage, or under {MIN_TAIL} expected beyond the \
                 quantile; not judged."
            );
        }
        out
    }
}

/// The waits of either capture, by phase and cause, each per request and as a share of the
/// requests' Q2C time; most time per request in B first.
fn compare_waits(a: &OpCapture, b: &OpCapture) -> Vec<WaitDiff> {
    let keys: std::collections::BTreeSet<_> =
        a.waits.iter().chain(&b.waits).map(|w| (w.phase, w.cause)).collect();
    let side = |o: &OpCapture, key| {
        let ns = o.waits.iter().find(|w| (w.phase, w.cause) == key).map_or(0, |w| w.wait_ns) as f64;
        let q2c = o.stages.get(&Stage::Q2c).map_or(0, |h| h.sum_ns) as f64;
        (ns / 1e9 / o.requests.max(1) as f64, if q2c > 0.0 { ns / q2c } else { 0.0 })
    };
    let mut out: Vec<WaitDiff> = keys
        .into_iter()
        .map(|key| {
            let ((per_a, share_a), (per_b, share_b)) = (side(a, key), side(b, key));
            WaitDiff {
                phase: key.0,
                cause: key.1,
                per_request_a_s: per_a,
                per_request_b_s: per_b,
                change_pct: pct(per_a, per_b),
                share_of_q2c_a: share_a,
                share_of_q2c_b: share_b,
            }
        })
        .collect();
    out.sort_by(|x, y| y.per_request_b_s.total_cmp(&x.per_request_b_s));
    out
}

fn compare_device(
    da: &DeviceCapture,
    db: &DeviceCapture,
    only_in_a: &mut Vec<Missing>,
    only_in_b: &mut Vec<Missing>,
) -> DeviceDiff {
    let missing = |op, stage| Missing { device: da.device.clone(), op: Some(op), stage };
    let mut ops = vec![];
    for oa in &da.ops {
        let Some(ob) = db.ops.iter().find(|o| o.op == oa.op) else {
            only_in_a.push(missing(oa.op, None));
            continue;
        };
        let mut stages = vec![];
        for (&stage, ha) in &oa.stages {
            match ob.stages.get(&stage) {
                Some(hb) => stages.push(compare_stage(stage, ha, hb)),
                None => only_in_a.push(missing(oa.op, Some(stage))),
            }
        }
        for &stage in ob.stages.keys().filter(|s| !oa.stages.contains_key(s)) {
            only_in_b.push(missing(oa.op, Some(stage)));
        }
        let waits = compare_waits(oa, ob);
        ops.push(OpDiff { op: oa.op, requests_a: oa.requests, requests_b: ob.requests, stages, waits });
    }
    for ob in db.ops.iter().filter(|ob| !da.ops.iter().any(|oa| oa.op == ob.op)) {
        only_in_b.push(missing(ob.op, None));
    }
    DeviceDiff { device: da.device.clone(), label: da.label.clone(), ops }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::{
        model::aggregate::{HIGHEST_NS, LOWEST_NS, SIGFIG, StageHist},
        model::capture::{FORMAT, HistogramConfig, OpCapture, VERSION, tests::Rng},
    };

    fn hist(values: impl IntoIterator<Item = u64>) -> Hist {
        let mut s = StageHist {
            hist: Histogram::new_with_bounds(LOWEST_NS, HIGHEST_NS, SIGFIG).unwrap(),
            sum_ns: 0,
            bucketed: false,
        };
        for v in values {
            s.hist.record(v).unwrap();
            s.sum_ns += v;
        }
        Hist::of(&s)
    }

    /// (device, op, its stages' histograms)
    type Series<'a> = (&'a str, Op, Vec<(Stage, Hist)>);

    /// A capture of these series.
    fn capture(kernel: &str, devices: &[Series]) -> Capture {
        let mut out: Vec<DeviceCapture> = vec![];
        for (device, op, stages) in devices {
            let op = OpCapture {
                op: *op,
                requests: stages.first().map_or(0, |(_, h)| h.count),
                bytes: 0,
                merged_bios: 0,
                errors: 0,
                unlinked: 0,
                unlinked_kinds: BTreeMap::new(),
                stages: stages.iter().cloned().collect(),
                queue_depth: None,
                layers: vec![],
                qos_wait: BTreeMap::new(),
                waits: vec![],
            };
            match out.iter_mut().find(|d| d.device == *device) {
                Some(d) => d.ops.push(op),
                None => out.push(DeviceCapture {
                    device: device.to_string(),
                    label: device.to_string(),
                    lowers: vec![],
                    ops: vec![op],
                }),
            }
        }
        Capture {
            format: FORMAT.into(),
            version: VERSION,
            tracerd_version: "0.1.0".into(),
            kernel: kernel.into(),
            host: "vm1".into(),
            started_unix_s: 1_700_000_000.0,
            duration_s: 5.0,
            histograms: HistogramConfig::CURRENT,
            devices: out,
            lost: BTreeMap::new(),
        }
    }

    /// n samples, 10-20 µs, with every 50th (2%) multiplied by `tail`.
    fn samples(n: u64, seed: u64, tail: u64) -> Vec<u64> {
        let mut rng = Rng(seed);
        (0..n).map(|i| (10_000 + rng.next() % 10_000) * if i % 50 == 0 { tail } else { 1 }).collect()
    }

    fn one(stage: Stage, values: Vec<u64>) -> Capture {
        capture("6.18", &[("loop0", Op::Read, vec![(stage, hist(values))])])
    }

    fn verdicts(d: &Diff) -> Vec<(&'static str, Verdict)> {
        d.devices[0].ops[0].stages[0].quantiles.iter().map(|q| (q.name, q.verdict)).collect()
    }

    #[test]
    fn waits_are_compared_per_request_and_as_shares_of_q2c() {
        use crate::model::capture::WaitCapture;
        use causes::{Cause, Phase};
        let (mut a, mut b) = (one(Stage::Q2c, vec![100_000; 100]), one(Stage::Q2c, vec![200_000; 100]));
        let wait = |cause, waits, wait_ns| WaitCapture { phase: Phase::Q2g, cause, waits, wait_ns };
        a.devices[0].ops[0].waits = vec![wait(Cause::Cpu, 10, 1_000_000)];
        b.devices[0].ops[0].waits = vec![wait(Cause::Cpu, 10, 1_000_000), wait(Cause::Tag, 100, 10_000_000)];
        let d = Diff::compare(&a, "a.json", &b, "b.json").unwrap();
        let w = &d.devices[0].ops[0].waits;
        assert_eq!(
            w.iter().map(|w| w.cause).collect::<Vec<_>>(),
            [Cause::Tag, Cause::Cpu],
            "most in B first"
        );
        // Tag: none in A; 100 us per request in B, half of its 200 us Q2C.
        assert_eq!((w[0].per_request_a_s, w[0].change_pct), (0.0, None));
        assert!((w[0].per_request_b_s - 100e-6).abs() < 1e-12 && (w[0].share_of_q2c_b - 0.5).abs() < 1e-9);
        // CPU: 10 us per request in both, 10 % of A's Q2C and 5 % of B's.
        assert_eq!(w[1].change_pct, Some(0.0));
        assert!((w[1].share_of_q2c_a - 0.1).abs() < 1e-9 && (w[1].share_of_q2c_b - 0.05).abs() < 1e-9);
        let text = d.render_text();
        assert!(text.contains("waits per request, by cause"), "{text}");
        let tag = text.lines().find(|l| l.contains(" tag ")).unwrap();
        assert!(tag.contains("0ns (0%)") && tag.contains("(50%)"), "{tag}");
        // Without waits in either, no such lines.
        let plain =
            Diff::compare(&one(Stage::Q2c, vec![1000; 100]), "a", &one(Stage::Q2c, vec![1000; 100]), "b")
                .unwrap();
        assert!(!plain.render_text().contains("waits"));
    }

    #[test]
    fn a_tail_ten_times_slower_is_flagged_at_p99_and_the_median_is_not() {
        let (a, b) = (one(Stage::D2c, samples(5000, 1, 1)), one(Stage::D2c, samples(5000, 2, 10)));
        let d = Diff::compare(&a, "a.json", &b, "b.json").unwrap();
        let s = &d.devices[0].ops[0].stages[0];
        assert_eq!((s.count_a, s.count_b), (5000, 5000));
        let p99 = &s.quantiles[1];
        assert_eq!(p99.verdict, Verdict::Changed);
        // The 2% tail holds B's p99: 7.5 times A's.
        assert!(p99.b_s > 5.0 * p99.a_s, "{p99:?}");
        assert!(p99.change_pct.unwrap() > 400.0, "{p99:?}");
        assert_eq!(s.quantiles[0].verdict, Verdict::WithinNoise, "{:?}", s.quantiles[0]);
        let text = d.render_text();
        assert!(text.contains("loop0 read: 5000 requests in A, 5000 in B (+0.0%)"), "{text}");
        assert!(text.contains("  D2C    count        5000       5000      +0.0%\n"), "{text}");
        let p99_line = text.lines().find(|l| l.contains(" p99 ")).unwrap();
        assert!(p99_line.ends_with('*') && p99_line.contains("20.0µs"), "{text}");
        assert!(!text.contains("warning"), "same kernel: {text}");
        assert!(!text.contains("too few samples"), "every quantile was judged: {text}");
    }

    #[test]
    fn the_same_distribution_is_not_flagged() {
        let a = one(Stage::Q2c, samples(5000, 1, 3));
        let same = Diff::compare(&a, "a", &one(Stage::Q2c, samples(5000, 1, 3)), "b").unwrap();
        assert!(verdicts(&same).iter().all(|(_, v)| *v == Verdict::WithinNoise), "{:?}", verdicts(&same));
        assert!(same.devices[0].ops[0].stages[0].quantiles.iter().all(|q| q.change_pct == Some(0.0)));
        // Another sample of the same distribution: differences, but within the noise.
        for seed in 2..12 {
            let other = Diff::compare(&a, "a", &one(Stage::Q2c, samples(5000, seed, 3)), "b").unwrap();
            assert!(
                verdicts(&other).iter().all(|(_, v)| *v == Verdict::WithinNoise),
                "seed {seed}: {:?}",
                other.devices[0].ops[0].stages[0].quantiles
            );
        }
    }

    #[test]
    fn small_counts_are_not_judged() {
        let d = Diff::compare(
            &one(Stage::D2c, samples(10, 1, 1)),
            "a",
            &one(Stage::D2c, samples(10, 2, 10)),
            "b",
        )
        .unwrap();
        assert!(verdicts(&d).iter().all(|(_, v)| *v == Verdict::TooFewSamples));
        let text = d.render_text();
        assert!(text.lines().filter(|l| l.ends_with("too few samples")).count() == 3, "{text}");
        assert!(text.contains("too few samples: under 20 in the stage, or under 5 expected"), "{text}");
        // 1000 samples judge p50 and p99, not p99.9 (5 samples beyond it are needed: n >= 5000).
        let d = Diff::compare(
            &one(Stage::D2c, samples(1000, 1, 1)),
            "a",
            &one(Stage::D2c, samples(1000, 1, 1)),
            "b",
        )
        .unwrap();
        assert_eq!(
            verdicts(&d),
            [("p50", Verdict::WithinNoise), ("p99", Verdict::WithinNoise), ("p99.9", Verdict::TooFewSamples)]
        );
        assert!(enough(5000, 0.999) && !enough(4999, 0.999) && enough(20, 0.5) && !enough(19, 0.5));
    }

    #[test]
    fn the_noise_interval_holds_the_quantile_and_narrows_with_samples() {
        // 1-2 ms, where buckets are 0.1% wide (below 131 µs they are 64 ns wide, which would
        // bound the interval instead of the sample count).
        let h = hist(samples(5000, 3, 1).into_iter().map(|v| v * 100)).histogram();
        let big = hist(samples(50_000, 3, 1).into_iter().map(|v| v * 100)).histogram();
        for q in [0.5, 0.99] {
            let (lo, hi) = interval(&h, q);
            assert!(lo <= h.value_at_quantile(q) && h.value_at_quantile(q) <= hi);
            let (blo, bhi) = interval(&big, q);
            assert!(bhi - blo < hi - lo, "q{q}: {blo}..{bhi} vs {lo}..{hi}");
        }
    }

    #[test]
    fn what_only_one_capture_has_is_listed() {
        let h = || hist(samples(100, 1, 1));
        let a = capture(
            "6.1.0",
            &[
                ("loop0", Op::Read, vec![(Stage::G2i, h()), (Stage::D2c, h())]),
                ("loop0", Op::Write, vec![(Stage::D2c, h())]),
                ("loop2", Op::Read, vec![(Stage::D2c, h())]),
            ],
        );
        let b = capture(
            "6.18.44",
            &[
                ("loop0", Op::Read, vec![(Stage::D2c, h()), (Stage::Q2c, h())]),
                ("loop1", Op::Read, vec![(Stage::D2c, h())]),
            ],
        );
        let d = Diff::compare(&a, "a", &b, "b").unwrap();
        assert_eq!(d.devices.len(), 1);
        assert_eq!(d.devices[0].ops[0].stages.iter().map(|s| s.stage).collect::<Vec<_>>(), [Stage::D2c]);
        let text = d.render_text();
        assert!(text.contains("only in A: loop0 read G2I, loop0 write, loop2\n"), "{text}");
        assert!(text.contains("only in B: loop0 read Q2C, loop1\n"), "{text}");
        assert!(
            text.contains("warning: the captures come from different kernels (A 6.1.0, B 6.18.44)"),
            "{text}"
        );
        assert!(text.contains("A: a: host vm1, kernel 6.1.0, 5.0 s from 2023-11-14 22:13:20 UTC"), "{text}");
        let json = serde_json::to_value(&d).unwrap();
        assert_eq!(
            json["only_in_b"][0],
            serde_json::json!({"device": "loop0", "op": "read", "stage": "q2c"})
        );
        assert_eq!(json["only_in_b"][1], serde_json::json!({"device": "loop1"}));
        assert_eq!(json["kernels_differ"], true);
        assert_eq!(json["devices"][0]["ops"][0]["stages"][0]["quantiles"][0]["verdict"], "within_noise");
    }

    #[test]
    fn captures_of_different_devices_are_refused() {
        let a = one(Stage::D2c, samples(100, 1, 1));
        let b = capture("6.18", &[("nvme0n1", Op::Read, vec![(Stage::D2c, hist(samples(100, 1, 1)))])]);
        let e = Diff::compare(&a, "a.json", &b, "b.json").unwrap_err().to_string();
        assert!(
            e.contains("these captures share no device: A (a.json) has loop0, B (b.json) has nvme0n1")
                && e.contains("diff compares the same devices"),
            "{e}"
        );
        let empty = capture("6.18", &[]);
        let e = Diff::compare(&a, "a.json", &empty, "b.json").unwrap_err().to_string();
        assert!(e.contains("B (b.json) has no device (no IO completed"), "{e}");
    }

    /// `render_text` before colour existed (captured from that version).
    const BEFORE: &str = r#"A: a.json: host vm1, kernel 6.18, 5.0 s from 2023-11-14 22:13:20 UTC
B: b.json: host vm1, kernel 6.18, 5.0 s from 2023-11-14 22:13:20 UTC

loop0 read: 5000 requests in A, 5000 in B (+0.0%)
  stage                  A          B     change
  D2C    count        5000       5000      +0.0%
         p50        15.0µs     15.2µs      +0.9%
         p99        20.0µs    148.5µs    +643.6% *
         p99.9      20.0µs    196.2µs    +879.6% *

* the change is larger than sampling noise: the 95% intervals of the quantile in A and B do not overlap.
"#;
    const BEFORE_FEW: &str = r#"A: a: host vm1, kernel 6.18, 5.0 s from 2023-11-14 22:13:20 UTC
B: b: host vm1, kernel 6.18, 5.0 s from 2023-11-14 22:13:20 UTC

loop0 read: 10 requests in A, 10 in B (+0.0%)
  stage                  A          B     change
  D2C    count          10         10      +0.0%
         p50        15.0µs     16.5µs      +9.8% too few samples
         p99        19.8µs    195.3µs    +887.7% too few samples
         p99.9      19.8µs    195.3µs    +887.7% too few samples

* the change is larger than sampling noise: the 95% intervals of the quantile in A and B do not overlap.
too few samples: under 20 in the stage, or under 5 expected beyond the quantile; not judged.
"#;

    #[test]
    fn plain_text_is_unchanged_and_colour_marks_the_changed_rows() {
        let (a, b) = (one(Stage::D2c, samples(5000, 1, 1)), one(Stage::D2c, samples(5000, 2, 10)));
        let d = Diff::compare(&a, "a.json", &b, "b.json").unwrap();
        assert_eq!(d.render_text(), BEFORE);
        assert_eq!(d.render_text_styled(Style::PLAIN), BEFORE);
        let coloured = d.render_text_styled(Style::COLOR);
        assert_eq!(crate::view::style::strip(&coloured), BEFORE);
        // B is slower at p99 and p99.9: those rows red; p50, within the noise, plain.
        let rows: Vec<&str> = coloured.lines().filter(|l| l.contains(" p99")).collect();
        assert!(rows.iter().all(|l| l.starts_with("\x1b[31m") && l.ends_with(" *\x1b[39m")), "{coloured}");
        let p50 = coloured.lines().find(|l| l.contains(" p50 ")).unwrap();
        assert!(!p50.contains('\x1b'), "{coloured}");
        // Faster: green.
        let d = Diff::compare(&b, "b.json", &a, "a.json").unwrap();
        let coloured = d.render_text_styled(Style::COLOR);
        let flagged: Vec<&str> = coloured.lines().filter(|l| l.ends_with(" *\x1b[39m")).collect();
        assert!(flagged.len() == 2 && flagged.iter().all(|l| l.starts_with("\x1b[32m")), "{coloured}");
        // Not judged: dim.
        let d = Diff::compare(
            &one(Stage::D2c, samples(10, 1, 1)),
            "a",
            &one(Stage::D2c, samples(10, 2, 10)),
            "b",
        )
        .unwrap();
        assert_eq!(d.render_text(), BEFORE_FEW);
        let coloured = d.render_text_styled(Style::COLOR);
        assert_eq!(coloured.lines().filter(|l| l.starts_with("\x1b[2m")).count(), 3, "{coloured}");
    }
}
