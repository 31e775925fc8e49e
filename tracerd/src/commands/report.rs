//! `tracerd report`: a timed capture summarised as btt-style tables, or as JSON.
//! The JSON schema is documented in docs/reference/json.md.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    io::{IsTerminal, Write as _},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::Result;
use serde::Serialize;

use crate::{
    commands::capture::{self, Capture},
    commands::histogram_view::{self, Log2Bucket},
    kernel::cgroupfs::{CgroupNames, LabelForm, Named},
    kernel::hooks::HookStatus,
    kernel::session::Io,
    kernel::session::{Session, shutdown_signal},
    kernel::tracer::{LoadOptions, kernel_release},
    model::aggregate::{Aggregator, Lost, OpStats, StageHist, Stages},
    model::layers::Phase,
    model::op::Op,
    model::selection::Selection,
    model::stage::{self, Stage},
    model::topology::Topology,
    serve::api,
    style::Style,
    units,
};

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
    /// With `--hist` for this stage: its log2 histogram (histogram_view), rows of
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

impl OpReport {
    fn build(
        op: Op,
        s: &OpStats,
        duration_s: f64,
        hist: Option<Stage>,
        name: impl Fn(u32) -> String,
    ) -> OpReport {
        let mut stages = summaries(&s.stages);
        if let Some((summary, h)) = hist.and_then(|st| Some((stages.get_mut(&st)?, s.stage(st)?))) {
            summary.log2_buckets = Some(histogram_view::buckets(&h.hist));
        }
        OpReport {
            op,
            requests: s.requests,
            bytes: s.bytes,
            merged_bios: s.merged_bios,
            errors: s.errors,
            unlinked: s.unlinked,
            unlinked_kinds: capture::own_kinds(&s.own),
            iops: s.requests as f64 / duration_s,
            bytes_per_second: s.bytes as f64 / duration_s,
            queue_depth_mean: (s.queue_depth.count > 0)
                .then(|| s.queue_depth.sum as f64 / s.queue_depth.count as f64),
            paths: s
                .paths
                .iter()
                .enumerate()
                .filter(|(_, n)| **n > 0)
                .map(|(m, n)| (stage::path_of_mask(m), *n))
                .collect(),
            stages,
            by_queue_depth: s
                .by_qd
                .iter()
                .map(|(&queue_depth, st)| QueueDepthReport { queue_depth, stages: summaries(st) })
                .collect(),
            layers: s
                .layers
                .iter()
                .map(|(&lower, l)| LayerReport {
                    lower: name(lower),
                    ios: l.ios,
                    lower_ios: l.lower_ios,
                    phases: Phase::ALL
                        .iter()
                        .zip(&l.phases)
                        .map(|(p, h)| (*p, StageSummary::of(h)))
                        .collect(),
                })
                .collect(),
            submit_path: [("submit_bio", &s.submit), ("personality", &s.personality)]
                .into_iter()
                .filter_map(|(k, h)| Some((k, StageSummary::of(h.as_deref()?))))
                .collect(),
            qos_wait: s.qos.iter().map(|(&p, h)| (stage::qos_name(p), StageSummary::of(h))).collect(),
        }
    }
}

impl Report {
    pub fn build(
        agg: &Aggregator,
        topo: &Topology,
        lost: &Lost,
        hooks: &[HookStatus],
        kernel: &str,
        duration_s: f64,
    ) -> Report {
        Report::build_with(agg, topo, lost, hooks, kernel, duration_s, None)
    }

    /// `build`, with the log2 histogram of stage `hist` in every op that has it.
    pub fn build_with(
        agg: &Aggregator,
        topo: &Topology,
        lost: &Lost,
        hooks: &[HookStatus],
        kernel: &str,
        duration_s: f64,
        hist: Option<Stage>,
    ) -> Report {
        let duration_s = duration_s.max(1e-9);
        let mut devices: Vec<DeviceReport> = Vec::new();
        for (device, op, stats) in agg.sorted() {
            let op_report = OpReport::build(op, stats, duration_s, hist, |d| agg.name(d).to_owned());
            match devices.last_mut() {
                Some(d) if d.device == device => d.ops.push(op_report),
                _ => {
                    let known = topo.by_name(device);
                    devices.push(DeviceReport {
                        device: device.to_owned(),
                        label: known.map_or_else(|| device.to_owned(), |d| d.label()),
                        lowers: known.map(|d| d.lowers.clone()).unwrap_or_default(),
                        uppers: known.map(|d| d.uppers.clone()).unwrap_or_default(),
                        ops: vec![op_report],
                    })
                }
            }
        }
        Report {
            schema_version: SCHEMA_VERSION,
            kernel: kernel.to_owned(),
            duration_s,
            devices,
            lost: lost.reasons().into_iter().collect(),
            hooks: hooks.to_vec(),
            hist,
            from_agent: None,
            slowest: vec![],
            by_cgroup: vec![],
        }
    }

    /// Adds the tables of each cgroup's aggregate (`--by cgroup`).
    pub fn with_cgroups(
        mut self,
        cgroups: &BTreeMap<String, Aggregator>,
        topo: &Topology,
        hist: Option<Stage>,
    ) -> Report {
        let none = Lost::default();
        self.by_cgroup = cgroups
            .iter()
            .map(|(cgroup, agg)| CgroupReport {
                cgroup: cgroup.clone(),
                devices: Report::build_with(agg, topo, &none, &[], "", self.duration_s, hist).devices,
            })
            .collect();
        self
    }

    /// The tables without colour.
    pub fn render_text(&self) -> String {
        self.render_text_styled(Style::PLAIN)
    }

    /// The tables, emphasised by `style`: bold headings, histogram bars, lost events in red,
    /// skipped hooks in yellow. Without colour, exactly `render_text`.
    pub fn render_text_styled(&self, style: Style) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "tracerd report: {:.1} s on kernel {}", self.duration_s, self.kernel);
        if let Some(a) = &self.from_agent {
            let origin = match (&a.socket, &a.store) {
                (_, Some(store)) => format!("from the store {}", store.display()),
                (Some(socket), None) => format!("from the agent on {}", socket.display()),
                (None, None) => "from the agent".into(),
            };
            let _ = writeln!(
                out,
                "{origin}: {} to {} ({} frames)",
                units::rfc3339(a.from_unix_s),
                units::rfc3339(a.to_unix_s),
                a.frames
            );
            for g in &a.gaps {
                let _ = writeln!(
                    out,
                    "{}",
                    style.yellow(&format!(
                        "gap: no agent ran from {} to {} ({:.1} s): nothing was traced then",
                        units::rfc3339(g.from_unix_s),
                        units::rfc3339(g.to_unix_s),
                        g.to_unix_s - g.from_unix_s
                    ))
                );
            }
            if a.damaged_frames != 0 {
                let _ = writeln!(
                    out,
                    "{}",
                    style.yellow(&format!(
                        "{} frames of the window are damaged on disk and left out",
                        a.damaged_frames
                    ))
                );
            }
        }
        if self.devices.is_empty() {
            let _ = writeln!(out, "\nno IO completed on the traced devices during the capture.");
        }
        self.render_stacks(&mut out);
        for d in &self.devices {
            for op in &d.ops {
                render_op(&mut out, &d.label, op, style);
            }
        }
        for c in &self.by_cgroup {
            let name = if c.cgroup.is_empty() { "(unknown)" } else { &c.cgroup };
            let _ = writeln!(out, "\n{}", style.bold(&format!("cgroup {name}")));
            for d in &c.devices {
                for op in &d.ops {
                    render_op(&mut out, &format!("{} in {name}", d.label), op, style);
                }
            }
        }
        if let Some(stage) = self.hist {
            let drawn = self.devices.iter().flat_map(|d| &d.ops).any(|op| op.stages.contains_key(&stage));
            if !drawn && !self.devices.is_empty() {
                let _ = writeln!(
                    out,
                    "\nno {} histogram: no traced IO went through that stage.",
                    stage.as_str().to_uppercase()
                );
            }
        }
        self.render_slowest(&mut out, style);
        let lost: Vec<String> =
            self.lost.iter().filter(|(_, n)| **n > 0).map(|(r, n)| format!("{r} {n}")).collect();
        let lost = if lost.is_empty() { "none".into() } else { style.red(&lost.join(", ")) };
        let _ = writeln!(out, "\nlost events: {lost}");
        for h in self.hooks.iter().filter(|h| !h.attached()) {
            let line = format!("skipped hook {}: {}", h.hook, h.reason.as_deref().unwrap_or("unknown"));
            let _ = writeln!(out, "{}", style.yellow(&line));
        }
        out
    }
}

impl Report {
    /// The window's slowest IOs per device, slowest first (at most `SLOWEST_SHOWN` each).
    fn render_slowest(&self, out: &mut String, style: Style) {
        let mut devices: BTreeMap<&str, Vec<(u64, &crate::model::slowest::SlowIo)>> = BTreeMap::new();
        for m in &self.slowest {
            devices.entry(&m.device).or_default().extend(m.ios.iter().map(|io| (m.minute_unix_s, io)));
        }
        for (device, mut ios) in devices {
            ios.sort_by_key(|io| std::cmp::Reverse(io.1.took_ns));
            let title = format!(
                "{device}: slowest IOs (of the {} kept per minute)",
                crate::model::slowest::PER_MINUTE
            );
            let _ = writeln!(out, "\n{}", style.bold(&title));
            let rows: Vec<Vec<String>> = ios
                .iter()
                .take(SLOWEST_SHOWN)
                .map(|(minute, s)| {
                    let v = &s.io();
                    let ns = |stage: &str| {
                        v["stages_ns"][stage].as_u64().map_or("-".into(), |n| t(n as f64 / 1e9))
                    };
                    vec![
                        units::rfc3339(*minute as f64)[11..16].to_owned(),
                        v["comm"].as_str().unwrap_or("?").to_owned(),
                        v["pid"].to_string(),
                        v["op"].as_str().unwrap_or("?").to_owned(),
                        v["bytes"].to_string(),
                        v["sector"].to_string(),
                        v["path"].as_str().unwrap_or("").to_owned(),
                        ns("q2d"),
                        ns("d2c"),
                        t(s.took_ns as f64 / 1e9),
                    ]
                })
                .collect();
            let time = (Align::Right, 9);
            write_table(
                out,
                style,
                &[
                    (Align::Left, 6),
                    (Align::Left, 15),
                    (Align::Right, 7),
                    (Align::Left, 5),
                    (Align::Right, 7),
                    (Align::Right, 10),
                    (Align::Left, 5),
                    time,
                    time,
                    time,
                ],
                &["minute", "comm", "pid", "op", "bytes", "sector", "path", "Q2D", "D2C", "took"],
                &rows,
            );
        }
    }

    /// To stdout: JSON, or the tables in the view's style.
    fn print(&self, view: View) -> Result<()> {
        let mut out = std::io::stdout().lock();
        if view.json {
            serde_json::to_writer_pretty(&mut out, self)?;
            writeln!(out)?;
        } else {
            write!(out, "{}", self.render_text_styled(view.style))?;
        }
        out.flush()?;
        Ok(())
    }

    /// Device stacks as trees, from each device that no traced device sits on.
    fn render_stacks(&self, out: &mut String) {
        let stacked: Vec<&DeviceReport> = self.devices.iter().filter(|d| !d.lowers.is_empty()).collect();
        if stacked.is_empty() {
            return;
        }
        let _ = writeln!(out, "\ndevice stacks:");
        let is_lower = |name: &str| stacked.iter().any(|d| d.lowers.iter().any(|l| l == name));
        for top in stacked.iter().filter(|d| !is_lower(&d.device)) {
            let _ = writeln!(out, "  {}", top.label);
            self.render_tree(out, top, "  ");
        }
    }

    fn render_tree(&self, out: &mut String, d: &DeviceReport, indent: &str) {
        for (i, lower) in d.lowers.iter().enumerate() {
            let last = i + 1 == d.lowers.len();
            let below = self.devices.iter().find(|x| &x.device == lower);
            let branch = if last { "└─" } else { "├─" };
            let _ = writeln!(out, "{indent}{branch} {}", below.map_or(lower.as_str(), |l| l.label.as_str()));
            if let Some(below) = below {
                self.render_tree(out, below, &format!("{indent}{}", if last { "   " } else { "│  " }));
            }
        }
    }
}

/// How a column's cells are padded.
#[derive(Clone, Copy)]
enum Align {
    Left,
    Right,
}

/// A table indented two spaces, cells one space apart. A column is as wide as its widest cell
/// and at least `min` (the widths these tables have always had), so a long device name or a
/// large count widens its own column instead of shifting the rest of its row.
fn write_table(
    out: &mut String,
    style: Style,
    columns: &[(Align, usize)],
    header: &[&str],
    rows: &[Vec<String>],
) {
    let chars = |s: &str| s.chars().count();
    let widths: Vec<usize> = (0..columns.len())
        .map(|i| rows.iter().map(|r| chars(&r[i])).chain([chars(header[i]), columns[i].1]).max().unwrap_or(0))
        .collect();
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::from(" ");
        for ((cell, (align, _)), w) in cells.zip(columns).zip(&widths) {
            let _ = match align {
                Align::Left => write!(l, " {cell:<w$}"),
                Align::Right => write!(l, " {cell:>w$}"),
            };
        }
        l
    };
    let _ = writeln!(out, "{}", style.bold(&line(&mut header.iter().copied())));
    for r in rows {
        let _ = writeln!(out, "{}", line(&mut r.iter().map(String::as_str)));
    }
}

impl Report {
    /// One interval as a compact table (`--interval`): a row per device and op, with the
    /// rates and the stage percentiles an incident asks for first, as `iostat -x` prints them.
    pub fn render_interval(&self, style: Style) -> String {
        let mut out = String::new();
        let span = self.from_agent.as_ref().map(|a| (a.from_unix_s, a.to_unix_s));
        let _ = match span {
            Some((from, to)) => writeln!(
                out,
                "{} to {} ({:.1} s, from the agent)",
                units::rfc3339(from),
                &units::rfc3339(to)[11..],
                to - from
            ),
            None => writeln!(out, "{} ({:.1} s)", units::rfc3339(capture::unix_now()), self.duration_s),
        };
        let cell = |op: &OpReport, stage: Stage, f: fn(&StageSummary) -> f64| {
            op.stages.get(&stage).map_or("-".to_string(), |s| t(f(s)))
        };
        let ops = || self.devices.iter().flat_map(|d| d.ops.iter().map(move |op| (d, op)));
        // H2Q only where blk-throttle checked some IO: most hosts set no io.max.
        let held = ops().any(|(_, op)| op.stages.contains_key(&Stage::H2q));
        let rows: Vec<Vec<String>> = ops()
            .map(|(d, op)| {
                let mut row = vec![
                    d.label.clone(),
                    op.op.as_str().to_owned(),
                    format!("{:.1}", op.iops),
                    units::bytes(op.bytes_per_second),
                ];
                if held {
                    row.push(cell(op, Stage::H2q, |s| s.p99_s));
                }
                row.extend([
                    cell(op, Stage::Q2d, |s| s.p99_s),
                    cell(op, Stage::D2c, |s| s.p50_s),
                    cell(op, Stage::D2c, |s| s.p99_s),
                    cell(op, Stage::Q2c, |s| s.p50_s),
                    cell(op, Stage::Q2c, |s| s.p99_s),
                ]);
                row
            })
            .collect();
        if rows.is_empty() {
            let _ = writeln!(out, "  no IO completed on the traced devices");
        } else {
            let time = (Align::Right, 9);
            let mut columns = vec![(Align::Left, 8), (Align::Left, 7), (Align::Right, 9), (Align::Right, 9)];
            let mut header = vec!["device", "op", "IOPS", "bytes/s"];
            if held {
                header.push("H2Q p99");
            }
            header.extend(["Q2D p99", "D2C p50", "D2C p99", "Q2C p50", "Q2C p99"]);
            columns.resize(header.len(), time);
            write_table(&mut out, style, &columns, &header, &rows);
        }
        let lost: Vec<String> =
            self.lost.iter().filter(|(_, n)| **n > 0).map(|(r, n)| format!("{r} {n}")).collect();
        if !lost.is_empty() {
            let _ = writeln!(out, "  {}", style.red(&format!("lost events: {}", lost.join(", "))));
        }
        out
    }

    /// One interval: a table, or with --json one line.
    fn print_interval(&self, view: View) -> Result<()> {
        let mut out = std::io::stdout().lock();
        if view.json {
            serde_json::to_writer(&mut out, self)?;
            writeln!(out)?;
        } else {
            writeln!(out, "{}", self.render_interval(view.style))?;
        }
        out.flush()?;
        Ok(())
    }
}

/// Seconds in the tables' units.
fn t(secs: f64) -> String {
    units::duration_ns(secs * 1e9)
}

fn render_op(out: &mut String, device: &str, op: &OpReport, style: Style) {
    let errors = format!("{} errors", op.errors);
    let _ = writeln!(
        out,
        "\n{} {} requests, {}, {:.1} IOPS, {}/s, {} merged bios, {}",
        style.bold(&format!("{device} {}:", op.op.as_str())),
        op.requests,
        units::bytes(op.bytes as f64),
        op.iops,
        units::bytes(op.bytes_per_second),
        op.merged_bios,
        if op.errors > 0 { style.red(&errors) } else { errors }
    );
    let total: u64 = op.paths.values().sum();
    let paths: Vec<String> = op
        .paths
        .iter()
        .map(|(p, n)| format!("{p} {n} ({:.1}%)", 100.0 * *n as f64 / total.max(1) as f64))
        .collect();
    if !paths.is_empty() {
        let _ = writeln!(out, "  paths: {}", paths.join(", "));
    }
    if op.unlinked > 0 {
        let kinds: Vec<String> = op.unlinked_kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
        let _ = writeln!(
            out,
            "  unlinked: {} of these IOs named no upper IO (the stacked driver's own IO, or a link the \
             kernel does not state): {}",
            op.unlinked,
            kinds.join(", ")
        );
    }
    let rows: Vec<Vec<String>> = op
        .stages
        .iter()
        .map(|(stage, s)| {
            let times = [s.mean_s, s.p50_s, s.p90_s, s.p99_s, s.p999_s, s.max_s].map(t);
            [stage.as_str().to_uppercase(), s.count.to_string()].into_iter().chain(times).collect()
        })
        .collect();
    let columns = [(Align::Left, 6), (Align::Right, 9)];
    write_table(
        out,
        style,
        &[columns[0], columns[1], columns[1], columns[1], columns[1], columns[1], columns[1], columns[1]],
        &["stage", "count", "mean", "p50", "p90", "p99", "p99.9", "max"],
        &rows,
    );
    if !op.layers.is_empty() {
        let _ = writeln!(out, "  per layer (Q2C = layer + lower + completion, IO by IO):");
        let mut rows: Vec<Vec<String>> = vec![];
        for l in &op.layers {
            for (i, (phase, s)) in l.phases.iter().enumerate() {
                let (name, ios) =
                    if i == 0 { (l.lower.clone(), l.ios.to_string()) } else { Default::default() };
                let times = [s.mean_s, s.p50_s, s.p90_s, s.p99_s, s.max_s].map(t);
                rows.push([name, ios, phase.as_str().to_owned()].into_iter().chain(times).collect());
            }
        }
        let time = (Align::Right, 9);
        write_table(
            out,
            style,
            &[(Align::Left, 10), (Align::Right, 8), (Align::Left, 11), time, time, time, time, time],
            &["lower", "ios", "phase", "mean", "p50", "p90", "p99", "max"],
            &rows,
        );
    }
    for (policy, s) in &op.qos_wait {
        let _ = writeln!(
            out,
            "  rq-qos wait in Q2G ({policy}): {} IOs, mean {}, p50 {}, p99 {}, max {}",
            s.count,
            t(s.mean_s),
            t(s.p50_s),
            t(s.p99_s),
            t(s.max_s)
        );
    }
    for (function, s) in &op.submit_path {
        let _ = writeln!(
            out,
            "  submit path ({function}): {} IOs, mean {}, p50 {}, p99 {}, max {}",
            s.count,
            t(s.mean_s),
            t(s.p50_s),
            t(s.p99_s),
            t(s.max_s)
        );
    }
    if !op.by_queue_depth.is_empty() {
        let _ = writeln!(out, "  by queue depth at issue:");
        let rows: Vec<Vec<String>> = op
            .by_queue_depth
            .iter()
            .map(|qd| {
                let cell = |stage: Stage, f: fn(&StageSummary) -> f64| {
                    qd.stages.get(&stage).map_or("-".to_string(), |s| t(f(s)))
                };
                let count = qd.stages.get(&Stage::D2c).map_or(0, |s| s.count);
                vec![
                    qd.queue_depth.to_string(),
                    count.to_string(),
                    cell(Stage::Q2d, |s| s.mean_s),
                    cell(Stage::Q2d, |s| s.p50_s),
                    cell(Stage::Q2d, |s| s.p99_s),
                    cell(Stage::D2c, |s| s.mean_s),
                    cell(Stage::D2c, |s| s.p50_s),
                    cell(Stage::D2c, |s| s.p99_s),
                ]
            })
            .collect();
        let time = (Align::Right, 10);
        write_table(
            out,
            style,
            &[(Align::Right, 5), (Align::Right, 9), time, time, time, time, time, time],
            &["qd", "count", "Q2D mean", "Q2D p50", "Q2D p99", "D2C mean", "D2C p50", "D2C p99"],
            &rows,
        );
    }
    for (stage, s) in &op.stages {
        if let Some(rows) = &s.log2_buckets {
            let _ = writeln!(
                out,
                "  {} histogram (a row holds from <= time < to):",
                stage.as_str().to_uppercase()
            );
            out.push_str(&histogram_view::render_buckets(rows, style));
        }
    }
}

/// Where `report` takes its IO from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Source {
    /// The running agent's recorder if an agent answers, else tracerd's own programs.
    Auto,
    /// Always tracerd's own programs (`--standalone`).
    Standalone,
    /// A window of the past, from the agent's recorder (`--since`, `--from`, `--to`).
    Window { from_unix_s: f64, to_unix_s: f64 },
}

impl Source {
    /// From the command line; times are read against now.
    pub fn from_args(
        since: Option<f64>,
        from: Option<&str>,
        to: Option<&str>,
        standalone: bool,
    ) -> Result<Source> {
        let now = capture::unix_now();
        let window = |from_unix_s: f64, to_unix_s: f64| {
            if from_unix_s >= to_unix_s {
                anyhow::bail!(
                    "the window from {} to {} is empty: --from must be before --to",
                    units::rfc3339(from_unix_s),
                    units::rfc3339(to_unix_s)
                );
            }
            Ok(Source::Window { from_unix_s, to_unix_s })
        };
        let time = |t: &str| units::parse_time(t, now).map_err(|e| anyhow::anyhow!(e));
        match (since, from) {
            (Some(span), _) => window(now - span, now),
            (None, Some(from)) => window(time(from)?, to.map_or(Ok(now), time)?),
            (None, None) if standalone => Ok(Source::Standalone),
            (None, None) => Ok(Source::Auto),
        }
    }
}

/// Where the IO comes from, and the agent's socket.
#[derive(Clone, Debug)]
pub struct Attach {
    pub source: Source,
    pub socket: PathBuf,
    /// A store to read instead of an agent (`--store`).
    pub store: Option<PathBuf>,
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

/// Where a window was read: the agent's socket, or a store's directory (offline).
#[derive(Clone, Copy, Debug)]
pub enum Origin<'a> {
    Agent(&'a Path),
    Store(&'a Path),
}

/// Captures for `duration` seconds (or until SIGINT), then prints the report, and with `save`
/// writes the capture for `tracerd diff`. With an agent running, its recorder is asked, and
/// no program is loaded.
pub async fn report(
    duration: f64,
    view: View,
    save: Option<&Path>,
    selection: Selection,
    opts: LoadOptions,
    attach: Attach,
) -> Result<()> {
    // Before tracing, so a bad path costs no capture.
    if let Some(path) = save {
        Capture::check_save_path(path)?;
        // Version-1 captures hold histograms of the default range only.
        if crate::model::aggregate::histogram_range() != crate::model::aggregate::HistogramRange::default() {
            anyhow::bail!(
                "--save writes histograms of the default range (100 ns to 60 s, 3 significant digits), \
                 and the config's [histogram] section sets another: remove it to save a capture"
            );
        }
    }
    let socket = attach.socket.as_path();
    if let Some(dir) = &attach.store {
        if view.by_qd {
            anyhow::bail!("{BY_QD_NEEDS_RECORDS}");
        }
        let (w, slowest) = store_window(dir, attach.source, view.by_cgroup.is_some())?;
        return window_report(w, view, save, &selection, Origin::Store(dir), Some(slowest))?.print(view);
    }
    match attach.source {
        Source::Window { from_unix_s, to_unix_s } => {
            if view.by_qd {
                anyhow::bail!("{BY_QD_NEEDS_RECORDS}");
            }
            let w = window(socket, from_unix_s, to_unix_s, view.by_cgroup.is_some())?;
            return show_window(w, view, save, &selection, socket);
        }
        Source::Auto => match api::call::<api::Status>(socket, &api::Request::Status {}, "status") {
            Ok(status) if !view.by_qd => {
                return match view.interval {
                    Some(every) => intervals_from_agent(every, view, &selection, socket, status).await,
                    None => report_from_agent(duration, view, save, &selection, socket, status).await,
                };
            }
            Ok(_) => tracing::info!("--by needs every IO's record: tracing with tracerd's own programs"),
            Err(api::AttachError::NoAgent(_)) => {}
            Err(e) => tracing::warn!("{e}; tracing with tracerd's own programs instead"),
        },
        Source::Standalone => {}
    }
    let mut session = Session::start(selection, &opts)?;
    if let Some(every) = view.interval {
        return intervals_standalone(&mut session, every, view).await;
    }
    let ops = session.tracer.ops;
    let base = session.lost()?;
    let mut agg = Aggregator::new(view.by_qd);
    let mut by_cgroup = ByCgroup::new(view.by_cgroup);
    let progress = std::io::stderr().is_terminal();
    let started = Instant::now();
    let started_unix_s = capture::unix_now();
    let deadline = tokio::time::sleep(Duration::from_secs_f64(duration));
    tokio::pin!(deadline);
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            r = session.read(|io, topo| {
                agg.add(io.target, ops.op(io.rec.cmd_flags), io.rec, io.layers, |d| topo.name_of(d));
                by_cgroup.add(io, ops.op(io.rec.cmd_flags), topo);
            }) => r?,
            _ = tick.tick() => {
                session.refresh_devices()?;
                if progress {
                    let ios: u64 = agg.series.values().map(|s| s.requests).sum();
                    eprint!("\rcapturing: {:.0}/{duration:.0} s, {ios} requests ", started.elapsed().as_secs_f64());
                }
            }
            _ = &mut deadline => break,
            _ = &mut shutdown => break,
        }
    }
    session.drain_now(|io, topo| {
        agg.add(io.target, ops.op(io.rec.cmd_flags), io.rec, io.layers, |d| topo.name_of(d));
        by_cgroup.add(io, ops.op(io.rec.cmd_flags), topo);
    });
    if progress {
        eprint!("\r\x1b[K");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let lost = Lost { series_limit: agg.over_limit, ..session.lost()?.since(&base) };
    let hooks = session.tracer.hooks.clone();
    let topo = session.topo.clone();
    drop(session);
    let kernel = kernel_release();
    let report = Report::build_with(&agg, &topo, &lost, &hooks, &kernel, elapsed, view.hist).with_cgroups(
        &by_cgroup.aggs,
        &topo,
        view.hist,
    );
    report.print(view)?;
    if let Some(path) = save {
        let meta = capture::Meta { kernel, host: capture::hostname(), started_unix_s, duration_s: elapsed };
        Capture::from_aggregate(&agg, &topo, &lost, meta).save(path)?;
        tracing::info!("capture saved to {}", path.display());
    }
    Ok(())
}

const NO_CGROUP_SERIES: &str = "--by cgroup: the agent keeps no per-cgroup series (set [cgroups] label in \
     its config); report the present with --standalone --duration SECS --by cgroup";

/// `--by cgroup`: an aggregate per cgroup label, beside the capture's own.
struct ByCgroup {
    form: Option<LabelForm>,
    names: Option<CgroupNames>,
    aggs: BTreeMap<String, Aggregator>,
}

impl ByCgroup {
    fn new(form: Option<LabelForm>) -> ByCgroup {
        ByCgroup { form, names: form.map(|_| CgroupNames::detect()), aggs: BTreeMap::new() }
    }

    fn add(&mut self, io: &Io, op: Op, topo: &Topology) {
        let (Some(form), Some(names)) = (self.form, &mut self.names) else { return };
        let label = match names.of(io.rec) {
            Named::Path(p) => form.label(&p),
            other => crate::commands::snoop::cgroup_text(&other).to_owned(),
        };
        self.aggs.entry(label).or_default().add(io.target, op, io.rec, io.layers, |d| topo.name_of(d));
    }
}

const BY_QD_NEEDS_RECORDS: &str = "--by qd needs every IO's record, and the agent's recorder keeps no \
     per-queue-depth tables: report the present with --standalone --by qd";

/// A window of the agent's recorder; an empty one is an error that says what the recorder holds.
pub fn window(socket: &Path, from_unix_s: f64, to_unix_s: f64, by_cgroup: bool) -> Result<api::WindowAnswer> {
    let request = api::Request::Window { from_unix_s, to_unix_s, by_cgroup };
    let w: api::WindowAnswer = api::call(socket, &request, "window").map_err(|e| match e {
        api::AttachError::NoAgent(_) => anyhow::anyhow!(
            "{e}: windows of the past come from the agent's flight recorder, and no agent runs"
        ),
        e => e.into(),
    })?;
    if w.frames == 0 {
        let status: api::Status = api::call(socket, &api::Request::Status {}, "status")?;
        let holds = match (status.recorder.from_unix_s, status.recorder.to_unix_s) {
            (Some(a), Some(b)) => format!("it holds {} to {}", units::rfc3339(a), units::rfc3339(b)),
            _ => "it holds nothing yet (the first frame ends a second after the agent starts)".into(),
        };
        anyhow::bail!(
            "the agent's recorder has no frame between {} and {}: {holds}",
            units::rfc3339(from_unix_s),
            units::rfc3339(to_unix_s)
        );
    }
    Ok(w)
}

/// A window of a store read offline (`report --store`): the window asked, or all of it, and
/// the slowest IOs of its minutes. An empty one is an error that says what the store holds.
fn store_window(
    dir: &Path,
    source: Source,
    by_cgroup: bool,
) -> Result<(api::WindowAnswer, Vec<crate::model::slowest::SlowMinute>)> {
    let mut store = crate::store::Store::open_read_only(dir)?;
    let Some((first, last)) = store.span() else {
        anyhow::bail!("the store {} holds no frame", dir.display());
    };
    let (from, to) = match source {
        Source::Window { from_unix_s, to_unix_s } => (from_unix_s, to_unix_s),
        _ => (first as f64 / 1e3, last as f64 / 1e3),
    };
    let (kernel, host) =
        store.newest_start().map_or_else(Default::default, |s| (s.kernel.clone(), s.host.clone()));
    let (slowest, bad) = store.plan_slow(from, to).slow_minutes();
    store.count_unreadable(bad);
    let mut recorder = crate::model::recorder::Recorder::default();
    recorder.attach_store(store);
    let window = recorder.window(api::window_ms(from), api::window_ms(to));
    if window.frames.is_empty() {
        anyhow::bail!(
            "the store {} has no frame between {} and {}: it holds {} to {}",
            dir.display(),
            units::rfc3339(from),
            units::rfc3339(to),
            units::rfc3339(first as f64 / 1e3),
            units::rfc3339(last as f64 / 1e3)
        );
    }
    let answer =
        api::window_answer(&window, from, by_cgroup, kernel, host).map_err(|e| anyhow::anyhow!(e))?;
    Ok((answer, crate::model::slowest::merge(slowest)))
}

/// `report --duration` beside a running agent: waits as long, then asks its recorder for the
/// frames of that time. Nothing is loaded into the kernel.
async fn report_from_agent(
    duration: f64,
    view: View,
    save: Option<&Path>,
    selection: &Selection,
    socket: &Path,
    status: api::Status,
) -> Result<()> {
    let started = capture::unix_now();
    tracing::info!(
        "reading from the running agent (pid {}) on {}: no programs loaded (--standalone loads them)",
        status.pid,
        socket.display()
    );
    let deadline = tokio::time::sleep(Duration::from_secs_f64(duration));
    tokio::pin!(deadline);
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    tokio::select! {
        _ = &mut deadline => {}
        _ = &mut shutdown => {}
    }
    let ended = capture::unix_now();
    sealed(socket, ended, status.recorder.resolution_s).await?;
    show_window(window(socket, started, ended, view.by_cgroup.is_some())?, view, save, selection, socket)
}

/// Waits until the agent has sealed the frame that holds `until`: within one resolution and a
/// tick; after a few seconds more, what it has is taken.
async fn sealed(socket: &Path, until: f64, resolution_s: f64) -> Result<()> {
    let patience = Instant::now() + Duration::from_secs_f64(resolution_s + 3.0);
    loop {
        let now: api::Status = api::call(socket, &api::Request::Status {}, "status")?;
        if now.recorder.to_unix_s.is_some_and(|t| t >= until) || Instant::now() > patience {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `report --interval` beside a running agent: each interval is the agent's frames after the
/// last one shown, so intervals never share a frame; each prints its own span.
async fn intervals_from_agent(
    every: Interval,
    view: View,
    selection: &Selection,
    socket: &Path,
    status: api::Status,
) -> Result<()> {
    tracing::info!(
        "reading from the running agent (pid {}) on {}: a report every {} s",
        status.pid,
        socket.display(),
        every.secs
    );
    let resolution = status.recorder.resolution_s;
    if every.secs < resolution {
        anyhow::bail!(
            "the agent's frames are {resolution} s long: give --interval {resolution} or more (or --standalone)"
        );
    }
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    // Intervals start where the agent's frame in progress started, and each ends half a frame
    // short of its length: the frames overlapping it are then those that start in it, one
    // interval's frames follow the last one's, and none is taken twice.
    let (mut from, mut shown) = (status.recorder.to_unix_s.unwrap_or_else(capture::unix_now), 0);
    loop {
        let until = from + every.secs - resolution / 2.0;
        let wait = Duration::from_secs_f64((until - capture::unix_now()).max(0.0));
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = &mut shutdown => return Ok(()),
        }
        sealed(socket, until, resolution).await?;
        let request = api::Request::Window { from_unix_s: from, to_unix_s: until, by_cgroup: false };
        let w: api::WindowAnswer = api::call(socket, &request, "window")?;
        from = if w.frames > 0 { w.to_unix_s } else { until + resolution / 2.0 };
        window_report(w, view, None, selection, Origin::Agent(socket), None)?.print_interval(view)?;
        shown += 1;
        if every.count == Some(shown) {
            return Ok(());
        }
    }
}

/// `report --interval` with tracerd's own programs: the aggregate is printed and started
/// afresh every interval.
async fn intervals_standalone(session: &mut Session, every: Interval, view: View) -> Result<()> {
    let ops = session.tracer.ops;
    let mut rolling = Rolling::new(session, view.by_qd)?;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(every.secs));
    tick.tick().await;
    let mut rescan = tokio::time::interval(Duration::from_secs(1));
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let mut shown = 0;
    loop {
        let last = tokio::select! {
            r = session.read(|io, topo| rolling.add(io, topo, &ops)) => {
                r?;
                continue;
            }
            _ = rescan.tick() => {
                session.refresh_devices()?;
                continue;
            }
            _ = tick.tick() => false,
            // Interrupted: the interval so far is printed too, as biolatency does.
            _ = &mut shutdown => {
                session.drain_now(|io, topo| rolling.add(io, topo, &ops));
                true
            }
        };
        rolling.roll(session, view.hist)?.print_interval(view)?;
        shown += 1;
        if last || every.count == Some(shown) {
            return Ok(());
        }
    }
}

/// An aggregate reported and started afresh every interval (`report --interval`, `top`).
pub struct Rolling {
    agg: Aggregator,
    /// Per-cgroup aggregates too, once asked for (`top`'s `c`).
    cgroups: ByCgroup,
    /// The lost-event counters when the interval began.
    base: Lost,
    started: Instant,
    kernel: String,
}

impl Rolling {
    pub fn new(session: &Session, by_qd: bool) -> Result<Rolling> {
        Ok(Rolling {
            agg: Aggregator::new(by_qd),
            cgroups: ByCgroup::new(None),
            base: session.lost()?,
            started: Instant::now(),
            kernel: kernel_release(),
        })
    }

    pub fn add(
        &mut self,
        io: &crate::kernel::session::Io,
        topo: &Topology,
        ops: &crate::model::op::OpDecoder,
    ) {
        self.agg.add(io.target, ops.op(io.rec.cmd_flags), io.rec, io.layers, |d| topo.name_of(d));
        self.cgroups.add(io, ops.op(io.rec.cmd_flags), topo);
    }

    /// Splits the following intervals per cgroup too (labelled by path), or stops.
    pub fn by_cgroup(&mut self, on: bool) {
        if on != self.cgroups.form.is_some() {
            self.cgroups = ByCgroup::new(on.then_some(LabelForm::Path));
        }
    }

    /// The interval so far as a report; the next one begins.
    pub fn roll(&mut self, session: &Session, hist: Option<Stage>) -> Result<Report> {
        let now = session.lost()?;
        let lost = Lost { series_limit: self.agg.over_limit, ..now.since(&self.base) };
        let elapsed = self.started.elapsed().as_secs_f64();
        let report = Report::build_with(
            &self.agg,
            &session.topo,
            &lost,
            &session.tracer.hooks,
            &self.kernel,
            elapsed,
            hist,
        )
        .with_cgroups(&std::mem::take(&mut self.cgroups.aggs), &session.topo, hist);
        (self.agg, self.base, self.started) = (Aggregator::new(self.agg.by_qd), now, Instant::now());
        Ok(report)
    }
}

/// Prints (and saves) a window of the agent's recorder, for the devices selected.
fn show_window(
    w: api::WindowAnswer,
    view: View,
    save: Option<&Path>,
    selection: &Selection,
    socket: &Path,
) -> Result<()> {
    let request = api::Request::Slowest { from_unix_s: w.from_unix_s, to_unix_s: w.to_unix_s };
    let slowest = api::call(socket, &request, "slowest")?;
    window_report(w, view, save, selection, Origin::Agent(socket), Some(slowest))?.print(view)
}

/// A window of the agent's recorder as a report of the devices selected (`top`), per cgroup
/// too when the window has them.
pub fn window_report_for(w: api::WindowAnswer, selection: &Selection, socket: &Path) -> Result<Report> {
    let by_cgroup = (!w.by_cgroup.is_empty()).then_some(LabelForm::Path);
    window_report(w, View { by_cgroup, ..View::default() }, None, selection, Origin::Agent(socket), None)
}

/// A window of the agent's recorder (or a store) as a report of the devices selected (and
/// saved), with their slowest IOs of the window's minutes where they were asked for.
fn window_report(
    w: api::WindowAnswer,
    view: View,
    save: Option<&Path>,
    selection: &Selection,
    origin: Origin,
    slowest: Option<Vec<crate::model::slowest::SlowMinute>>,
) -> Result<Report> {
    let mut capture = w.capture;
    select_devices(&mut capture, selection)?;
    if let Some(path) = save {
        capture.save(path)?;
        tracing::info!("capture saved to {}", path.display());
    }
    let (agg, topo, lost) = capture.to_aggregate();
    let mut report =
        Report::build_with(&agg, &topo, &lost, &[], &capture.kernel, capture.duration_s, view.hist);
    if view.by_cgroup.is_some() {
        if w.by_cgroup.is_empty() && !capture.devices.is_empty() {
            anyhow::bail!("{NO_CGROUP_SERIES}");
        }
        let mut aggs = BTreeMap::new();
        for (label, mut c) in w.by_cgroup {
            select_devices(&mut c, selection)?;
            aggs.insert(label, c.to_aggregate().0);
        }
        report = report.with_cgroups(&aggs, &topo, view.hist);
    }
    if let Some(slowest) = slowest {
        let shown: Vec<&str> = capture.devices.iter().map(|d| d.device.as_str()).collect();
        report.slowest = slowest.into_iter().filter(|m| shown.contains(&m.device.as_str())).collect();
    }
    let (socket, store) = match origin {
        Origin::Agent(p) => (Some(p.to_owned()), None),
        Origin::Store(p) => (None, Some(p.to_owned())),
    };
    report.from_agent = Some(FromAgent {
        socket,
        store,
        from_unix_s: w.from_unix_s,
        to_unix_s: w.to_unix_s,
        frames: w.frames,
        gaps: w.gaps,
        damaged_frames: w.damaged_frames,
    });
    Ok(report)
}

/// Keeps the devices `--device` names (with the devices below them) and drops excluded ones.
/// A name neither in the window nor on the host is an error, as when tracing.
fn select_devices(capture: &mut Capture, selection: &Selection) -> Result<()> {
    let strip = |n: &str| n.strip_prefix("/dev/").unwrap_or(n).to_owned();
    let excluded = |n: &str| selection.exclude.iter().any(|p| crate::config::name_matches(p, n));
    if !selection.names.is_empty() {
        let host = Topology::scan().unwrap_or_default();
        let mut keep: Vec<String> = Vec::new();
        // Names as people type them (dm names, /dev/mapper/..., links) to the kernel's.
        let mut todo: Vec<String> = selection
            .names
            .iter()
            .map(|n| host.find(n).map_or_else(|| strip(n), |d| d.name.clone()))
            .collect();
        for name in &todo {
            if !capture.devices.iter().any(|d| &d.device == name) && host.by_name(name).is_none() {
                let mut known: Vec<String> = capture.devices.iter().map(|d| d.device.clone()).collect();
                known.extend(host.names());
                known.sort();
                known.dedup();
                anyhow::bail!(
                    "unknown block device '{name}': it is neither on this host nor in the window. Known devices: {}.",
                    known.join(", ")
                );
            }
        }
        while let Some(name) = todo.pop() {
            if keep.contains(&name) {
                continue;
            }
            if let Some(d) = capture.devices.iter().find(|d| d.device == name) {
                todo.extend(d.lowers.iter().cloned());
            }
            keep.push(name);
        }
        capture.devices.retain(|d| keep.contains(&d.device));
    }
    capture.devices.retain(|d| !excluded(&d.device));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
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
        assert_eq!(crate::style::strip(&coloured), r.render_text());
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
