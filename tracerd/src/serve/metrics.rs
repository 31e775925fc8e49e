//! The aggregated state as metric families (`exposition` writes them in the scrape's format).
//! Histograms live in HdrHistogram (or the kernel's buckets) and are folded into fixed,
//! log-spaced buckets at scrape time, so each IO is recorded once.

use std::sync::Arc;

use tracer_common::{agg, own};

use crate::{
    build_info,
    kernel::hooks::HookStatus,
    kernel::tracer::ProgramTotals,
    model::aggregate::{Aggregator, HIGHEST_NS, QD_BUCKETS, QueueDepths, StageHist, bucket_middle},
    model::cgroups::CgroupSeries,
    model::layers::Phase,
    model::op::Op,
    model::recorder::{Buckets, SeriesFrame},
    model::stage::Stage,
    serve::exemplars::Exemplars,
    serve::exposition::{
        BUCKETS_S, Family, Format, Hist, Kind, Labels, Native, Sample, Value, protobuf, text,
    },
    serve::process::ProcessStats,
};

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
    /// Its (cgroup, device, op) series in use, and how many it has (labels on).
    pub kernel_cgroup_series: Option<(usize, usize)>,
    /// Requests the kernel counted in its series (they crossed the ring buffer as no record).
    pub kernel_requests: u64,
    /// The flight recorder's size (the agent's; zero elsewhere).
    pub recorder: RecorderGauges,
    /// Per-cgroup series (config `[cgroups] label`): then the stage and request metrics carry
    /// a `cgroup` label, and a device's series add up over it.
    pub cgroups: Option<CgroupSeries>,
    /// Recent IOs per stage bucket, for OpenMetrics and protobuf scrapes.
    pub exemplars: Exemplars,
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
    /// The store on disk, when the agent keeps one.
    pub store: Option<StoreGauges>,
}

/// The recorder's store on disk, as /metrics shows it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StoreGauges {
    pub bytes: u64,
    pub max_bytes: u64,
    pub frames_not_stored: u64,
    pub slow_lists_not_stored: u64,
    pub write_errors: u64,
    pub damaged_records: u64,
    pub torn_tails: u64,
}

pub use crate::serve::exposition::escape;

/// A histogram family under construction.
fn family(name: &'static str, kind: Kind, help: &'static str) -> Family {
    Family { name, help, kind, samples: Vec::new() }
}

fn labels<const N: usize>(pairs: [(&'static str, &str); N]) -> Labels {
    pairs.into_iter().map(|(k, v)| (k, v.to_owned())).collect()
}

fn number(f: &mut Family, labels: Labels, v: f64) {
    f.samples.push(Sample { labels, value: Value::Number(v) });
}

/// A daemon histogram: its HdrHistogram folded into the classic buckets, and with `native`,
/// its recorded values into exponential ones.
fn stage_hist(h: &StageHist, native: bool) -> Hist {
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
fn buckets_hist(b: &Buckets, native: bool) -> Hist {
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

fn histogram(f: &mut Family, labels: Labels, h: Hist) {
    f.samples.push(Sample { labels, value: Value::Histogram(Box::new(h)) });
}

/// `/metrics` in the format a scrape asked for: (content type, body).
pub fn render_as(state: &State, format: Format) -> (&'static str, Vec<u8>) {
    let families = families(state, format);
    let body = match format {
        Format::Text => text(&families, false).into_bytes(),
        Format::OpenMetrics => text(&families, true).into_bytes(),
        Format::Protobuf => protobuf(&families),
    };
    (format.content_type(), body)
}

/// The classic text exposition.
pub fn render(state: &State) -> String {
    text(&families(state, Format::Text), false)
}

/// Every metric family; exemplars only where the format carries them, native buckets only for
/// protobuf.
pub fn families(state: &State, format: Format) -> Vec<Family> {
    let native = format == Format::Protobuf;
    let with_exemplars = format != Format::Text;
    let mut out = Vec::with_capacity(32);
    let series = state.agg.sorted();
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

    let mut f = family(
        "tracerd_io_layer_seconds",
        Kind::Histogram,
        "Stacked devices (md, dm): each IO's Q2C split against a lower device into phase=layer \
         (before the first lower IO), lower (in the lower device) and completion (after the last).",
    );
    for (device, op, stats) in &series {
        for (lower, layer) in &stats.layers {
            for (phase, h) in Phase::ALL.iter().zip(&layer.phases) {
                let l = labels([
                    ("device", device),
                    ("lower", name(*lower)),
                    ("op", op.as_str()),
                    ("phase", phase.as_str()),
                ]);
                histogram(&mut f, l, stage_hist(h, native));
            }
        }
    }
    out.push(f);

    let mut f = family(
        "tracerd_io_submit_seconds",
        Kind::Histogram,
        "Stacked devices: time inside the driver's submit function (md_submit_bio, dm_submit_bio) \
         and the md personality's make_request.",
    );
    for (device, op, stats) in &series {
        for (function, h) in [("submit_bio", &stats.submit), ("personality", &stats.personality)] {
            if let Some(h) = h {
                let l = labels([("device", device), ("op", op.as_str()), ("function", function)]);
                histogram(&mut f, l, stage_hist(h, native));
            }
        }
    }
    out.push(f);

    let mut f = family(
        "tracerd_io_qos_wait_seconds",
        Kind::Histogram,
        "Time IOs waited in rq-qos policies (wbt, iolatency, iocost) between Q and G, part of \
         their Q2G; with config rq_qos = true.",
    );
    for (device, op, stats) in &series {
        for (&policies, h) in &stats.qos {
            let policy = crate::model::stage::qos_name(policies);
            let l = labels([("device", device), ("op", op.as_str()), ("policy", &policy)]);
            histogram(&mut f, l, stage_hist(h, native));
        }
    }
    out.push(f);

    let mut f = family(
        "tracerd_io_queue_depth",
        Kind::Histogram,
        "Requests in flight on the disk when each request was issued (this one included).",
    );
    for (device, op, stats) in &series {
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
                for (device, op, stats) in &series {
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
    let mut f = family(
        "tracerd_io_unlinked_total",
        Kind::Counter,
        "IOs of a device below a traced stacked device that named no upper IO, by kind: the \
         stacked driver's own IO where the kernel says what it is (parity, preread, resync, \
         superblock), else unstated (metadata, zeroing, or a link the kernel does not state).",
    );
    for (device, op, stats) in series.iter().filter(|(_, _, s)| s.unlinked != 0) {
        for (k, &n) in stats.own.iter().enumerate().filter(|(_, n)| **n != 0) {
            let l = labels([("device", device), ("op", op.as_str()), ("kind", own::name(k as u8))]);
            number(&mut f, l, n as f64);
        }
    }
    out.push(f);
    if let Some(c) = &state.cgroups {
        let mut f = family(
            "tracerd_cgroup_folded_requests_total",
            Kind::Counter,
            "IOs counted under the cgroup label other, by reason: top (past config cgroups.top), \
             excluded (cgroups.include/exclude), unnamed (the cgroup went before it was named).",
        );
        for (reason, n) in c.folded.reasons() {
            number(&mut f, labels([("reason", reason)]), n as f64);
        }
        out.push(f);
        let mut f = family(
            "tracerd_cgroup_labels",
            Kind::Gauge,
            "Cgroup labels with series of their own (state=used), and the bound (state=limit, config \
             cgroups.top).",
        );
        number(&mut f, labels([("state", "used")]), c.labels() as f64);
        number(&mut f, labels([("state", "limit")]), c.limits.top as f64);
        out.push(f);
        let mut f = family(
            "tracerd_cgroup_series_ended_total",
            Kind::Counter,
            "Cgroup labels whose series ended: expired (no IO for cgroups.expire_after_s) or displaced \
             (a busier cgroup took the place).",
        );
        number(&mut f, labels([("reason", "expired")]), c.expired as f64);
        number(&mut f, labels([("reason", "displaced")]), c.displaced as f64);
        out.push(f);
        let mut f = family(
            "tracerd_cgroup_names",
            Kind::Gauge,
            "Cgroup ids tracerd holds a name for (forgotten after cgroups.expire_after_s unused).",
        );
        number(&mut f, vec![], c.names_cached as f64);
        out.push(f);
    }

    let mut f = family(
        "tracerd_events_lost_total",
        Kind::Counter,
        "Events tracerd could not account for, by reason.",
    );
    for (reason, n) in state.agg.lost.reasons() {
        number(&mut f, labels([("reason", reason)]), n as f64);
    }
    out.push(f);
    let single = |out: &mut Vec<Family>, name: &'static str, kind: Kind, help: &'static str, v: f64| {
        let mut f = family(name, kind, help);
        number(&mut f, vec![], v);
        out.push(f);
    };
    single(
        &mut out,
        "tracerd_series_expired_total",
        Kind::Counter,
        "Devices whose series were dropped after the device vanished (config series.expire_after_s).",
        state.agg.expired_devices as f64,
    );
    let mut f = family(
        "tracerd_in_flight_entries",
        Kind::Gauge,
        "Entries in the kernel's in-flight tables (16384 slots each), sampled every 10 s.",
    );
    number(&mut f, labels([("table", "bios")]), state.in_flight.0 as f64);
    number(&mut f, labels([("table", "requests")]), state.in_flight.1 as f64);
    out.push(f);
    let mut f = family(
        "tracerd_kernel_series",
        Kind::Gauge,
        "Devices whose reads and writes the kernel aggregates itself (state=used), of how many \
         it can (state=capacity); other IO crosses the ring buffer as records.",
    );
    number(&mut f, labels([("state", "used")]), state.kernel_series.0 as f64);
    number(&mut f, labels([("state", "capacity")]), state.kernel_series.1 as f64);
    out.push(f);
    if let Some((used, capacity)) = state.kernel_cgroup_series {
        let mut f = family(
            "tracerd_kernel_cgroup_series",
            Kind::Gauge,
            "(cgroup, device, op) series the kernel aggregates itself (state=used), of how many it \
             can (state=capacity); IO of other cgroups crosses the ring buffer as records.",
        );
        number(&mut f, labels([("state", "used")]), used as f64);
        number(&mut f, labels([("state", "capacity")]), capacity as f64);
        out.push(f);
    }
    if !state.aggregation.is_empty() {
        let mut f = family("tracerd_aggregation_info", Kind::Gauge, "Where reads and writes are aggregated.");
        number(&mut f, labels([("mode", state.aggregation)]), 1.0);
        out.push(f);
    }
    if state.recorder.max_bytes != 0 {
        let r = &state.recorder;
        let mut f = family(
            "tracerd_recorder_bytes",
            Kind::Gauge,
            "Memory of the flight recorder's frames (state=used), and its bound (state=limit, config \
             recorder.max_bytes).",
        );
        number(&mut f, labels([("state", "used")]), r.bytes as f64);
        number(&mut f, labels([("state", "limit")]), r.max_bytes as f64);
        out.push(f);
        single(
            &mut out,
            "tracerd_recorder_frames",
            Kind::Gauge,
            "Frames the flight recorder keeps.",
            r.frames as f64,
        );
        single(
            &mut out,
            "tracerd_recorder_span_seconds",
            Kind::Gauge,
            "How far back the flight recorder reaches now (at most recorder.retention_s).",
            r.span_s,
        );
        single(
            &mut out,
            "tracerd_recorder_frames_dropped_total",
            Kind::Counter,
            "Frames dropped before the end of the retention because the recorder reached its byte bound.",
            r.dropped_for_memory as f64,
        );
        if let Some(st) = &r.store {
            let mut f = family(
                "tracerd_recorder_store_bytes",
                Kind::Gauge,
                "Disk taken by the recorder's store (state=used), and its bound (state=limit, config \
                 store.max_bytes).",
            );
            number(&mut f, labels([("state", "used")]), st.bytes as f64);
            number(&mut f, labels([("state", "limit")]), st.max_bytes as f64);
            out.push(f);
            for (name, help, v) in [
                (
                    "tracerd_recorder_store_frames_not_stored_total",
                    "Frames kept in memory but not written to the store, because a write failed (a full disk).",
                    st.frames_not_stored,
                ),
                (
                    "tracerd_recorder_store_slow_lists_not_stored_total",
                    "Lists of a device's slowest IOs of a minute kept in memory but not written to the store, because a write failed.",
                    st.slow_lists_not_stored,
                ),
                (
                    "tracerd_recorder_store_write_errors_total",
                    "Writes and syncs to the recorder's store that failed.",
                    st.write_errors,
                ),
                (
                    "tracerd_recorder_store_damaged_records_total",
                    "Records of the store that did not check (CRC, length) and were skipped.",
                    st.damaged_records,
                ),
                (
                    "tracerd_recorder_store_torn_tails_total",
                    "Unfinished records (an agent stopped mid-write) cut off when the store was opened.",
                    st.torn_tails,
                ),
            ] {
                single(&mut out, name, Kind::Counter, help, v as f64);
            }
        }
    }
    single(
        &mut out,
        "tracerd_records_total",
        Kind::Counter,
        "Records read from the kernel ring buffer.",
        state.records as f64,
    );
    single(
        &mut out,
        "tracerd_kernel_requests_total",
        Kind::Counter,
        "Requests counted in the kernel's series, which crossed the ring buffer as no record.",
        state.kernel_requests as f64,
    );
    single(
        &mut out,
        "tracerd_traced_devices",
        Kind::Gauge,
        "Block devices (disks and partitions) traced in the kernel.",
        state.traced_devices as f64,
    );
    let mut f =
        family("tracerd_hook_attached", Kind::Gauge, "1 for each block-layer hook attached, with how.");
    for h in state.hooks.iter().filter(|h| h.attached()) {
        number(&mut f, labels([("hook", h.hook), ("attach_type", h.attach_type.unwrap_or_default())]), 1.0);
    }
    out.push(f);
    let mut f = family(
        "tracerd_hook_skipped",
        Kind::Gauge,
        "1 for each block-layer hook not attached, with why (the kernel lacks or refuses it, or config skip_hooks).",
    );
    for h in state.hooks.iter().filter(|h| !h.attached()) {
        number(&mut f, labels([("hook", h.hook), ("reason", h.reason.as_deref().unwrap_or(""))]), 1.0);
    }
    out.push(f);
    single(
        &mut out,
        "tracerd_bpf_run_seconds_total",
        Kind::Counter,
        "Time spent in tracerd's kernel programs; counted only while sysctl kernel.bpf_stats_enabled=1.",
        state.programs.run_ns as f64 / 1e9,
    );
    single(
        &mut out,
        "tracerd_bpf_runs_total",
        Kind::Counter,
        "Runs of tracerd's kernel programs; counted only while sysctl kernel.bpf_stats_enabled=1.",
        state.programs.runs as f64,
    );
    if let Some(p) = ProcessStats::read() {
        single(
            &mut out,
            "process_cpu_seconds_total",
            Kind::Counter,
            "User and system CPU time of tracerd.",
            p.cpu_seconds,
        );
        single(
            &mut out,
            "process_resident_memory_bytes",
            Kind::Gauge,
            "Resident memory of tracerd.",
            p.resident_bytes as f64,
        );
        single(
            &mut out,
            "process_open_fds",
            Kind::Gauge,
            "Open file descriptors of tracerd.",
            p.open_fds as f64,
        );
        single(
            &mut out,
            "process_start_time_seconds",
            Kind::Gauge,
            "Start time of tracerd, seconds since the Unix epoch.",
            p.start_time_seconds,
        );
    }
    let mut f = family(
        "tracerd_build_info",
        Kind::Gauge,
        "tracerd version, commit and eBPF object, and the kernel it runs on.",
    );
    number(
        &mut f,
        labels([
            ("version", build_info::VERSION),
            ("commit", build_info::COMMIT),
            ("ebpf_sha256", build_info::EBPF_SHA256),
            ("kernel", &state.kernel),
        ]),
        1.0,
    );
    out.push(f);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::op::Op;
    use std::collections::BTreeSet;
    use tracer_common::{IoRecord, event, flag, kind};

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

    /// Every family the agent can serve, with its type and the label names its samples carry:
    /// a state with every optional part present (stacked device, recorder, cgroup labels).
    fn served_families() -> std::collections::BTreeMap<&'static str, (&'static str, BTreeSet<&'static str>)> {
        use crate::model::cgroups::LabelForm;
        use crate::model::cgroups::{CgroupLimits, CgroupSeries};
        let mut plain = sample_state();
        let mut r = IoRecord { kind: kind::BIO, submit_ns: 4000, ..Default::default() };
        (r.ts[event::Q], r.ts[event::C]) = (1000, 11_000);
        let split =
            crate::model::layers::LayerSplit { lower: 2, ios: 1, layer_ns: 1, lower_ns: 1, completion_ns: 1 };
        plain.agg.add(1, Op::Read, &r, &[split], |d| format!("dev{d}"));
        // A lower device's IO that named no upper IO, with a queue depth.
        let mut qd =
            IoRecord { kind: kind::REQUEST, queue_depth: 1, flags: flag::UNLINKED, ..Default::default() };
        (qd.ts[event::D], qd.ts[event::C]) = (1, 2);
        plain.agg.add(7, Op::Write, &qd, &[], |_| "lo".into());
        // An IO that waited in io.cost between Q and G.
        let mut waited = IoRecord {
            kind: kind::REQUEST,
            qos: tracer_common::qos::IOCOST,
            qos_ns: 9000,
            ..Default::default()
        };
        (waited.ts[event::Q], waited.ts[event::G], waited.ts[event::D], waited.ts[event::C]) =
            (1, 9500, 9600, 20_000);
        plain.agg.add(7, Op::Read, &waited, &[], |_| "lo".into());
        plain.aggregation = "kernel";
        plain.recorder = RecorderGauges {
            bytes: 1,
            max_bytes: 2,
            frames: 1,
            span_s: 1.0,
            dropped_for_memory: 0,
            store: Some(StoreGauges::default()),
        };
        let mut with_cgroups = sample_state();
        let mut c = CgroupSeries::new(CgroupLimits { label: LabelForm::Path, ..Default::default() });
        let mut rq = IoRecord { kind: kind::REQUEST, bytes: 4096, ..Default::default() };
        (rq.ts[event::D], rq.ts[event::C]) = (1000, 2000);
        c.add(7, Op::Write, &rq, Ok("/a"), std::time::Instant::now());
        with_cgroups.cgroups = Some(c);
        with_cgroups.kernel_cgroup_series = Some((1, 384));
        let mut out = std::collections::BTreeMap::new();
        for state in [plain, with_cgroups] {
            for f in families(&state, Format::Text) {
                let kind = match f.kind {
                    Kind::Counter => "counter",
                    Kind::Gauge => "gauge",
                    Kind::Histogram => "histogram",
                };
                let entry = out.entry(f.name).or_insert((kind, BTreeSet::new()));
                entry.1.extend(f.samples.iter().flat_map(|s| s.labels.iter().map(|(k, _)| *k)));
            }
        }
        out
    }

    /// docs/reference/metrics.md, its main table: name -> (type, labels, optional labels).
    fn documented_metrics() -> Vec<(String, String, BTreeSet<String>, BTreeSet<String>)> {
        let page = include_str!("../../../docs/reference/metrics.md");
        let section = page.split("\n## Metrics\n").nth(1).expect("a Metrics section");
        let section = section.split("\n## ").next().unwrap_or_default();
        let ticked =
            |s: &str| -> BTreeSet<String> { s.split('`').skip(1).step_by(2).map(str::to_owned).collect() };
        section
            .lines()
            .filter(|l| l.starts_with("| `"))
            .map(|l| {
                let cells: Vec<&str> = l.split(" | ").collect();
                let name = cells[0].trim_start_matches("| ").trim_matches('`').to_owned();
                let optional: BTreeSet<String> = cells[2]
                    .split('(')
                    .skip(1)
                    .flat_map(|p| ticked(p.split(')').next().unwrap_or("")))
                    .collect();
                (name, cells[1].to_owned(), ticked(cells[2]), optional)
            })
            .collect()
    }

    #[test]
    fn metrics_reference_lists_every_family_the_agent_serves() {
        let served = served_families();
        let documented = documented_metrics();
        let fix = "fix docs/reference/metrics.md (or the code)";
        for (name, (kind, labels)) in &served {
            let Some((_, doc_kind, doc_labels, _)) = documented.iter().find(|d| d.0 == *name) else {
                panic!("{name} is served but not in the metrics reference: {fix}");
            };
            assert_eq!(doc_kind, kind, "{name}: type; {fix}");
            let labels: BTreeSet<String> = labels.iter().map(|l| l.to_string()).collect();
            assert_eq!(doc_labels, &labels, "{name}: labels; {fix}");
        }
        for (name, ..) in &documented {
            assert!(
                served.contains_key(name.as_str()),
                "{name} is in the metrics reference but not served: {fix}"
            );
        }
        assert_eq!(documented.len(), served.len(), "a metric listed twice in the reference");
        // A label in parentheses is optional: the plain state serves the family without it.
        let plain: Vec<Family> = families(&sample_state(), Format::Text);
        for (name, _, labels, optional) in &documented {
            let Some(f) = plain.iter().find(|f| f.name == name.as_str()) else { continue };
            for s in &f.samples {
                let have: BTreeSet<String> = s.labels.iter().map(|(k, _)| k.to_string()).collect();
                let required: BTreeSet<String> = labels.difference(optional).cloned().collect();
                assert_eq!(have, required, "{name}: which labels are optional; {fix}");
            }
        }
    }

    #[test]
    fn metrics_reference_lists_every_lost_reason() {
        let page = include_str!("../../../docs/reference/metrics.md");
        let section = page.split("\n## Lost events\n").nth(1).expect("a Lost events section");
        let section = section.split("\n## ").next().unwrap_or_default();
        let documented: BTreeSet<&str> = section
            .lines()
            .filter(|l| l.starts_with("| `"))
            .flat_map(|l| l.split(" | ").next().unwrap_or("").split('`').skip(1).step_by(2))
            .collect();
        let reasons: BTreeSet<&str> =
            crate::model::aggregate::Lost::default().reasons().iter().map(|(r, _)| *r).collect();
        assert_eq!(
            documented, reasons,
            "docs/reference/metrics.md, Lost events: the reasons the code counts"
        );
    }

    #[test]
    fn label_escaping() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
