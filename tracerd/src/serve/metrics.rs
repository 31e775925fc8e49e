//! Prometheus text exposition of the aggregated state. Histograms live in HdrHistogram and are
//! folded into fixed, log-spaced buckets at scrape time, so each IO is recorded once.

use std::fmt::Write;

use tracer_common::agg;

use crate::{
    kernel::hooks::HookStatus,
    kernel::tracer::ProgramTotals,
    model::aggregate::{Aggregator, QueueDepths, StageHist},
    model::cgroups::CgroupSeries,
    model::layers::Phase,
    model::recorder::{Buckets, SeriesFrame},
    model::stage::Stage,
    serve::process::ProcessStats,
};

/// Bucket upper bounds (seconds): 1-2-5 steps from 1 µs to 50 s, then 60 s (the range top).
pub const BUCKETS_S: [f64; 25] = [
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5,
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 60.0,
];

/// A per-series counter: name, help, and how to read it.
type Counter = (&'static str, &'static str, fn(&crate::model::aggregate::OpStats) -> u64);

/// What `/metrics` shows: the aggregation plus tracerd's own health.
#[derive(Debug, Default)]
pub struct State {
    pub agg: Aggregator,
    pub hooks: Vec<HookStatus>,
    pub kernel: String,
    pub traced_devices: usize,
    /// Records read from the ring buffer (all devices, before filtering).
    pub records: u64,
    /// The kernel's counters of tracerd's programs.
    pub programs: ProgramTotals,
    /// Busy entries of the kernel's in-flight tables (bios, requests), sampled periodically.
    pub in_flight: (u64, u64),
    /// Where reads and writes are aggregated (`run --aggregation`).
    pub aggregation: &'static str,
    /// Devices with a series of the in-kernel aggregation, and how many it has.
    pub kernel_series: (usize, usize),
    /// The flight recorder's size (the agent's; zero elsewhere).
    pub recorder: RecorderGauges,
    /// Per-cgroup series (config `[cgroups] label`): then the stage and request metrics carry
    /// a `cgroup` label, and a device's series add up over it.
    pub cgroups: Option<CgroupSeries>,
}

/// The flight recorder, as /metrics shows it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RecorderGauges {
    pub bytes: usize,
    pub max_bytes: usize,
    pub frames: usize,
    /// Seconds the kept frames cover.
    pub span_s: f64,
    pub dropped_for_memory: u64,
}

/// Escapes a label value (backslash, double quote, newline).
pub fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// One histogram series: buckets folded from the HdrHistogram, then sum and count.
fn histogram(out: &mut String, name: &str, labels: &str, h: &StageHist) {
    let mut per_bucket = [0u64; BUCKETS_S.len()];
    let mut overflow = 0;
    for v in h.hist.iter_recorded() {
        let secs = v.value_iterated_to() as f64 / 1e9;
        match BUCKETS_S.iter().position(|&le| secs <= le) {
            Some(i) => per_bucket[i] += v.count_at_value(),
            None => overflow += v.count_at_value(),
        }
    }
    let mut cumulative = 0;
    for (le, n) in BUCKETS_S.iter().zip(per_bucket) {
        cumulative += n;
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
    }
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", cumulative + overflow);
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", h.sum_ns as f64 / 1e9);
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count());
}

/// One histogram series from the kernel's buckets: each Prometheus bound is one of theirs,
/// so the cumulative counts are exact.
fn buckets_histogram(out: &mut String, name: &str, labels: &str, b: &Buckets) {
    let mut cumulative = 0;
    let mut k = 0;
    for le in BUCKETS_S {
        let le_ns = (le * 1e9).round() as u64;
        while k < agg::BOUNDS_NS.len() && agg::BOUNDS_NS[k] <= le_ns {
            cumulative += b.counts[k];
            k += 1;
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
    }
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", b.count());
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", b.sum_ns as f64 / 1e9);
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", b.count());
}

pub fn render(state: &State) -> String {
    let mut out = String::with_capacity(64 * 1024);
    let series = state.agg.sorted();
    let cgroups = state.cgroups.as_ref().map(|c| c.sorted(|d| state.agg.name(d)));

    header(
        &mut out,
        "tracerd_io_stage_seconds",
        "histogram",
        "Time IOs spent in each block-layer stage (blktrace intervals).",
    );
    match &cgroups {
        None => {
            for (device, op, stats) in &series {
                for stage in Stage::ALL {
                    let Some(h) = stats.stage(stage) else { continue };
                    let labels = format!(
                        "device=\"{}\",op=\"{}\",stage=\"{}\"",
                        escape(device),
                        op.as_str(),
                        stage.as_str()
                    );
                    histogram(&mut out, "tracerd_io_stage_seconds", &labels, h);
                }
            }
        }
        Some(cgroups) => {
            for (device, op, cgroup, s) in cgroups {
                for stage in Stage::ALL {
                    let Some(b) = &s.stages[stage.index()] else { continue };
                    let labels = format!(
                        "device=\"{}\",op=\"{}\",cgroup=\"{}\",stage=\"{}\"",
                        escape(device),
                        op.as_str(),
                        escape(cgroup),
                        stage.as_str()
                    );
                    buckets_histogram(&mut out, "tracerd_io_stage_seconds", &labels, b);
                }
            }
        }
    }

    header(
        &mut out,
        "tracerd_io_layer_seconds",
        "histogram",
        "Stacked devices (md, dm): each IO's Q2C split against a lower device into phase=layer \
         (before the first lower IO), lower (in the lower device) and completion (after the last).",
    );
    for (device, op, stats) in &series {
        for (lower, layer) in &stats.layers {
            for (phase, h) in Phase::ALL.iter().zip(&layer.phases) {
                let labels = format!(
                    "device=\"{}\",lower=\"{}\",op=\"{}\",phase=\"{}\"",
                    escape(device),
                    escape(state.agg.name(*lower)),
                    op.as_str(),
                    phase.as_str()
                );
                histogram(&mut out, "tracerd_io_layer_seconds", &labels, h);
            }
        }
    }

    header(
        &mut out,
        "tracerd_io_submit_seconds",
        "histogram",
        "Stacked devices: time inside the driver's submit function (md_submit_bio, dm_submit_bio) \
         and the md personality's make_request.",
    );
    for (device, op, stats) in &series {
        for (function, h) in [("submit_bio", &stats.submit), ("personality", &stats.personality)] {
            if let Some(h) = h {
                let labels =
                    format!("device=\"{}\",op=\"{}\",function=\"{function}\"", escape(device), op.as_str());
                histogram(&mut out, "tracerd_io_submit_seconds", &labels, h);
            }
        }
    }

    header(
        &mut out,
        "tracerd_io_queue_depth",
        "histogram",
        "Requests in flight on the disk when each request was issued (this one included).",
    );
    for (device, op, stats) in &series {
        let q = &stats.queue_depth;
        if q.count == 0 {
            continue;
        }
        let labels = format!("device=\"{}\",op=\"{}\"", escape(device), op.as_str());
        let mut cumulative = 0;
        for (k, n) in q.buckets.iter().enumerate() {
            cumulative += n;
            let le = QueueDepths::le(k).map_or("+Inf".to_string(), |le| le.to_string());
            let _ = writeln!(out, "tracerd_io_queue_depth_bucket{{{labels},le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "tracerd_io_queue_depth_sum{{{labels}}} {}", q.sum);
        let _ = writeln!(out, "tracerd_io_queue_depth_count{{{labels}}} {}", q.count);
    }

    let counters: [Counter; 4] = [
        ("tracerd_io_requests_total", "Completed requests.", |s| s.requests),
        ("tracerd_io_bytes_total", "Bytes transferred by completed requests.", |s| s.bytes),
        ("tracerd_io_merged_bios_total", "Bios merged into an existing request.", |s| s.merged_bios),
        ("tracerd_io_errors_total", "Requests completed with an error status.", |s| s.errors),
    ];
    // The same counters, of a cgroup's series.
    let cgroup_values: [fn(&SeriesFrame) -> u64; 4] =
        [|s| s.requests, |s| s.bytes, |s| s.merged_bios, |s| s.errors];
    for ((name, help, value), cgroup_value) in counters.into_iter().zip(cgroup_values) {
        header(&mut out, name, "counter", help);
        match &cgroups {
            None => {
                for (device, op, stats) in &series {
                    let _ = writeln!(
                        out,
                        "{name}{{device=\"{}\",op=\"{}\"}} {}",
                        escape(device),
                        op.as_str(),
                        value(stats)
                    );
                }
            }
            Some(cgroups) => {
                for (device, op, cgroup, s) in cgroups {
                    let _ = writeln!(
                        out,
                        "{name}{{device=\"{}\",op=\"{}\",cgroup=\"{}\"}} {}",
                        escape(device),
                        op.as_str(),
                        escape(cgroup),
                        cgroup_value(s)
                    );
                }
            }
        }
    }
    if let Some(c) = &state.cgroups {
        header(
            &mut out,
            "tracerd_cgroup_folded_requests_total",
            "counter",
            "IOs counted under cgroup=\"other\", by reason: top (past config cgroups.top), excluded \
             (cgroups.include/exclude), unnamed (the cgroup went before it was named).",
        );
        for (reason, n) in c.folded.reasons() {
            let _ = writeln!(out, "tracerd_cgroup_folded_requests_total{{reason=\"{reason}\"}} {n}");
        }
        header(
            &mut out,
            "tracerd_cgroup_labels",
            "gauge",
            "Cgroup labels with series of their own (state=used), and the bound (state=limit, config \
             cgroups.top).",
        );
        let _ = writeln!(out, "tracerd_cgroup_labels{{state=\"used\"}} {}", c.labels());
        let _ = writeln!(out, "tracerd_cgroup_labels{{state=\"limit\"}} {}", c.limits.top);
        header(
            &mut out,
            "tracerd_cgroup_series_ended_total",
            "counter",
            "Cgroup labels whose series ended: expired (no IO for cgroups.expire_after_s) or displaced \
             (a busier cgroup took the place).",
        );
        let _ = writeln!(out, "tracerd_cgroup_series_ended_total{{reason=\"expired\"}} {}", c.expired);
        let _ = writeln!(out, "tracerd_cgroup_series_ended_total{{reason=\"displaced\"}} {}", c.displaced);
    }

    header(
        &mut out,
        "tracerd_events_lost_total",
        "counter",
        "Events tracerd could not account for, by reason.",
    );
    for (reason, n) in state.agg.lost.reasons() {
        let _ = writeln!(out, "tracerd_events_lost_total{{reason=\"{reason}\"}} {n}");
    }

    header(
        &mut out,
        "tracerd_series_expired_total",
        "counter",
        "Devices whose series were dropped after the device vanished (config series.expire_after_s).",
    );
    let _ = writeln!(out, "tracerd_series_expired_total {}", state.agg.expired_devices);
    header(
        &mut out,
        "tracerd_in_flight_entries",
        "gauge",
        "Entries in the kernel's in-flight tables (16384 slots each), sampled every 10 s.",
    );
    let _ = writeln!(out, "tracerd_in_flight_entries{{table=\"bios\"}} {}", state.in_flight.0);
    let _ = writeln!(out, "tracerd_in_flight_entries{{table=\"requests\"}} {}", state.in_flight.1);
    header(
        &mut out,
        "tracerd_kernel_series",
        "gauge",
        "Devices whose reads and writes the kernel aggregates itself (state=used), of how many \
         it can (state=capacity); other IO crosses the ring buffer as records.",
    );
    let _ = writeln!(out, "tracerd_kernel_series{{state=\"used\"}} {}", state.kernel_series.0);
    let _ = writeln!(out, "tracerd_kernel_series{{state=\"capacity\"}} {}", state.kernel_series.1);
    if !state.aggregation.is_empty() {
        header(&mut out, "tracerd_aggregation_info", "gauge", "Where reads and writes are aggregated.");
        let _ = writeln!(out, "tracerd_aggregation_info{{mode=\"{}\"}} 1", state.aggregation);
    }
    if state.recorder.max_bytes != 0 {
        let r = &state.recorder;
        header(
            &mut out,
            "tracerd_recorder_bytes",
            "gauge",
            "Memory of the flight recorder's frames (state=used), and its bound (state=limit, config \
             recorder.max_bytes).",
        );
        let _ = writeln!(out, "tracerd_recorder_bytes{{state=\"used\"}} {}", r.bytes);
        let _ = writeln!(out, "tracerd_recorder_bytes{{state=\"limit\"}} {}", r.max_bytes);
        header(&mut out, "tracerd_recorder_frames", "gauge", "Frames the flight recorder keeps.");
        let _ = writeln!(out, "tracerd_recorder_frames {}", r.frames);
        header(
            &mut out,
            "tracerd_recorder_span_seconds",
            "gauge",
            "How far back the flight recorder reaches now (at most recorder.retention_s).",
        );
        let _ = writeln!(out, "tracerd_recorder_span_seconds {}", r.span_s);
        header(
            &mut out,
            "tracerd_recorder_frames_dropped_total",
            "counter",
            "Frames dropped before the end of the retention because the recorder reached its byte bound.",
        );
        let _ = writeln!(out, "tracerd_recorder_frames_dropped_total {}", r.dropped_for_memory);
    }
    header(&mut out, "tracerd_records_total", "counter", "Records read from the kernel ring buffer.");
    let _ = writeln!(out, "tracerd_records_total {}", state.records);
    header(
        &mut out,
        "tracerd_traced_devices",
        "gauge",
        "Block devices (disks and partitions) traced in the kernel.",
    );
    let _ = writeln!(out, "tracerd_traced_devices {}", state.traced_devices);
    header(&mut out, "tracerd_hook_attached", "gauge", "1 for each block-layer hook attached, with how.");
    for h in state.hooks.iter().filter(|h| h.attached()) {
        let _ = writeln!(
            out,
            "tracerd_hook_attached{{hook=\"{}\",attach_type=\"{}\"}} 1",
            h.hook,
            h.attach_type.unwrap_or_default()
        );
    }
    header(
        &mut out,
        "tracerd_hook_skipped",
        "gauge",
        "1 for each block-layer hook that could not be attached, with why.",
    );
    for h in state.hooks.iter().filter(|h| !h.attached()) {
        let reason = escape(h.reason.as_deref().unwrap_or(""));
        let _ = writeln!(out, "tracerd_hook_skipped{{hook=\"{}\",reason=\"{reason}\"}} 1", h.hook);
    }
    header(
        &mut out,
        "tracerd_bpf_run_seconds_total",
        "counter",
        "Time spent in tracerd's kernel programs; counted only while sysctl kernel.bpf_stats_enabled=1.",
    );
    let _ = writeln!(out, "tracerd_bpf_run_seconds_total {}", state.programs.run_ns as f64 / 1e9);
    header(
        &mut out,
        "tracerd_bpf_runs_total",
        "counter",
        "Runs of tracerd's kernel programs; counted only while sysctl kernel.bpf_stats_enabled=1.",
    );
    let _ = writeln!(out, "tracerd_bpf_runs_total {}", state.programs.runs);
    if let Some(p) = ProcessStats::read() {
        let process: [(&str, &str, &str, f64); 4] = [
            ("process_cpu_seconds_total", "counter", "User and system CPU time of tracerd.", p.cpu_seconds),
            (
                "process_resident_memory_bytes",
                "gauge",
                "Resident memory of tracerd.",
                p.resident_bytes as f64,
            ),
            ("process_open_fds", "gauge", "Open file descriptors of tracerd.", p.open_fds as f64),
            (
                "process_start_time_seconds",
                "gauge",
                "Start time of tracerd, seconds since the Unix epoch.",
                p.start_time_seconds,
            ),
        ];
        for (name, kind, help, value) in process {
            header(&mut out, name, kind, help);
            let _ = writeln!(out, "{name} {value}");
        }
    }
    header(&mut out, "tracerd_build_info", "gauge", "tracerd version and the kernel it runs on.");
    let _ = writeln!(
        out,
        "tracerd_build_info{{version=\"{}\",kernel=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION"),
        escape(&state.kernel)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::op::Op;
    use tracer_common::{IoRecord, event, kind};

    fn sample_state() -> State {
        let mut agg = Aggregator::new(false);
        for d2c_us in [3u64, 30, 300] {
            let mut r = IoRecord { kind: kind::REQUEST, bytes: 4096, ..Default::default() };
            (r.ts[event::D], r.ts[event::C]) = (1000, 1000 + d2c_us * 1000);
            agg.add(7, Op::Write, &r, &[], |_| "lo\"op\\0".into());
        }
        agg.lost.kernel[0] = 2;
        let hooks = vec![
            HookStatus { hook: "block_rq_issue", attach_type: Some("tp_btf"), program: None, reason: None },
            HookStatus {
                hook: "block_split",
                attach_type: None,
                program: None,
                reason: Some("not in this kernel".into()),
            },
        ];
        State { agg, hooks, kernel: "6.18".into(), traced_devices: 1, records: 3, ..Default::default() }
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_match_count() {
        let text = render(&sample_state());
        let labels = "device=\"lo\\\"op\\\\0\",op=\"write\",stage=\"d2c\"";
        for (le, n) in [("0.000002", 0), ("0.000005", 1), ("0.00005", 2), ("0.0005", 3), ("+Inf", 3)] {
            let line = format!("tracerd_io_stage_seconds_bucket{{{labels},le=\"{le}\"}} {n}\n");
            assert!(text.contains(&line), "missing {line} in\n{text}");
        }
        assert!(text.contains(&format!("tracerd_io_stage_seconds_count{{{labels}}} 3\n")));
        assert!(text.contains(&format!("tracerd_io_stage_seconds_sum{{{labels}}} 0.000333\n")));
        assert!(text.contains("tracerd_io_requests_total{device=\"lo\\\"op\\\\0\",op=\"write\"} 3\n"));
        assert!(text.contains("tracerd_io_bytes_total{device=\"lo\\\"op\\\\0\",op=\"write\"} 12288\n"));
        assert!(text.contains("tracerd_events_lost_total{reason=\"ringbuf_full\"} 2\n"));
        assert!(text.contains("tracerd_hook_attached{hook=\"block_rq_issue\",attach_type=\"tp_btf\"} 1\n"));
        assert!(
            text.contains("tracerd_hook_skipped{hook=\"block_split\",reason=\"not in this kernel\"} 1\n")
        );
    }

    #[test]
    fn every_sample_line_belongs_to_a_declared_family() {
        let text = render(&sample_state());
        let families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| l.split(' ').next().unwrap())
            .collect();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            assert!(
                families.iter().any(|f| name == *f
                    || name.strip_prefix(f).is_some_and(|s| ["_bucket", "_sum", "_count"].contains(&s))),
                "{name} undeclared"
            );
            // Ours, or the process_* family every Prometheus client exports.
            assert!(name.starts_with("tracerd_") || name.starts_with("process_"), "{name}");
        }
    }

    #[test]
    fn layer_and_submit_histograms() {
        let mut agg = Aggregator::new(false);
        let mut r = IoRecord { kind: kind::BIO, submit_ns: 4000, ..Default::default() };
        (r.ts[event::Q], r.ts[event::C]) = (1000, 11_000);
        let split = crate::model::layers::LayerSplit {
            lower: 2,
            ios: 1,
            layer_ns: 1000,
            lower_ns: 8000,
            completion_ns: 1000,
        };
        agg.add(1, Op::Read, &r, &[split], |d| if d == 1 { "dm-0".into() } else { "ram2".into() });
        let text = render(&State { agg, ..Default::default() });
        for phase in ["layer", "lower", "completion"] {
            let line = format!(
                "tracerd_io_layer_seconds_count{{device=\"dm-0\",lower=\"ram2\",op=\"read\",phase=\"{phase}\"}} 1\n"
            );
            assert!(text.contains(&line), "{line} missing in\n{text}");
        }
        assert!(text.contains("tracerd_io_layer_seconds_sum{device=\"dm-0\",lower=\"ram2\",op=\"read\",phase=\"lower\"} 0.000008\n"));
        assert!(text.contains(
            "tracerd_io_submit_seconds_count{device=\"dm-0\",op=\"read\",function=\"submit_bio\"} 1\n"
        ));
        assert!(
            text.contains("tracerd_io_stage_seconds_count{device=\"dm-0\",op=\"read\",stage=\"q2c\"} 1\n")
        );
    }

    #[test]
    fn with_cgroups_the_stage_and_request_metrics_carry_the_label_and_add_up() {
        use crate::kernel::cgroupfs::LabelForm;
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

    #[test]
    fn label_escaping() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
