//! The report: a capture's model per device and op (stages, paths, layers, queue depths,
//! cgroups, slowest IOs), built from an aggregate (`build`) or a window of the agent or a store
//! (`window`), and rendered as btt-style tables (`text`) or JSON (its schema: docs/reference/json.md).

use std::{collections::BTreeMap, path::PathBuf};

use serde::Serialize;

use crate::{
    kernel::hooks::HookStatus,
    model::aggregate::{StageHist, Stages},
    model::capture,
    model::causes,
    model::cgroups::LabelForm,
    model::layers::Phase,
    model::op::Op,
    model::stage::Stage,
    serve::api,
    view::histogram::Log2Bucket,
    view::style::Style,
};

mod build;
mod text;
mod window;

pub use window::{Origin, window_report, window_report_for};

/// Additions (fields readers may ignore) keep the version; removals and changed meanings bump it.
pub const SCHEMA_VERSION: u32 = 1;

/// Slow IOs a report shows per device (the agent keeps more: `slowest::PER_MINUTE` a minute).
const SLOWEST_SHOWN: usize = 5;

/// How `report` shows the capture.
#[derive(Clone, Copy, Debug, Default)]
pub struct View {
    pub json: bool,
    /// Tables per queue depth at issue (`--by qd`).
    pub by_qd: bool,
    /// Tables per cgroup, labelled in this form (`--by cgroup`).
    pub by_cgroup: Option<LabelForm>,
    /// The stage to draw a log2 histogram of (`--hist`).
    pub hist: Option<Stage>,
    pub style: Style,
    /// One report per interval (`--interval`, `--count`) instead of one at the end.
    pub interval: Option<Interval>,
}

/// `report --interval SECS [--count N]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Interval {
    pub secs: f64,
    /// Stop after this many intervals (default: until SIGINT).
    pub count: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub schema_version: u32,
    pub kernel: String,
    pub duration_s: f64,
    pub devices: Vec<DeviceReport>,
    /// Lost events during the capture, by reason.
    pub lost: BTreeMap<&'static str, u64>,
    pub hooks: Vec<HookStatus>,
    /// The `--hist` stage (its rows are in that stage's `log2_buckets`).
    #[serde(skip)]
    pub hist: Option<Stage>,
    /// Where the IO came from when it was the agent's recorder.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_agent: Option<FromAgent>,
    /// From the agent: each device's slowest IOs of every minute of the window, whole.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub slowest: Vec<crate::model::slowest::SlowMinute>,
    /// `--by cgroup`: the same tables per cgroup the IO was charged to.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub by_cgroup: Vec<CgroupReport>,
}

/// One cgroup's IO (`report --by cgroup`).
#[derive(Debug, Serialize)]
pub struct CgroupReport {
    /// Its path ("/system.slice/nginx.service"), unit or pod, as config cgroups.label says;
    /// "?" for IO of cgroups that went before they were named, "" where none was known.
    pub cgroup: String,
    pub devices: Vec<DeviceReport>,
}

#[derive(Debug, Serialize)]
pub struct DeviceReport {
    pub device: String,
    /// `dm-0 (lin0)`, `md0 (raid1)`: the name with the dm name or md level.
    pub label: String,
    /// Devices directly below this one (stacked devices).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lowers: Vec<String>,
    /// Devices stacked directly on this one.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub uppers: Vec<String>,
    pub ops: Vec<OpReport>,
    /// Who went ahead of this disk's IOs while they waited for a tag or in the scheduler
    /// (config `causes`, tracerd's own programs): one row per waiting group, op and stage.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ahead: Vec<crate::model::ahead::AheadRow>,
}

#[derive(Debug, Serialize)]
pub struct OpReport {
    pub op: Op,
    pub requests: u64,
    pub bytes: u64,
    pub merged_bios: u64,
    pub errors: u64,
    /// IOs below a traced stacked device that named no upper IO (absent when none).
    #[serde(skip_serializing_if = "capture::is_zero")]
    pub unlinked: u64,
    /// Those by the kind of own IO the kernel said they are (absent when none).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub unlinked_kinds: BTreeMap<String, u64>,
    pub iops: f64,
    pub bytes_per_second: f64,
    /// Mean queue depth at issue, of the requests issued with one known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_depth_mean: Option<f64>,
    /// Requests per event path ("QGDC": no insert, "QGIDC": through the scheduler).
    pub paths: BTreeMap<String, u64>,
    pub stages: BTreeMap<Stage, StageSummary>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub by_queue_depth: Vec<QueueDepthReport>,
    /// Stacked devices: each IO's Q2C split against each lower device.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<LayerReport>,
    /// Stacked devices: time in the submit function (`submit_bio`) and md personality.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub submit_path: BTreeMap<&'static str, StageSummary>,
    /// rq-qos waits inside Q2G, by policy (`wbt`, `iocost`, ...; config `rq_qos`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub qos_wait: BTreeMap<String, StageSummary>,
    /// Submitters' waits inside these IOs' phases, by phase and cause, most time first (config
    /// `causes`; absent without).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub waits: Vec<WaitReport>,
    /// The IOs' Q2C time (all of it added up) that no wait explains; with `waits` only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unexplained_s: Option<f64>,
}

/// Waits of one phase and cause (docs/guide/causes.md).
#[derive(Debug, Serialize)]
pub struct WaitReport {
    pub phase: causes::Phase,
    pub cause: causes::Cause,
    pub waits: u64,
    /// Their off-CPU time, added up.
    pub wait_s: f64,
    /// That time over the IOs' Q2C time added up (0 to 1).
    pub share_of_q2c: f64,
}

#[derive(Debug, Serialize)]
pub struct LayerReport {
    pub lower: String,
    /// Upper IOs that went to this lower device.
    pub ios: u64,
    /// Lower IOs they sent there.
    pub lower_ios: u64,
    /// `layer` + `lower` + `completion` = the upper IO's Q2C, IO by IO.
    pub phases: BTreeMap<Phase, StageSummary>,
}

#[derive(Debug, Serialize)]
pub struct QueueDepthReport {
    pub queue_depth: u32,
    pub stages: BTreeMap<Stage, StageSummary>,
}

/// One stage's distribution; times in seconds.
#[derive(Debug, Serialize, PartialEq)]
pub struct StageSummary {
    pub count: u64,
    pub mean_s: f64,
    pub p50_s: f64,
    pub p90_s: f64,
    pub p99_s: f64,
    pub p999_s: f64,
    pub max_s: f64,
    /// With `--hist` for this stage: its log2 histogram (`view::histogram`), rows of
    /// `{"from_s", "to_s", "count"}` holding from_s <= time < to_s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log2_buckets: Option<Vec<Log2Bucket>>,
}

impl StageSummary {
    fn of(h: &StageHist) -> StageSummary {
        let q = |p: f64| h.hist.value_at_quantile(p) as f64 / 1e9;
        StageSummary {
            count: h.count(),
            mean_s: h.sum_ns as f64 / h.count().max(1) as f64 / 1e9,
            p50_s: q(0.5),
            p90_s: q(0.9),
            p99_s: q(0.99),
            p999_s: q(0.999),
            max_s: h.hist.max() as f64 / 1e9,
            log2_buckets: None,
        }
    }
}

fn summaries(stages: &Stages) -> BTreeMap<Stage, StageSummary> {
    Stage::ALL.iter().filter_map(|&s| Some((s, StageSummary::of(stages[s.index()].as_deref()?)))).collect()
}

/// Which agent (or store) and window an attached report shows.
#[derive(Clone, Debug, Serialize)]
pub struct FromAgent {
    /// The agent's socket; absent when read from a store (`report --store`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
    /// The store read (`report --store`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store: Option<PathBuf>,
    pub from_unix_s: f64,
    pub to_unix_s: f64,
    /// Frames of the agent's recorder added up.
    pub frames: u64,
    /// Stretches of the window with no frame because no agent ran.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gaps: Vec<api::GapAnswer>,
    /// Frames of the window the store could not read back, left out.
    #[serde(skip_serializing_if = "capture::is_zero")]
    pub damaged_frames: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{
        aggregate::{Aggregator, Lost},
        topology::Topology,
    };
    use tracer_common::{IoRecord, event, kind};

    fn agg() -> Aggregator {
        let mut agg = Aggregator::new(true);
        for (i, qd) in [(1u64, 1u32), (2, 1), (3, 2)] {
            let mut r = IoRecord { kind: kind::REQUEST, bytes: 4096, queue_depth: qd, ..Default::default() };
            (r.ts[event::Q], r.ts[event::G], r.ts[event::D], r.ts[event::C]) =
                (1000, 2000, 3000, 3000 + i * 10_000);
            agg.add(7, Op::Read, &r, &[], |_| "loop0".into());
        }
        agg
    }

    #[test]
    fn report_sums_and_paths() {
        let r = Report::build(&agg(), &Topology::default(), &Lost::default(), &[], "6.18", 2.0);
        let op = &r.devices[0].ops[0];
        assert_eq!((op.requests, op.bytes, op.iops), (3, 12288, 1.5));
        assert_eq!(op.paths, BTreeMap::from([("QGDC".to_string(), 3)]));
        assert_eq!(op.stages[&Stage::D2c].count, 3);
        assert!((op.stages[&Stage::D2c].mean_s - 20e-6).abs() < 1e-9);
        assert!(!op.stages.contains_key(&Stage::G2i));
        assert_eq!(
            op.by_queue_depth
                .iter()
                .map(|q| (q.queue_depth, q.stages[&Stage::D2c].count))
                .collect::<Vec<_>>(),
            vec![(1, 2), (2, 1)]
        );
        let json: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert_eq!(json["devices"][0]["ops"][0]["stages"]["g2d"]["count"], 3);
        assert_eq!(json["lost"]["ringbuf_full"], 0);
    }

    #[test]
    fn waits_are_shares_of_the_q2c_time_with_the_rest_unexplained() {
        use crate::model::causes::{Cause, Phase as WaitPhase, WaitSum};
        let mut agg = agg();
        let waits = [
            ((7, Op::Read, WaitPhase::Q2g, Cause::Cpu), WaitSum { waits: 1, ns: 6_000 }),
            ((7, Op::Read, WaitPhase::Q2g, Cause::Tag), WaitSum { waits: 2, ns: 30_000 }),
        ];
        agg.add_waits(&waits.into(), |_| "loop0".into());
        let r = Report::build(&agg, &Topology::default(), &Lost::default(), &[], "6.18", 2.0);
        let op = &r.devices[0].ops[0];
        // Q2C: 12, 22 and 32 us, 66 us in all.
        assert_eq!(
            op.waits.iter().map(|w| w.cause).collect::<Vec<_>>(),
            [Cause::Tag, Cause::Cpu],
            "most first"
        );
        assert!((op.waits[0].share_of_q2c - 30.0 / 66.0).abs() < 1e-12);
        assert!((op.unexplained_s.unwrap() - 30e-6).abs() < 1e-15);
        let text = r.render_text();
        let row = |cause: &str| {
            text.lines().find(|l| l.contains(cause)).unwrap_or_else(|| panic!("{text}")).to_owned()
        };
        assert!(row(" tag ").contains("45.5%"), "{text}");
        assert!(row("unexplained").contains("45.5%"), "{text}");
        assert!(row(" cpu ").contains("9.1%"), "{text}");
        // Without causes, no section.
        let plain = Report::build(&self::agg(), &Topology::default(), &Lost::default(), &[], "6.18", 2.0);
        assert!(plain.devices[0].ops[0].unexplained_s.is_none() && !plain.render_text().contains("waits"));
    }

    #[test]
    fn slowest_ios_name_their_main_cause_where_they_have_causes() {
        use crate::model::slowest::{SlowIo, SlowMinute};
        let slow = |took_ns: u64, causes: &str| {
            SlowIo {
            took_ns,
            io: serde_json::value::RawValue::from_string(format!(
                r#"{{"comm":"fio","pid":7,"op":"write","bytes":4096,"sector":8,"path":"QGDC","stages_ns":{{"q2d":1000,"d2c":2000}}{causes}}}"#
            ))
            .unwrap(),
        }
        };
        let mut r = Report::build(&agg(), &Topology::default(), &Lost::default(), &[], "6.18", 2.0);
        let minute = |ios| SlowMinute { device: "loop0".into(), minute_unix_s: 1_700_000_040, ios };
        r.slowest = vec![minute(vec![slow(900_000, "")])];
        assert!(!r.render_text().contains("main cause"), "no causes, no column");
        r.slowest = vec![minute(vec![
            slow(900_000, r#","causes_ns":{"tag":412000,"cpu":3000}"#),
            slow(800_000, r#","causes_ns":{}"#),
        ])];
        let text = r.render_text();
        let line = |took: &str| {
            text.lines().find(|l| l.contains(took)).unwrap_or_else(|| panic!("{text}")).to_owned()
        };
        assert!(text.contains("main cause"), "{text}");
        assert!(line("900.0µs").trim_end().ends_with("tag 412.0µs"), "{text}");
        assert!(line("800.0µs").trim_end().ends_with('-'), "{text}");
    }

    /// md0 (raid1) over ram0 and ram1, one write.
    fn stacked() -> (Aggregator, Topology) {
        use crate::model::layers::LayerSplit;
        use crate::model::topology::tests::fake_stacked_sysfs;
        let dir = fake_stacked_sysfs(
            &[("ram0", "1:0", None, false), ("ram1", "1:1", None, false)],
            &[("md0", "9:0", &["ram0", "ram1"], None, Some("raid1"))],
        );
        let topo = Topology::scan_root(&dir.0, &dir.0.join("diskstats")).unwrap();
        let mut agg = Aggregator::new(false);
        let name = |d: u32| topo.name_of(d);
        let mut upper = IoRecord { kind: kind::BIO, submit_ns: 5000, ..Default::default() };
        (upper.ts[event::Q], upper.ts[event::C]) = (0, 10_000);
        let md0 = crate::model::topology::kernel_dev(9, 0);
        let (ram0, ram1) =
            (crate::model::topology::kernel_dev(1, 0), crate::model::topology::kernel_dev(1, 1));
        let splits = [
            LayerSplit { lower: ram0, ios: 1, layer_ns: 1000, lower_ns: 8000, completion_ns: 1000 },
            LayerSplit { lower: ram1, ios: 1, layer_ns: 2000, lower_ns: 7000, completion_ns: 1000 },
        ];
        agg.add(md0, Op::Write, &upper, &splits, name);
        let mut lower = IoRecord { kind: kind::BIO, parent: 1, ..Default::default() };
        (lower.ts[event::Q], lower.ts[event::C]) = (1000, 9000);
        agg.add(ram0, Op::Write, &lower, &[], name);
        agg.add(ram1, Op::Write, &lower, &[], name);
        (agg, topo)
    }

    #[test]
    fn text_shows_stacks_as_trees_with_layer_rows() {
        let (agg, topo) = stacked();
        let text = Report::build(&agg, &topo, &Lost::default(), &[], "6.1", 1.0).render_text();
        assert!(text.contains("device stacks:\n  md0 (raid1)\n  ├─ ram0\n  └─ ram1\n"), "{text}");
        assert!(text.contains("md0 (raid1) write: 1 requests"), "{text}");
        assert!(text.contains("per layer"), "{text}");
        assert!(text.contains("  ram0              1 layer"), "{text}");
        assert!(text.contains("submit path (submit_bio): 1 IOs, mean 5.0µs"), "{text}");
    }

    #[test]
    fn text_shows_stages_paths_and_qd_table() {
        let text =
            Report::build(&agg(), &Topology::default(), &Lost::default(), &[], "6.18", 2.0).render_text();
        assert!(text.contains("loop0 read: 3 requests"), "{text}");
        assert!(text.contains("paths: QGDC 3 (100.0%)"), "{text}");
        assert!(text.contains("  G2D "), "{text}");
        assert!(!text.contains("G2I"), "{text}");
        assert!(text.contains("by queue depth at issue"), "{text}");
        assert!(text.contains("lost events: none"), "{text}");
    }

    /// `render_text` before colour, histograms and growing columns existed (captured from that
    /// version): without colour and `--hist`, the text must stay exactly this.
    const BEFORE_QD: &str = r#"tracerd report: 2.0 s on kernel 6.18

loop0 read: 3 requests, 12.0KiB, 1.5 IOPS, 6.0KiB/s, 0 merged bios, 0 errors
  paths: QGDC 3 (100.0%)
  stage      count      mean       p50       p90       p99     p99.9       max
  Q2G            3     1.0µs     1.0µs     1.0µs     1.0µs     1.0µs     1.0µs
  G2D            3     1.0µs     1.0µs     1.0µs     1.0µs     1.0µs     1.0µs
  Q2D            3     2.0µs     2.0µs     2.0µs     2.0µs     2.0µs     2.0µs
  D2C            3    20.0µs    20.0µs    30.0µs    30.0µs    30.0µs    30.0µs
  Q2C            3    22.0µs    22.0µs    32.1µs    32.1µs    32.1µs    32.1µs
  by queue depth at issue:
     qd     count   Q2D mean    Q2D p50    Q2D p99   D2C mean    D2C p50    D2C p99
      1         2      2.0µs      2.0µs      2.0µs     15.0µs     10.0µs     20.0µs
      2         1      2.0µs      2.0µs      2.0µs     30.0µs     30.0µs     30.0µs

lost events: none
"#;
    const BEFORE_STACKED: &str = r#"tracerd report: 1.0 s on kernel 6.1

device stacks:
  md0 (raid1)
  ├─ ram0
  └─ ram1

md0 (raid1) write: 1 requests, 0B, 1.0 IOPS, 0B/s, 0 merged bios, 0 errors
  paths: C 1 (100.0%)
  stage      count      mean       p50       p90       p99     p99.9       max
  per layer (Q2C = layer + lower + completion, IO by IO):
  lower           ios phase            mean       p50       p90       p99       max
  ram0              1 layer           1.0µs     1.0µs     1.0µs     1.0µs     1.0µs
                      lower           8.0µs     8.1µs     8.1µs     8.1µs     8.1µs
                      completion      1.0µs     1.0µs     1.0µs     1.0µs     1.0µs
  ram1              1 layer           2.0µs     2.0µs     2.0µs     2.0µs     2.0µs
                      lower           7.0µs     7.0µs     7.0µs     7.0µs     7.0µs
                      completion      1.0µs     1.0µs     1.0µs     1.0µs     1.0µs
  submit path (submit_bio): 1 IOs, mean 5.0µs, p50 5.1µs, p99 5.1µs, max 5.1µs

ram0 write: 1 requests, 0B, 1.0 IOPS, 0B/s, 0 merged bios, 0 errors
  paths: QC 1 (100.0%)
  stage      count      mean       p50       p90       p99     p99.9       max
  Q2C            1     8.0µs     8.1µs     8.1µs     8.1µs     8.1µs     8.1µs

ram1 write: 1 requests, 0B, 1.0 IOPS, 0B/s, 0 merged bios, 0 errors
  paths: QC 1 (100.0%)
  stage      count      mean       p50       p90       p99     p99.9       max
  Q2C            1     8.0µs     8.1µs     8.1µs     8.1µs     8.1µs     8.1µs

lost events: stale_bio 3
"#;

    #[test]
    fn plain_text_is_unchanged_by_colour_and_histogram_support() {
        let r = Report::build(&agg(), &Topology::default(), &Lost::default(), &[], "6.18", 2.0);
        assert_eq!(r.render_text(), BEFORE_QD);
        assert_eq!(r.render_text_styled(Style::PLAIN), BEFORE_QD);
        let (agg, topo) = stacked();
        let lost = Lost { stale_bio: 3, ..Default::default() };
        assert_eq!(Report::build(&agg, &topo, &lost, &[], "6.1", 1.0).render_text(), BEFORE_STACKED);
    }

    #[test]
    fn colour_only_adds_escapes() {
        let (agg, topo) = stacked();
        let lost = Lost { stale_bio: 3, ..Default::default() };
        let r = Report::build_with(&agg, &topo, &lost, &[], "6.1", 1.0, Some(Stage::Q2c));
        let coloured = r.render_text_styled(Style::COLOR);
        assert_eq!(crate::view::style::strip(&coloured), r.render_text());
        assert!(coloured.contains("lost events: \x1b[31mstale_bio 3\x1b[39m"), "{coloured}");
        assert!(coloured.contains("\n\x1b[1mmd0 (raid1) write:\x1b[22m 1 requests"), "{coloured}");
        assert!(coloured.contains("\x1b[1m  stage      count"), "{coloured}");
        assert!(coloured.contains("|\x1b[36m****"), "histogram bars: {coloured}");
        assert!(!r.render_text().contains('\x1b'));
    }

    #[test]
    fn hist_draws_the_stage_after_each_table_and_adds_its_buckets_to_json() {
        let r = Report::build_with(
            &agg(),
            &Topology::default(),
            &Lost::default(),
            &[],
            "6.18",
            2.0,
            Some(Stage::D2c),
        );
        let text = r.render_text();
        // The tables are the same, the histogram follows them.
        let (tables, hist) =
            text.split_once("  D2C histogram (a row holds from <= time < to):\n").expect(&text);
        assert!(BEFORE_QD.starts_with(tables), "{text}");
        assert_eq!(
            hist,
            "  range             count  percent  distribution\n   \
             8.2µs -> 16.4µs      1    33.3%  |********************                    |\n  \
             16.4µs -> 32.8µs      2    66.7%  |****************************************|\n\
             \nlost events: none\n"
        );
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["schema_version"], 1, "an added field keeps the schema version");
        let stages = &json["devices"][0]["ops"][0]["stages"];
        assert_eq!(
            stages["d2c"]["log2_buckets"],
            serde_json::json!([
                {"from_s": 8.192e-6, "to_s": 1.6384e-5, "count": 1},
                {"from_s": 1.6384e-5, "to_s": 3.2768e-5, "count": 2}
            ])
        );
        assert!(stages["q2c"].get("log2_buckets").is_none(), "only the chosen stage");
        let plain = serde_json::to_value(Report::build(
            &agg(),
            &Topology::default(),
            &Lost::default(),
            &[],
            "6.18",
            2.0,
        ))
        .unwrap();
        assert!(plain["devices"][0]["ops"][0]["stages"]["d2c"].get("log2_buckets").is_none());
        // A stage no IO went through: said once, nothing drawn.
        let r = Report::build_with(
            &agg(),
            &Topology::default(),
            &Lost::default(),
            &[],
            "6.18",
            2.0,
            Some(Stage::I2d),
        );
        let text = r.render_text();
        assert!(text.contains("\nno I2D histogram: no traced IO went through that stage.\n"), "{text}");
        assert!(!text.contains("distribution"), "{text}");
    }

    /// Character spans of a table's header cells, found in order.
    fn header_spans(line: &str, cells: &[&str]) -> Vec<(usize, usize)> {
        let mut from = 0;
        cells
            .iter()
            .map(|c| {
                let at = from + line[from..].find(c).unwrap_or_else(|| panic!("{c} in {line}"));
                from = at + c.len();
                (line[..at].chars().count(), line[..from].chars().count())
            })
            .collect()
    }

    /// Asserts that every row of the table under `header` has each cell where the header has its
    /// column: left-aligned columns (`lefts`) by their first character, the others by their last.
    /// Offsets count characters, the terminal's columns (µ is one column, two bytes in UTF-8).
    /// Cells are matched from the right, so rows with empty leading cells (layer rows) count too.
    fn assert_aligned(text: &str, header: &[&str], lefts: &[usize], rows: usize) {
        let lines: Vec<&str> = text.lines().collect();
        let h = lines
            .iter()
            .position(|l| l.split_whitespace().collect::<Vec<_>>().join(" ") == header.join(" "))
            .unwrap_or_else(|| panic!("no table {header:?} in\n{text}"));
        let spans = header_spans(lines[h], header);
        for row in &lines[h + 1..=h + rows] {
            let mut cells = vec![];
            let mut start = None;
            for (i, c) in row.chars().chain([' ']).enumerate() {
                match (c == ' ', start) {
                    (false, None) => start = Some(i),
                    (true, Some(s)) => {
                        cells.push((s, i));
                        start = None;
                    }
                    _ => {}
                }
            }
            assert!(cells.len() <= spans.len(), "{row}");
            let skip = spans.len() - cells.len();
            for (col, (cell, head)) in cells.iter().zip(&spans[skip..]).enumerate() {
                let col = col + skip;
                let ok = if lefts.contains(&col) { cell.0 == head.0 } else { cell.1 == head.1 };
                assert!(ok, "column {} ({}) out of line in\n{}\n{row}\n\n{text}", col, header[col], lines[h]);
            }
            assert_eq!(row.chars().count(), lines[h].chars().count(), "{row}\n{text}");
        }
    }

    #[test]
    fn tables_stay_aligned_for_long_names_large_counts_and_ns_to_minutes() {
        use crate::model::layers::LayerSplit;
        use crate::model::topology::tests::fake_stacked_sysfs;
        let dir = fake_stacked_sysfs(
            &[
                ("nvme0n1", "259:0", None, true),
                ("nvme0n1p12", "259:12", Some("nvme0n1"), false),
                ("mmcblk0boot0", "179:8", None, true),
            ],
            &[("dm-0", "253:0", &["nvme0n1p12", "mmcblk0boot0"], Some("lin0"), None)],
        );
        let topo = Topology::scan_root(&dir.0, &dir.0.join("diskstats")).unwrap();
        let name = |d: u32| topo.name_of(d);
        let (dm0, p12, boot) = (
            crate::model::topology::kernel_dev(253, 0),
            crate::model::topology::kernel_dev(259, 12),
            crate::model::topology::kernel_dev(179, 8),
        );
        let mut agg = Aggregator::new(true);
        // From 50 ns (Q2G) to 5 minutes (Q2C; the histogram tops out at 60 s, the mean does not).
        for (i, (d2c, qd)) in [(700u64, 1u32), (3_000_000, 4), (90_000_000_000, 128), (300_000_000_000, 128)]
            .into_iter()
            .enumerate()
        {
            let mut r = IoRecord { kind: kind::REQUEST, bytes: 4096, queue_depth: qd, ..Default::default() };
            (r.ts[event::Q], r.ts[event::G], r.ts[event::D]) = (1, 51, 951 + i as u64);
            r.ts[event::C] = r.ts[event::D] + d2c;
            agg.add(p12, Op::Read, &r, &[], name);
            let mut upper = IoRecord { kind: kind::BIO, ..Default::default() };
            (upper.ts[event::Q], upper.ts[event::C]) = (1, 1 + d2c + 2000);
            let split =
                |lower| LayerSplit { lower, ios: 1, layer_ns: 1000, lower_ns: d2c, completion_ns: 1000 };
            agg.add(dm0, Op::Read, &upper, &[split(p12), split(boot)], name);
        }
        // Two billion more IOs of 20 µs, beyond the count column's nine digits.
        let s = agg.series.get_mut(&(p12, Op::Read)).unwrap();
        for h in [&mut s.stages, s.by_qd.get_mut(&1).unwrap()] {
            let d2c = h[Stage::D2c.index()].as_mut().unwrap();
            d2c.hist.record_n(20_000, 2_000_000_000).unwrap();
            d2c.sum_ns += 20_000 * 2_000_000_000;
        }
        let text = Report::build_with(&agg, &topo, &Lost::default(), &[], "6.18", 600.0, Some(Stage::D2c))
            .render_text();
        assert!(text.contains("dm-0 (lin0) read: 4 requests"), "{text}");
        assert!(text.contains("  mmcblk0boot0"), "{text}");
        assert!(text.contains("2000000004"), "{text}");
        assert!(["50ns", "20.0µs", "3.00ms", "97.50s", "195.00s"].iter().all(|v| text.contains(v)), "{text}");
        let stage_header = ["stage", "count", "mean", "p50", "p90", "p99", "p99.9", "max"];
        // nvme0n1p12: Q2G G2D Q2D D2C Q2C; dm-0: Q2C.
        let nvme = &text[text.find("nvme0n1p12 read").unwrap()..];
        assert_aligned(nvme, &stage_header, &[0], 5);
        let dm = &text[text.find("dm-0 (lin0) read").unwrap()..];
        assert_aligned(dm, &stage_header, &[0], 1);
        assert_aligned(&text, &["lower", "ios", "phase", "mean", "p50", "p90", "p99", "max"], &[0, 2], 6);
        let qd = ["qd", "count", "Q2D mean", "Q2D p50", "Q2D p99", "D2C mean", "D2C p50", "D2C p99"];
        assert_aligned(&text, &qd, &[], 3);
    }
}
