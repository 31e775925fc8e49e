//! The daemon's histograms (HdrHistogram) and the kernel's buckets as exposition histograms:
//! the fixed classic buckets, and for protobuf the native exponential ones.

use tracer_common::agg;

use crate::{
    model::aggregate::{HIGHEST_NS, StageHist, bucket_middle},
    model::recorder::Buckets,
    serve::exposition::{BUCKETS_S, Hist, Native},
};

/// A daemon histogram: its HdrHistogram folded into the classic buckets, and with `native`,
/// its recorded values into exponential ones.
pub(super) fn stage_hist(h: &StageHist, native: bool) -> Hist {
    let mut per_bucket = [0u64; BUCKETS_S.len()];
    for v in h.hist.iter_recorded() {
        let secs = v.value_iterated_to() as f64 / 1e9;
        if let Some(i) = BUCKETS_S.iter().position(|&le| secs <= le) {
            per_bucket[i] += v.count_at_value();
        }
    }
    let native = native.then(|| {
        Native::from_values(
            h.hist.iter_recorded().map(|v| (v.value_iterated_to() as f64 / 1e9, v.count_at_value())),
        )
    });
    Hist {
        buckets: cumulative(per_bucket),
        count: h.count(),
        sum: h.sum_ns as f64 / 1e9,
        exemplars: vec![],
        native,
    }
}

/// A histogram in the kernel's buckets: each classic bound is one of theirs, so the classic
/// counts are exact; natively each bucket's IOs sit at its middle.
pub(super) fn buckets_hist(b: &Buckets, native: bool) -> Hist {
    let mut per_bucket = [0u64; BUCKETS_S.len()];
    for (k, &n) in b.counts.iter().enumerate().filter(|(_, n)| **n != 0) {
        let ns = agg::BOUNDS_NS.get(k).copied().unwrap_or(u64::MAX);
        if let Some(i) = BUCKETS_S.iter().position(|&le| ns <= (le * 1e9).round() as u64) {
            per_bucket[i] += n;
        }
    }
    let native = native.then(|| {
        Native::from_values(
            b.counts.iter().enumerate().map(|(k, &n)| (bucket_middle(k).min(HIGHEST_NS) as f64 / 1e9, n)),
        )
    });
    Hist {
        buckets: cumulative(per_bucket),
        count: b.count(),
        sum: b.sum_ns as f64 / 1e9,
        exemplars: vec![],
        native,
    }
}

fn cumulative(per_bucket: [u64; BUCKETS_S.len()]) -> Vec<(f64, u64)> {
    let mut total = 0;
    BUCKETS_S
        .iter()
        .zip(per_bucket)
        .map(|(&le, n)| {
            total += n;
            (le, total)
        })
        .collect()
}
