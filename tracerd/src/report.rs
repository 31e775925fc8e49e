//! `tracerd report`: a timed capture summarised as btt-style tables, or as JSON.
//! The JSON schema is documented in the README ("report --json").

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    io::{IsTerminal, Write as _},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::Result;
use serde::Serialize;

use crate::{
    aggregate::{Aggregator, Lost, OpStats, StageHist, Stages},
    capture::{self, Capture},
    hooks::HookStatus,
    layers::Phase,
    op::Op,
    selection::Selection,
    session::{Session, shutdown_signal},
    stage::Stage,
    topology::Topology,
    tracer::{LoadOptions, kernel_release},
    units,
};

pub const SCHEMA_VERSION: u32 = 1;

#[derive(Debug, Serialize)]
pub struct Report {
    pub schema_version: u32,
    pub kernel: String,
    pub duration_s: f64,
    pub devices: Vec<DeviceReport>,
    /// Lost events during the capture, by reason.
    pub lost: BTreeMap<&'static str, u64>,
    pub hooks: Vec<HookStatus>,
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
    pub iops: f64,
    pub bytes_per_second: f64,
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
        }
    }
}

fn summaries(stages: &Stages) -> BTreeMap<Stage, StageSummary> {
    Stage::ALL.iter().filter_map(|&s| Some((s, StageSummary::of(stages[s.index()].as_deref()?)))).collect()
}

fn path_name(mask: usize) -> String {
    "QGIDCM".chars().enumerate().filter(|(i, _)| mask & 1 << i != 0).map(|(_, c)| c).collect()
}

impl OpReport {
    fn build(op: Op, s: &OpStats, duration_s: f64, name: impl Fn(u32) -> String) -> OpReport {
        OpReport {
            op,
            requests: s.requests,
            bytes: s.bytes,
            merged_bios: s.merged_bios,
            errors: s.errors,
            iops: s.requests as f64 / duration_s,
            bytes_per_second: s.bytes as f64 / duration_s,
            paths: s
                .paths
                .iter()
                .enumerate()
                .filter(|(_, n)| **n > 0)
                .map(|(m, n)| (path_name(m), *n))
                .collect(),
            stages: summaries(&s.stages),
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
        let duration_s = duration_s.max(1e-9);
        let mut devices: Vec<DeviceReport> = Vec::new();
        for (device, op, stats) in agg.sorted() {
            let op_report = OpReport::build(op, stats, duration_s, |d| agg.name(d).to_owned());
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
        }
    }

    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "tracerd report: {:.1} s on kernel {}", self.duration_s, self.kernel);
        if self.devices.is_empty() {
            let _ = writeln!(out, "\nno IO completed on the traced devices during the capture.");
        }
        self.render_stacks(&mut out);
        for d in &self.devices {
            for op in &d.ops {
                render_op(&mut out, &d.label, op);
            }
        }
        let lost: Vec<String> =
            self.lost.iter().filter(|(_, n)| **n > 0).map(|(r, n)| format!("{r} {n}")).collect();
        let _ =
            writeln!(out, "\nlost events: {}", if lost.is_empty() { "none".into() } else { lost.join(", ") });
        for h in self.hooks.iter().filter(|h| !h.attached()) {
            let _ = writeln!(out, "skipped hook {}: {}", h.hook, h.reason.as_deref().unwrap_or("unknown"));
        }
        out
    }
}

impl Report {
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

fn render_op(out: &mut String, device: &str, op: &OpReport) {
    let _ = writeln!(
        out,
        "\n{device} {}: {} requests, {}, {:.1} IOPS, {}/s, {} merged bios, {} errors",
        op.op.as_str(),
        op.requests,
        units::bytes(op.bytes as f64),
        op.iops,
        units::bytes(op.bytes_per_second),
        op.merged_bios,
        op.errors
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
    let _ = writeln!(
        out,
        "  {:<6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "stage", "count", "mean", "p50", "p90", "p99", "p99.9", "max"
    );
    for (stage, s) in &op.stages {
        let t = |secs: f64| units::duration_ns(secs * 1e9);
        let _ = writeln!(
            out,
            "  {:<6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            stage.as_str().to_uppercase(),
            s.count,
            t(s.mean_s),
            t(s.p50_s),
            t(s.p90_s),
            t(s.p99_s),
            t(s.p999_s),
            t(s.max_s)
        );
    }
    if !op.layers.is_empty() {
        let _ = writeln!(
            out,
            "  per layer (Q2C = layer + lower + completion, IO by IO):\n  {:<10} {:>8} {:<11} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "lower", "ios", "phase", "mean", "p50", "p90", "p99", "max"
        );
        let t = |secs: f64| units::duration_ns(secs * 1e9);
        for l in &op.layers {
            for (i, (phase, s)) in l.phases.iter().enumerate() {
                let (name, ios) =
                    if i == 0 { (l.lower.as_str(), l.ios.to_string()) } else { ("", String::new()) };
                let _ = writeln!(
                    out,
                    "  {:<10} {:>8} {:<11} {:>9} {:>9} {:>9} {:>9} {:>9}",
                    name,
                    ios,
                    phase.as_str(),
                    t(s.mean_s),
                    t(s.p50_s),
                    t(s.p90_s),
                    t(s.p99_s),
                    t(s.max_s)
                );
            }
        }
    }
    for (function, s) in &op.submit_path {
        let t = |secs: f64| units::duration_ns(secs * 1e9);
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
        let _ = writeln!(
            out,
            "  by queue depth at issue:\n  {:>5} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "qd", "count", "Q2D mean", "Q2D p50", "Q2D p99", "D2C mean", "D2C p50", "D2C p99"
        );
        for qd in &op.by_queue_depth {
            let cell = |stage: Stage, f: fn(&StageSummary) -> f64| {
                qd.stages.get(&stage).map_or("-".to_string(), |s| units::duration_ns(f(s) * 1e9))
            };
            let count = qd.stages.get(&Stage::D2c).map_or(0, |s| s.count);
            let _ = writeln!(
                out,
                "  {:>5} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
                qd.queue_depth,
                count,
                cell(Stage::Q2d, |s| s.mean_s),
                cell(Stage::Q2d, |s| s.p50_s),
                cell(Stage::Q2d, |s| s.p99_s),
                cell(Stage::D2c, |s| s.mean_s),
                cell(Stage::D2c, |s| s.p50_s),
                cell(Stage::D2c, |s| s.p99_s),
            );
        }
    }
}

/// Captures for `duration` seconds (or until SIGINT), then prints the report, and with `save`
/// writes the capture for `tracerd diff`.
pub async fn report(
    duration: f64,
    json: bool,
    by_qd: bool,
    save: Option<&Path>,
    selection: Selection,
    opts: LoadOptions,
) -> Result<()> {
    // Before tracing, so a bad path costs no capture.
    if let Some(path) = save {
        Capture::check_save_path(path)?;
        // Version-1 captures hold histograms of the default range only.
        if crate::aggregate::histogram_range() != crate::aggregate::HistogramRange::default() {
            anyhow::bail!(
                "--save writes histograms of the default range (100 ns to 60 s, 3 significant digits),                  and the config's [histogram] section sets another: remove it to save a capture"
            );
        }
    }
    let mut session = Session::start(selection, &opts)?;
    let ops = session.tracer.ops;
    let base = session.lost()?;
    let mut agg = Aggregator::new(by_qd);
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
            r = session.read(|io, topo| agg.add(io.target, ops.op(io.rec.cmd_flags), io.rec, io.layers, |d| topo.name_of(d))) => r?,
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
        agg.add(io.target, ops.op(io.rec.cmd_flags), io.rec, io.layers, |d| topo.name_of(d))
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
    let report = Report::build(&agg, &topo, &lost, &hooks, &kernel, elapsed);
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        write!(out, "{}", report.render_text())?;
    }
    out.flush()?;
    if let Some(path) = save {
        let meta = capture::Meta { kernel, host: capture::hostname(), started_unix_s, duration_s: elapsed };
        Capture::from_aggregate(&agg, &topo, &lost, meta).save(path)?;
        tracing::info!("capture saved to {}", path.display());
    }
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

    #[test]
    fn text_shows_stacks_as_trees_with_layer_rows() {
        use crate::layers::LayerSplit;
        use crate::topology::tests::fake_stacked_sysfs;
        let dir = fake_stacked_sysfs(
            &[("ram0", "1:0", None, false), ("ram1", "1:1", None, false)],
            &[("md0", "9:0", &["ram0", "ram1"], None, Some("raid1"))],
        );
        let topo = Topology::scan_root(&dir.0).unwrap();
        let mut agg = Aggregator::new(false);
        let name = |d: u32| topo.name_of(d);
        let mut upper = IoRecord { kind: kind::BIO, submit_ns: 5000, ..Default::default() };
        (upper.ts[event::Q], upper.ts[event::C]) = (0, 10_000);
        let md0 = crate::topology::kernel_dev(9, 0);
        let (ram0, ram1) = (crate::topology::kernel_dev(1, 0), crate::topology::kernel_dev(1, 1));
        let splits = [
            LayerSplit { lower: ram0, ios: 1, layer_ns: 1000, lower_ns: 8000, completion_ns: 1000 },
            LayerSplit { lower: ram1, ios: 1, layer_ns: 2000, lower_ns: 7000, completion_ns: 1000 },
        ];
        agg.add(md0, Op::Write, &upper, &splits, name);
        let mut lower = IoRecord { kind: kind::BIO, parent: 1, ..Default::default() };
        (lower.ts[event::Q], lower.ts[event::C]) = (1000, 9000);
        agg.add(ram0, Op::Write, &lower, &[], name);
        agg.add(ram1, Op::Write, &lower, &[], name);
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
}
