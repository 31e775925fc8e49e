//! The aggregated state as metric families (`exposition` writes them in the scrape's format).
//! Histograms live in HdrHistogram (or the kernel's buckets) and are folded into fixed,
//! log-spaced buckets at scrape time, so each IO is recorded once.
//!
//! This file holds what `/metrics` shows (`State`) and the order of its families; each group
//! of families is built by a file under `metrics/`.

mod cgroups;
mod family;
mod health;
mod hist;
mod layers;
mod process;
mod recorder;
mod series;
mod waits;

use crate::{
    kernel::hooks::HookStatus,
    kernel::tracer::ProgramTotals,
    model::aggregate::Aggregator,
    model::cgroups::CgroupSeries,
    serve::exemplars::Exemplars,
    serve::exposition::{Family, Format, protobuf, text},
};

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
    /// Whether waits inside IO phases are counted by cause (config `causes`): the series'
    /// `waits`.
    pub causes: bool,
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
    // The order of these calls is the order of the families in every format.
    series::stage_seconds(&mut out, state, native, with_exemplars);
    layers::layer_seconds(&mut out, &state.agg, &series, native);
    layers::submit_seconds(&mut out, &series, native);
    series::qos_wait_seconds(&mut out, &series, native);
    series::queue_depth(&mut out, &series);
    series::counters(&mut out, state, &series);
    layers::unlinked(&mut out, &series);
    if state.causes {
        waits::families(&mut out, &series);
    }
    if let Some(c) = &state.cgroups {
        cgroups::families(&mut out, c);
    }
    health::lost_and_kernel_tables(&mut out, state);
    recorder::families(&mut out, &state.recorder);
    health::records_hooks_and_programs(&mut out, state);
    process::families(&mut out, &state.kernel);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::op::Op;
    use crate::serve::exposition::Kind;
    use std::collections::BTreeSet;
    use tracer_common::{IoRecord, event, flag, kind};

    pub(super) fn sample_state() -> State {
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
        // A submitter's sleep for a tag (config `causes`).
        use crate::model::causes::{Cause, Phase, WaitSum};
        plain.causes = true;
        plain.agg.add_waits(
            &[((7, Op::Write, Phase::Q2g, Cause::Tag), WaitSum { waits: 1, ns: 5000 })].into(),
            |_| "lo".into(),
        );
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
