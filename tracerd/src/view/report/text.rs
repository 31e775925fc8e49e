//! A report as text: btt-style tables per device and op, stacks as trees, slowest IOs, the
//! interval view, and printing (text or JSON) to standard output.

use std::{collections::BTreeMap, fmt::Write as _, io::Write as _};

use anyhow::Result;

use crate::{model::capture, model::stage::Stage, units, view::histogram, view::style::Style};

use super::*;

impl Report {
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
            render_ahead(&mut out, d, style);
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
            let shown: Vec<_> =
                ios.iter().take(SLOWEST_SHOWN).map(|(minute, s)| (minute, s, s.io())).collect();
            // With causes (config `causes`): the cause that took most of each IO's time.
            let with_causes = shown.iter().any(|(_, _, v)| v["causes_ns"].is_object());
            let rows: Vec<Vec<String>> = shown
                .iter()
                .map(|(minute, s, v)| {
                    let ns = |stage: &str| {
                        v["stages_ns"][stage].as_u64().map_or("-".into(), |n| t(n as f64 / 1e9))
                    };
                    vec![
                        units::rfc3339(**minute as f64)[11..16].to_owned(),
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
                    .into_iter()
                    .chain(with_causes.then(|| main_cause(v)))
                    .collect()
                })
                .collect();
            let time = (Align::Right, 9);
            let mut columns = vec![
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
            ];
            let mut header =
                vec!["minute", "comm", "pid", "op", "bytes", "sector", "path", "Q2D", "D2C", "took"];
            if with_causes {
                columns.push((Align::Left, 20));
                header.push("main cause");
            }
            write_table(out, style, &columns, &header, &rows);
        }
    }

    /// To stdout: JSON, or the tables in the view's style.
    pub fn print(&self, view: View) -> Result<()> {
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
    pub fn print_interval(&self, view: View) -> Result<()> {
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

/// The waits by cause, with the Q2C time none explains.
fn render_waits(out: &mut String, op: &OpReport, style: Style) {
    let Some(unexplained_s) = op.unexplained_s else { return };
    let _ = writeln!(out, "  waits inside these IOs' phases, by cause (share of their Q2C time added up):");
    let share = |s: f64| format!("{:.1}%", 100.0 * s);
    let q2c_s: f64 = unexplained_s + op.waits.iter().map(|w| w.wait_s).sum::<f64>();
    let mut rows: Vec<Vec<String>> = op
        .waits
        .iter()
        .map(|w| {
            vec![
                w.phase.name().to_owned(),
                w.cause.name().to_owned(),
                w.waits.to_string(),
                t(w.wait_s),
                t(w.wait_s / w.waits.max(1) as f64),
                share(w.share_of_q2c),
            ]
        })
        .collect();
    let rest = if q2c_s > 0.0 { unexplained_s / q2c_s } else { 0.0 };
    rows.push(vec![
        String::new(),
        "unexplained".into(),
        String::new(),
        t(unexplained_s),
        String::new(),
        share(rest),
    ]);
    let right = (Align::Right, 9);
    write_table(
        out,
        style,
        &[(Align::Left, 6), (Align::Left, 13), right, right, right, (Align::Right, 7)],
        &["phase", "cause", "waits", "time", "mean", "share"],
        &rows,
    );
}

/// Who went ahead of the disk's waiting IOs: per waiting group, op and stage, the requests
/// allocated or issued while they waited, by group (the three largest, then the rest).
fn render_ahead(out: &mut String, d: &DeviceReport, style: Style) {
    let waited: Vec<_> = d.ahead.iter().filter(|r| r.waited > 0).collect();
    if waited.is_empty() {
        return;
    }
    let title =
        format!("{}: who went ahead of IOs that waited (for a tag: Q2G; in the scheduler: I2D)", d.label);
    let _ = writeln!(out, "\n{}", style.bold(&title));
    let pct = |n: u64, of: u64| format!("{:.1}%", 100.0 * n as f64 / of.max(1) as f64);
    let rows: Vec<Vec<String>> = waited
        .iter()
        .map(|r| {
            let mut by: Vec<String> =
                r.by.iter().take(3).map(|b| format!("{} {}", b.group, pct(b.requests, r.ahead))).collect();
            let rest: u64 = r.by.iter().skip(3).map(|b| b.requests).sum();
            if rest > 0 {
                by.push(format!("others {}", pct(rest, r.ahead)));
            }
            if r.unrecorded > 0 {
                by.push(format!("unrecorded {}", pct(r.unrecorded, r.ahead)));
            }
            if r.partial {
                by.push("(partial)".into());
            }
            vec![
                r.group.clone(),
                r.op.as_str().to_owned(),
                r.stage.stage().to_owned(),
                format!("{}/{}", r.waited, r.ios),
                r.ahead.to_string(),
                format!("{:.1}", r.ahead as f64 / r.waited.max(1) as f64),
                by.join(", "),
            ]
        })
        .collect();
    let right = (Align::Right, 9);
    write_table(
        out,
        style,
        &[
            (Align::Left, 12),
            (Align::Left, 5),
            (Align::Left, 5),
            (Align::Right, 13),
            right,
            right,
            (Align::Left, 0),
        ],
        &["waiting", "op", "stage", "waited/IOs", "ahead", "per IO", "ahead by"],
        &rows,
    );
}

/// The cause that took most of a slow IO's time (its `causes_ns`), with that time; `-` where
/// none did.
fn main_cause(io: &serde_json::Value) -> String {
    crate::view::io_line::main_cause(io)
        .map_or_else(|| "-".to_owned(), |(cause, ns)| format!("{cause} {}", t(ns as f64 / 1e9)))
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
    render_waits(out, op, style);
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
            out.push_str(&histogram::render_buckets(rows, style));
        }
    }
}
