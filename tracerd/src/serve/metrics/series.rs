//! The per-series families, one series per (device, op), or per (device, op, cgroup) with
//! cgroup labels on: the stage histograms, the rq-qos waits, the queue depths and the request
//! counters.

use std::sync::Arc;

use super::{
    State,
    family::{family, histogram, labels, number},
    hist::{buckets_hist, stage_hist},
};
use crate::{
    model::aggregate::{OpStats, QD_BUCKETS, QueueDepths},
    model::op::Op,
    model::recorder::SeriesFrame,
    model::stage::{Stage, qos_name},
    serve::exposition::{Family, Hist, Kind},
};

/// A per-series counter: name, help, and how to read it.
type Counter = (&'static str, &'static str, fn(&OpStats) -> u64);

/// `tracerd_io_stage_seconds`, with exemplars where the format carries them.
pub(super) fn stage_seconds(out: &mut Vec<Family>, state: &State, native: bool, with_exemplars: bool) {
    let name = |d: u32| state.agg.name(d);
    let mut f = family(
        "tracerd_io_stage_seconds",
        Kind::Histogram,
        "Time IOs spent in each block-layer stage (blktrace intervals).",
    );
    match &state.cgroups {
        None => {
            let mut keys: Vec<(&str, u32, Op)> =
                state.agg.series.keys().map(|&(d, op)| (name(d), d, op)).collect();
            keys.sort();
            for (device, dev, op) in keys {
                let stats = &state.agg.series[&(dev, op)];
                for stage in Stage::ALL {
                    let Some(h) = stats.stage(stage) else { continue };
                    let mut hist = stage_hist(h, native);
                    if with_exemplars {
                        hist.exemplars = state.exemplars.of(&(dev, op, None), stage, device);
                    }
                    histogram(
                        &mut f,
                        labels([("device", device), ("op", op.as_str()), ("stage", stage.as_str())]),
                        hist,
                    );
                }
            }
        }
        Some(cgroups) => {
            let mut keys: Vec<(&str, u32, Op, &Arc<str>)> =
                cgroups.series.keys().map(|(d, op, l)| (name(*d), *d, *op, l)).collect();
            keys.sort();
            for (device, dev, op, label) in keys {
                let s = &cgroups.series[&(dev, op, label.clone())];
                for stage in Stage::ALL {
                    let Some(b) = &s.stages[stage.index()] else { continue };
                    let mut hist = buckets_hist(b, native);
                    if with_exemplars {
                        hist.exemplars = state.exemplars.of(&(dev, op, Some(label.clone())), stage, device);
                    }
                    histogram(
                        &mut f,
                        labels([
                            ("device", device),
                            ("op", op.as_str()),
                            ("cgroup", label),
                            ("stage", stage.as_str()),
                        ]),
                        hist,
                    );
                }
            }
        }
    }
    out.push(f);
}

/// `tracerd_io_qos_wait_seconds`.
pub(super) fn qos_wait_seconds(out: &mut Vec<Family>, series: &[(&str, Op, &OpStats)], native: bool) {
    let mut f = family(
        "tracerd_io_qos_wait_seconds",
        Kind::Histogram,
        "Time IOs waited in rq-qos policies (wbt, iolatency, iocost) between Q and G, part of \
         their Q2G; with config rq_qos = true.",
    );
    for (device, op, stats) in series {
        for (&policies, h) in &stats.qos {
            let policy = qos_name(policies);
            let l = labels([("device", device), ("op", op.as_str()), ("policy", &policy)]);
            histogram(&mut f, l, stage_hist(h, native));
        }
    }
    out.push(f);
}

/// `tracerd_io_queue_depth`.
pub(super) fn queue_depth(out: &mut Vec<Family>, series: &[(&str, Op, &OpStats)]) {
    let mut f = family(
        "tracerd_io_queue_depth",
        Kind::Histogram,
        "Requests in flight on the disk when each request was issued (this one included).",
    );
    for (device, op, stats) in series {
        let q = &stats.queue_depth;
        if q.count == 0 {
            continue;
        }
        let mut total = 0;
        let buckets = (0..QD_BUCKETS - 1)
            .map(|k| {
                total += q.buckets[k];
                (f64::from(QueueDepths::le(k).unwrap_or(u32::MAX)), total)
            })
            .collect();
        let h = Hist { buckets, count: q.count, sum: q.sum as f64, exemplars: vec![], native: None };
        histogram(&mut f, labels([("device", device), ("op", op.as_str())]), h);
    }
    out.push(f);
}

/// The request counters (requests, bytes, merged bios, errors), per cgroup where the series
/// carry one.
pub(super) fn counters(out: &mut Vec<Family>, state: &State, series: &[(&str, Op, &OpStats)]) {
    let name = |d: u32| state.agg.name(d);
    let counters: [Counter; 4] = [
        ("tracerd_io_requests_total", "Completed requests.", |s| s.requests),
        ("tracerd_io_bytes_total", "Bytes transferred by completed requests.", |s| s.bytes),
        ("tracerd_io_merged_bios_total", "Bios merged into an existing request.", |s| s.merged_bios),
        ("tracerd_io_errors_total", "Requests completed with an error status.", |s| s.errors),
    ];
    // The same counters, of a cgroup's series.
    let cgroup_values: [fn(&SeriesFrame) -> u64; 4] =
        [|s| s.requests, |s| s.bytes, |s| s.merged_bios, |s| s.errors];
    for ((counter, help, value), cgroup_value) in counters.into_iter().zip(cgroup_values) {
        let mut f = family(counter, Kind::Counter, help);
        match &state.cgroups {
            None => {
                for (device, op, stats) in series {
                    number(&mut f, labels([("device", device), ("op", op.as_str())]), value(stats) as f64);
                }
            }
            Some(cgroups) => {
                for (device, op, cgroup, s) in cgroups.sorted(name) {
                    let l = labels([("device", device), ("op", op.as_str()), ("cgroup", cgroup)]);
                    number(&mut f, l, cgroup_value(s) as f64);
                }
            }
        }
        out.push(f);
    }
}

#[cfg(test)]
mod tests {
    use crate::model::op::Op;
    use crate::serve::metrics::{render, tests::sample_state};
    use tracer_common::{IoRecord, event, kind};

    #[test]
    fn with_cgroups_the_stage_and_request_metrics_carry_the_label_and_add_up() {
        use crate::model::cgroups::LabelForm;
        use crate::model::cgroups::{CgroupLimits, CgroupSeries, Unnamed};
        let mut state = sample_state();
        let mut c = CgroupSeries::new(CgroupLimits { label: LabelForm::Path, top: 1, ..Default::default() });
        let now = std::time::Instant::now();
        for (d2c_us, label) in [(3u64, Ok("/a")), (30, Ok("/b")), (300, Err(Unnamed::Unknown))] {
            let mut r = IoRecord { kind: kind::REQUEST, bytes: 4096, ..Default::default() };
            (r.ts[event::D], r.ts[event::C]) = (1000, 1000 + d2c_us * 1000);
            c.add(7, Op::Write, &r, label, now);
        }
        state.cgroups = Some(c);
        let text = render(&state);
        let a = "device=\"lo\\\"op\\\\0\",op=\"write\",cgroup=\"/a\"";
        let other = "device=\"lo\\\"op\\\\0\",op=\"write\",cgroup=\"other\"";
        for (le, n) in [("0.000002", 0), ("0.000005", 1), ("+Inf", 1)] {
            let line = format!("tracerd_io_stage_seconds_bucket{{{a},stage=\"d2c\",le=\"{le}\"}} {n}\n");
            assert!(text.contains(&line), "missing {line} in\n{text}");
        }
        for (le, n) in [("0.00002", 0), ("0.00005", 1), ("0.0005", 2), ("+Inf", 2)] {
            let line = format!("tracerd_io_stage_seconds_bucket{{{other},stage=\"d2c\",le=\"{le}\"}} {n}\n");
            assert!(text.contains(&line), "missing {line} in\n{text}");
        }
        assert!(text.contains(&format!("tracerd_io_stage_seconds_sum{{{other},stage=\"d2c\"}} 0.00033\n")));
        assert!(text.contains(&format!("tracerd_io_requests_total{{{a}}} 1\n")));
        assert!(text.contains(&format!("tracerd_io_requests_total{{{other}}} 2\n")));
        assert!(
            !text.contains("tracerd_io_requests_total{device=\"lo\\\"op\\\\0\",op=\"write\"}"),
            "no unlabelled series"
        );
        assert!(text.contains("tracerd_cgroup_folded_requests_total{reason=\"top\"} 1\n"));
        assert!(text.contains("tracerd_cgroup_folded_requests_total{reason=\"unnamed\"} 1\n"));
        assert!(text.contains("tracerd_cgroup_labels{state=\"used\"} 1\n"));
    }
}
