//! The per-IO line: one completed request or merged bio as JSON (`SnoopLine`) or as a text
//! row under a header, built without allocation per IO. `snoop` prints it; the agent's stream
//! sends it.

use std::{collections::BTreeMap, io::Write};

use serde::{Deserialize, Serialize};
use tracer_common::{event, flag, kernel_ts, kind, own};

use crate::{
    kernel::record::comm,
    kernel::session::Io,
    model::ahead::Order,
    model::causes::{Wait, Waker, time_by_cause},
    model::cgroups::Named,
    model::layers::Phase,
    model::op::{Op, OpDecoder},
    model::stage::{Stage, path, path_letters},
    model::topology::Topology,
    units,
    view::style::Style,
};

/// One snoop line as JSON. Times are nanoseconds; `events_ns` are kernel monotonic timestamps.
#[derive(Debug, Serialize)]
pub struct SnoopLine<'a> {
    pub kind: &'static str,
    pub device: &'a str,
    /// Device the bio was submitted to (a partition, or the disk itself).
    pub submitted_to: Option<String>,
    pub op: Op,
    pub rwbs: String,
    pub sector: u64,
    pub bytes: u32,
    pub queue_depth: u32,
    pub pid: u32,
    pub comm: &'a str,
    /// The cgroup the IO is charged to: its path in its hierarchy ("?": it went before it
    /// was named; "": unknown), its id, and whose it is ("blkcg": the bio's own association;
    /// "task": the submitting task's v2 cgroup).
    pub cgroup: &'a str,
    pub cgroup_id: u64,
    pub cgroup_from: &'static str,
    pub path: String,
    pub requeued: bool,
    pub split: bool,
    /// An NVMe path request whose bios went back to the head, to another path.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub failed_over: bool,
    pub error: u32,
    pub events_ns: BTreeMap<&'static str, u64>,
    pub stages_ns: BTreeMap<Stage, u64>,
    /// The request's own timestamps (`start`: `rq->start_time_ns`, `io_start`:
    /// `rq->io_start_time_ns`), where the kernel set them; same clock as `events_ns`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub kernel_ns: BTreeMap<&'static str, u64>,
    /// The IO's key: a bio's address (lower IOs name it as `parent`) or a request's (a wait
    /// names it as the IO whose completion woke it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The upper bio this IO was remapped from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// An IO below a traced stacked device that names no upper IO: the kind of the stacked
    /// driver's own IO the kernel said it is (`parity`, `preread`, `resync`, `superblock`), else
    /// `unstated`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unlinked: Option<&'static str>,
    /// Time in the device's submit function and in the md personality.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub submit_ns: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub personality_ns: Option<u64>,
    /// Time in rq-qos policies inside Q2G, and which (config `rq_qos`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qos_wait_ns: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qos_policy: Option<String>,
    /// A stacked device's IO: its Q2C split against each device below.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<LayerLine>,
    /// Its submitter's waits inside its phases (config `causes`), in the order they ended.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub waits: Vec<WaitLine<'a>>,
    /// Its time by cause (`model::causes::time_by_cause`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub causes_ns: BTreeMap<&'static str, u64>,
    /// With `causes_ns`: the rest of its Q2C, which no cause explains.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unexplained_ns: Option<u64>,
    /// Requests that went ahead of it (config `causes`, tracerd's own programs): allocated
    /// between its Q and its G (`Q2G`), issued between its I and its D (`I2D`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub ahead: BTreeMap<Order, u32>,
}

/// One wait of an IO's submitter (`model::causes::Wait`), as JSON.
#[derive(Debug, Serialize)]
pub struct WaitLine<'a> {
    pub phase: &'static str,
    pub cause: &'static str,
    /// The function that waited (`blk_mq_get_tag`).
    pub function: Option<&'a str>,
    /// Off the CPU: from leaving it to running again.
    pub waited_ns: u64,
    pub slept_ns: u64,
    pub woken_ns: Option<u64>,
    pub ran_ns: u64,
    pub tid: u32,
    pub waker: WakerLine<'a>,
    /// The sleeper's whole stack, innermost first, where its function names no known cause.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub stack: &'a [String],
    /// The waits of the task that ended this one, inside it (a hand-off's layer thread, or the
    /// kworker a submitter waited for): the chain goes on there.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub thread: Vec<WaitLine<'a>>,
}

/// What ended a wait.
#[derive(Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WakerLine<'a> {
    /// The completion of this IO (its line's `device` and `id`; its C stamp).
    Io {
        device: Option<String>,
        id: String,
        completed_ns: u64,
    },
    Task {
        tid: u32,
        comm: &'a str,
        function: Option<&'a str>,
    },
    Interrupt {
        function: Option<&'a str>,
    },
    /// Preempted, not woken: the task that ran in its place.
    Preempted {
        tid: u32,
        comm: &'a str,
    },
    None,
}

impl<'a> WaitLine<'a> {
    pub fn of(w: &'a Wait, topo: &Topology) -> WaitLine<'a> {
        WaitLine {
            phase: w.phase.name(),
            cause: w.cause.name(),
            function: w.function.as_deref(),
            waited_ns: w.waited_ns(),
            slept_ns: w.slept_ns,
            woken_ns: w.woken_ns,
            ran_ns: w.ran_ns,
            tid: w.tid,
            waker: match &w.waker {
                Waker::Io { disk, id, completed_ns } => WakerLine::Io {
                    device: (*disk != 0).then(|| topo.name_of(*disk)),
                    id: format!("{id:#x}"),
                    completed_ns: *completed_ns,
                },
                Waker::Task { tid, comm, function } => {
                    WakerLine::Task { tid: *tid, comm, function: function.as_deref() }
                }
                Waker::Interrupt { function } => WakerLine::Interrupt { function: function.as_deref() },
                Waker::Preempted { tid, comm } => WakerLine::Preempted { tid: *tid, comm },
                Waker::None => WakerLine::None,
            },
            stack: &w.stack,
            thread: w.thread.iter().map(|t| WaitLine::of(t, topo)).collect(),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct LayerLine {
    pub lower: String,
    pub ios: u32,
    pub layer_ns: u64,
    pub lower_ns: u64,
    pub completion_ns: u64,
}

/// How snoop shows a named cgroup.
pub fn cgroup_text(named: &Named) -> &str {
    match named {
        Named::Path(p) => p,
        Named::Gone => "?",
        Named::Unknown => "",
    }
}

pub fn line<'a>(
    device: &'a str,
    io: &Io<'a>,
    ops: &OpDecoder,
    topo: &Topology,
    cgroup: &'a str,
) -> SnoopLine<'a> {
    let rec = io.rec;
    let mut stages_ns = BTreeMap::new();
    Stage::each_of(rec, |s, ns| {
        stages_ns.insert(s, ns);
    });
    let causes_ns: BTreeMap<&'static str, u64> =
        time_by_cause(io.waits).into_iter().map(|(c, ns)| (c.name(), ns)).collect();
    let unexplained_ns = match (causes_ns.is_empty(), stages_ns.get(&Stage::Q2c)) {
        (false, Some(q2c)) => Some(q2c.saturating_sub(causes_ns.values().sum())),
        _ => None,
    };
    let events_ns = [
        ("h", event::H),
        ("q", event::Q),
        ("g", event::G),
        ("i", event::I),
        ("d", event::D),
        ("c", event::C),
        ("m", event::M),
    ]
    .into_iter()
    .filter(|(_, e)| rec.ts[*e] != 0)
    .map(|(n, e)| (n, rec.ts[e]))
    .collect();
    let kernel_ns = [("start", kernel_ts::START), ("io_start", kernel_ts::IO_START)]
        .into_iter()
        .filter(|(_, k)| rec.kernel_ns[*k] != 0)
        .map(|(n, k)| (n, rec.kernel_ns[k]))
        .collect();
    SnoopLine {
        kind: match rec.kind {
            kind::MERGE => "merge",
            kind::BIO => "bio",
            _ => "request",
        },
        device,
        submitted_to: (rec.dev != 0).then(|| topo.name_of(rec.dev)),
        op: ops.op(rec.cmd_flags),
        rwbs: ops.rwbs(rec.cmd_flags),
        sector: rec.sector,
        bytes: rec.bytes,
        queue_depth: rec.queue_depth,
        pid: rec.pid,
        comm: comm(rec),
        cgroup,
        cgroup_id: rec.cgroup,
        // No id: the daemon named the task's cgroup from /proc (a slow IO of the agent).
        cgroup_from: if rec.flags & flag::CGROUP_TASK != 0 || rec.cgroup == 0 { "task" } else { "blkcg" },
        path: path(rec),
        requeued: rec.flags & flag::REQUEUED != 0,
        split: rec.flags & flag::SPLIT != 0,
        failed_over: rec.flags & flag::FAILOVER != 0,
        error: rec.error,
        events_ns,
        stages_ns,
        kernel_ns,
        id: (rec.id != 0).then(|| format!("{:#x}", rec.id)),
        parent: (rec.parent != 0).then(|| format!("{:#x}", rec.parent)),
        unlinked: (rec.flags & flag::UNLINKED != 0).then(|| own::name(rec.own)),
        submit_ns: (rec.submit_ns != 0).then_some(rec.submit_ns),
        personality_ns: (rec.personality_ns != 0).then_some(rec.personality_ns),
        qos_wait_ns: (rec.qos != 0).then_some(rec.qos_ns),
        qos_policy: (rec.qos != 0).then(|| crate::model::stage::qos_name(rec.qos)),
        layers: io
            .layers
            .iter()
            .map(|s| LayerLine {
                lower: topo.name_of(s.lower),
                ios: s.ios,
                layer_ns: s.phase_ns(Phase::Layer),
                lower_ns: s.phase_ns(Phase::Lower),
                completion_ns: s.phase_ns(Phase::Completion),
            })
            .collect(),
        waits: io.waits.iter().map(|w| WaitLine::of(w, topo)).collect(),
        causes_ns,
        unexplained_ns,
        ahead: io
            .ahead
            .map(|a| Order::ALL.into_iter().filter_map(|o| Some((o, o.count(a)?))).collect())
            .unwrap_or_default(),
    }
}

/// The cause that took most of a `snoop --json` line's time (its `causes_ns`), with that time.
pub fn main_cause(v: &serde_json::Value) -> Option<(&str, u64)> {
    let causes = v["causes_ns"].as_object().into_iter().flatten();
    causes.filter_map(|(c, ns)| Some((ns.as_u64()?, c.as_str()))).max().map(|(ns, c)| (c, ns))
}

/// Stages shown as text columns, in order.
const COLUMNS: [Stage; 8] =
    [Stage::H2q, Stage::Q2g, Stage::G2i, Stage::I2d, Stage::G2d, Stage::D2c, Stage::Q2c, Stage::Q2m];

/// One IO as a text line: borrowed and fixed-size fields only.
pub struct TextLine<'a> {
    pub device: &'a str,
    pub comm: &'a str,
    pub pid: u32,
    pub op: Op,
    pub rwbs: &'a str,
    pub sector: u64,
    pub bytes: u32,
    pub queue_depth: u32,
    /// The events that fired, as blktrace letters ("QGDC").
    pub path: ([u8; event::COUNT], usize),
    pub stages: [Option<u64>; COLUMNS.len()],
    pub error: u32,
    pub cgroup: &'a str,
    /// The cause that took most of its time, and that time (config `causes`).
    pub cause: Option<(&'a str, u64)>,
}

impl<'a> TextLine<'a> {
    /// A `snoop --json` line (as the agent streams them) as text; None if it is not one.
    pub fn from_json(v: &'a serde_json::Value) -> Option<TextLine<'a>> {
        let mut stages = [None; COLUMNS.len()];
        for (slot, stage) in stages.iter_mut().zip(COLUMNS) {
            *slot = v["stages_ns"][stage.as_str()].as_u64();
        }
        let path_text = v["path"].as_str()?.as_bytes();
        let mut path = ([0u8; event::COUNT], path_text.len().min(event::COUNT));
        path.0[..path.1].copy_from_slice(&path_text[..path.1]);
        Some(TextLine {
            device: v["device"].as_str()?,
            comm: v["comm"].as_str()?,
            pid: v["pid"].as_u64()? as u32,
            op: Op::deserialize(&v["op"]).ok()?,
            rwbs: v["rwbs"].as_str()?,
            sector: v["sector"].as_u64()?,
            bytes: v["bytes"].as_u64()? as u32,
            queue_depth: v["queue_depth"].as_u64()? as u32,
            path,
            stages,
            error: v["error"].as_u64()? as u32,
            cgroup: v["cgroup"].as_str().unwrap_or(""),
            cause: main_cause(v),
        })
    }

    pub fn of(device: &'a str, rwbs: &'a str, io: &Io<'a>, ops: &OpDecoder, cgroup: &'a str) -> TextLine<'a> {
        let rec = io.rec;
        let mut stages = [None; COLUMNS.len()];
        Stage::each_of(rec, |s, ns| {
            if let Some(i) = COLUMNS.iter().position(|&c| c == s) {
                stages[i] = Some(ns);
            }
        });
        TextLine {
            device,
            comm: comm(rec),
            pid: rec.pid,
            op: ops.op(rec.cmd_flags),
            rwbs,
            sector: rec.sector,
            bytes: rec.bytes,
            queue_depth: rec.queue_depth,
            path: path_letters(rec),
            stages,
            error: rec.error,
            cgroup,
            cause: time_by_cause(io.waits)
                .into_iter()
                .max_by_key(|(_, ns)| *ns)
                .map(|(c, ns)| (c.name(), ns)),
        }
    }
}

/// The column headings, bold where `style` colours.
/// `causes`: with the CAUSE column (config `causes`).
pub fn write_header(out: &mut dyn Write, style: Style, causes: bool) -> std::io::Result<()> {
    let mut h = format!(
        "{:<12} {:<15} {:>7} {:<10} {:<5} {:>12} {:>7} {:>4} {:<6}",
        "DEVICE", "COMM", "PID", "OP", "RWBS", "SECTOR", "BYTES", "QD", "PATH"
    );
    for s in COLUMNS {
        h.push_str(&format!(" {:>8}", s.as_str().to_uppercase()));
    }
    if causes {
        h.push_str(&format!(" {:<CAUSE_WIDTH$}", "CAUSE"));
    }
    // Last: a cgroup path has no useful width.
    h.push_str(" CGROUP");
    writeln!(out, "{}", style.bold(&h))
}

/// Writes IOs as lines of columns, built in one buffer kept from line to line: snoop's own CPU
/// per IO is its cost to the host, so a line takes no allocation, no formatting machinery and
/// no UTF-8 check of digits it wrote itself.
#[derive(Default)]
pub struct TextWriter {
    line: Vec<u8>,
    /// With the CAUSE column (config `causes`).
    pub causes: bool,
}

/// The CAUSE column: the longest cause name and a time ("journal_commit 999.9µs").
const CAUSE_WIDTH: usize = 22;

impl TextWriter {
    /// A writer, with the CAUSE column where `causes`.
    pub fn new(causes: bool) -> TextWriter {
        TextWriter { line: Vec::new(), causes }
    }

    /// One IO's line; an IO that completed with an error is red where `style` colours.
    pub fn write(&mut self, out: &mut dyn Write, l: &TextLine, style: Style) -> std::io::Result<()> {
        self.line.clear();
        columns(&mut self.line, l, self.causes);
        if l.error != 0 && style.is_on() {
            let red = style.red(&String::from_utf8_lossy(&self.line));
            self.line.clear();
            self.line.extend_from_slice(red.as_bytes());
        }
        self.line.push(b'\n');
        out.write_all(&self.line)
    }
}

/// The text columns, by hand: `write!` with widths pads a character at a time.
fn columns(out: &mut Vec<u8>, l: &TextLine, causes: bool) {
    text(out, l.device, 12, Align::Left);
    text(out, l.comm, 15, Align::Left);
    number(out, l.pid as u64, 7);
    text(out, l.op.as_str(), 10, Align::Left);
    text(out, l.rwbs, 5, Align::Left);
    number(out, l.sector, 12);
    number(out, l.bytes as u64, 7);
    number(out, l.queue_depth as u64, 4);
    // The path is blktrace letters (ASCII).
    padded(out, &l.path.0[..l.path.1], l.path.1, 6, Align::Left);
    for stage in l.stages {
        out.push(b' ');
        let mut buf = [0; 32];
        let (bytes, chars) = match stage {
            Some(ns) => units::ns_text(ns, &mut buf),
            None => (&b"-"[..], 1),
        };
        padded(out, bytes, chars, 8, Align::Right);
    }
    out.push(b' ');
    if causes {
        match l.cause {
            Some((cause, ns)) => {
                let mut buf = [0; 32];
                let (time, time_chars) = units::ns_text(ns, &mut buf);
                out.extend_from_slice(cause.as_bytes());
                out.push(b' ');
                let chars = cause.len() + 1 + time_chars;
                padded(out, time, time_chars, time_chars + CAUSE_WIDTH.saturating_sub(chars), Align::Left);
            }
            None => padded(out, b"-", 1, CAUSE_WIDTH, Align::Left),
        }
        out.push(b' ');
    }
    out.extend_from_slice(if l.cgroup.is_empty() { b"-" } else { l.cgroup.as_bytes() });
}

enum Align {
    Left,
    Right,
}

/// `s` padded to `width` characters, then a space.
fn text(out: &mut Vec<u8>, s: &str, width: usize, align: Align) {
    // Characters are the bytes that do not continue one (UTF-8 continuation bytes are 10xxxxxx).
    let chars = s.bytes().filter(|b| b & 0xc0 != 0x80).count();
    padded(out, s.as_bytes(), chars, width, align);
    out.push(b' ');
}

/// `v` right-aligned to `width`, then a space.
fn number(out: &mut Vec<u8>, v: u64, width: usize) {
    let mut buf = [0; 20];
    let digits = units::digits(v, &mut buf);
    padded(out, digits, digits.len(), width, Align::Right);
    out.push(b' ');
}

/// `bytes`, `chars` characters wide, padded with spaces to `width` (a wider text is kept whole).
fn padded(out: &mut Vec<u8>, bytes: &[u8], chars: usize, width: usize, align: Align) {
    let fill = width.saturating_sub(chars);
    match align {
        Align::Left => {
            out.extend_from_slice(bytes);
            out.resize(out.len() + fill, b' ');
        }
        Align::Right => {
            out.resize(out.len() + fill, b' ');
            out.extend_from_slice(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(error: u32, style: Style) -> String {
        text_of("iogen", error, style)
    }

    fn text_of(comm: &str, error: u32, style: Style) -> String {
        text_with(comm, error, style, None)
    }

    /// With `cause`: the CAUSE column on, this IO's main cause in it.
    fn text_with(comm: &str, error: u32, style: Style, cause: Option<Option<(&str, u64)>>) -> String {
        let mut stages = [None; COLUMNS.len()];
        stages[5] = Some(12_345);
        let l = TextLine {
            device: "loop0",
            comm,
            pid: 42,
            op: Op::Read,
            rwbs: "R",
            sector: 8,
            bytes: 4096,
            queue_depth: 1,
            path: (*b"QGDC\0\0\0", 4),
            stages,
            error,
            cgroup: "/system.slice/a.service",
            cause: cause.flatten(),
        };
        let mut out = Vec::new();
        TextWriter::new(cause.is_some()).write(&mut out, &l, style).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn failed_ios_are_red_only_where_colour_is_on() {
        let ok = text(0, Style::PLAIN);
        assert!(
            ok.starts_with("loop0        iogen")
                && ok.ends_with("   12.3µs        -        - /system.slice/a.service\n"),
            "{ok:?}"
        );
        assert_eq!(text(0, Style::COLOR), ok, "a good IO is never coloured");
        assert_eq!(text(10, Style::PLAIN), ok);
        let failed = text(10, Style::COLOR);
        assert_eq!(failed, format!("\x1b[31m{}\x1b[39m\n", ok.trim_end_matches('\n')));
        let mut header = Vec::new();
        write_header(&mut header, Style::PLAIN, false).unwrap();
        let header = String::from_utf8(header).unwrap();
        assert!(header.starts_with("DEVICE       COMM") && header.ends_with(" CGROUP\n"), "{header:?}");
    }
    #[test]
    fn columns_line_up_under_the_header_in_characters() {
        let mut header = Vec::new();
        write_header(&mut header, Style::PLAIN, false).unwrap();
        let header = String::from_utf8(header).unwrap();
        let width = |s: &str| s[..s.rfind(' ').unwrap()].chars().count();
        // "ü" is two bytes and one character; "µs" too.
        for comm in ["iogen", "prüfer", "kworker/u8:1-ev"] {
            let line = text_of(comm, 0, Style::PLAIN);
            assert_eq!(width(&line), width(&header), "{line:?}\n{header:?}");
        }
    }

    #[test]
    fn the_cause_column_names_the_main_cause_and_lines_up() {
        let mut header = Vec::new();
        write_header(&mut header, Style::PLAIN, true).unwrap();
        let header = String::from_utf8(header).unwrap();
        assert!(header.ends_with(&format!(" {:<CAUSE_WIDTH$} CGROUP\n", "CAUSE")), "{header:?}");
        let width = |s: &str| s[..s.rfind(' ').unwrap()].chars().count();
        for cause in [None, Some(("tag", 412_000)), Some(("journal_commit", 999_900))] {
            let line = text_with("iogen", 0, Style::PLAIN, Some(cause));
            assert_eq!(width(&line), width(&header), "{line:?}\n{header:?}");
        }
        let line = text_with("iogen", 0, Style::PLAIN, Some(Some(("tag", 412_000))));
        assert!(line.contains(" tag 412.0µs "), "{line:?}");
        let none = text_with("iogen", 0, Style::PLAIN, Some(None));
        assert!(none.contains(&format!(" {:<CAUSE_WIDTH$} /system.slice", "-")), "{none:?}");
    }
}
