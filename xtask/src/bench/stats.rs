//! What the runs measured and the statistics read from it: one run's `Sample`, every run's
//! `Results` by row and variant, medians, losses against no tracer, and the figures paired
//! within a round with the A/A noise they are judged against.

use std::collections::BTreeMap;

use super::variants::Variant;

/// One fio run under one variant.
#[derive(Clone, Debug, Default)]
pub(super) struct Sample {
    pub(super) iops: f64,
    pub(super) ios: u64,
    pub(super) cpu_ns_per_io: f64,
    pub(super) bpf_ns_per_io: Option<f64>,
    pub(super) bpf_programs: usize,
    /// With stats on: each program's (BPF ns, runs) per IO, by name: where the BPF time goes.
    pub(super) bpf_by_program: BTreeMap<String, (f64, f64)>,
    pub(super) tracer_cpu_ns_per_io: Option<f64>,
    pub(super) tracer_rss_kib: Option<u64>,
    pub(super) lost: Option<u64>,
    /// `tracerd run`'s non-zero lost-event counters by reason.
    pub(super) lost_reasons: BTreeMap<String, u64>,
}

/// Every run's sample by (row, variant), in round order.
pub(super) type Results = BTreeMap<(String, Variant), Vec<Sample>>;

/// The middle value (of an even number, the upper one); NaN for none.
pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

/// IOPS loss against the no-tracer run of the same round, per round (samples are in round
/// order, so round r of every variant ran side by side).
pub(super) fn losses(results: &Results, w: &str, v: Variant) -> Vec<f64> {
    let (Some(base), Some(traced)) = (results.get(&(w.into(), Variant::None)), results.get(&(w.into(), v)))
    else {
        return Vec::new();
    };
    base.iter().zip(traced).map(|(b, t)| 1.0 - t.iops / b.iops).collect()
}

/// The untraced runs' round-to-round spread, (max - min) / median of their IOPS: how far
/// apart two runs of the same thing land, the noise any loss is read against.
pub(super) fn noise(results: &Results, w: &str) -> f64 {
    let iops: Vec<f64> =
        results.get(&(w.into(), Variant::None)).map_or(Vec::new(), |v| v.iter().map(|s| s.iops).collect());
    let (lo, hi) = iops.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    if iops.is_empty() { f64::NAN } else { (hi - lo) / median(iops) }
}

/// The whole machine's CPU per IO of `v` in each round, in round order.
pub(super) fn cpu_per_io(results: &Results, w: &str, v: Variant) -> Vec<f64> {
    results.get(&(w.into(), v)).map_or(Vec::new(), |s| s.iter().map(|s| s.cpu_ns_per_io).collect())
}

/// Per round: `v`'s CPU per IO minus that of the same round's untraced runs (the mean of the
/// one that opens the round and the one that closes it). Pairing within the round takes out
/// what a shared machine drifts by between rounds, which is larger than the costs measured.
pub(super) fn paired_extra(results: &Results, w: &str, v: Variant) -> Vec<f64> {
    let (base, again) = (cpu_per_io(results, w, Variant::None), cpu_per_io(results, w, Variant::NoneAgain));
    let cpu = cpu_per_io(results, w, v);
    cpu.iter()
        .enumerate()
        .filter_map(|(r, c)| {
            let b = *base.get(r)?;
            Some(c - again.get(r).map_or(b, |a| (a + b) / 2.0))
        })
        .collect()
}

/// Per round: `a`'s paired extra minus `k` times `b`'s, the difference a cost target judges.
pub(super) fn paired_diff(results: &Results, w: &str, (a, b): (Variant, Variant), k: f64) -> Vec<f64> {
    let (ea, eb) = (paired_extra(results, w, a), paired_extra(results, w, b));
    ea.iter().zip(&eb).map(|(x, y)| x - k * y).collect()
}

/// A row's A/A noise: the median over rounds of |no tracer again - no tracer|, how far apart
/// two identical untraced runs of one round land. Two variants that cost the same differ,
/// round by round, by that much.
pub(super) fn aa_noise(results: &Results, w: &str) -> f64 {
    let (base, again) = (cpu_per_io(results, w, Variant::None), cpu_per_io(results, w, Variant::NoneAgain));
    median(base.iter().zip(&again).map(|(a, b)| (b - a).abs()).collect())
}
