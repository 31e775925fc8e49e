//! `tracerd top`'s screen: a row per device and op with its rates, queue depth and stage
//! percentiles, stacked devices as trees over the devices below them, sorted by the column
//! chosen; the keys that change it.
//!
//! The terminal is driven by ratatui (over crossterm): the maintained Rust terminal UI library,
//! whose `try_init`/`restore` enter and leave raw mode and the alternate screen and restore the
//! terminal from a panic hook too; tables and layout come with it.

use ratatui::{
    Frame,
    crossterm::event::{KeyCode, KeyModifiers},
    layout::{Constraint, Layout, Rect},
    style::{Color, Modifier, Style as Look},
    text::Line,
    widgets::{Block, Borders, Cell, Clear, Paragraph, Row, Table},
};

use crate::{
    model::capture,
    model::stage::Stage,
    units,
    view::report::{DeviceReport, OpReport, Report},
};

/// The stages `tab` cycles through for the two percentile columns.
const STAGES: [Stage; 8] =
    [Stage::H2q, Stage::Q2g, Stage::G2i, Stage::I2d, Stage::G2d, Stage::Q2d, Stage::D2c, Stage::Q2c];

/// What rows are sorted by (`s` cycles), largest first, names in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sort {
    Q2cP99,
    StageP99,
    Iops,
    Bytes,
    QueueDepth,
    /// The share of Q2C time its submitters waited (config `causes`).
    Waited,
    Name,
}

const SORTS: [Sort; 7] =
    [Sort::Q2cP99, Sort::StageP99, Sort::Iops, Sort::Bytes, Sort::QueueDepth, Sort::Waited, Sort::Name];

/// The view's state: what is shown and how.
pub struct View {
    stage: Stage,
    sort: Sort,
    pub paused: bool,
    /// Devices whose name holds this text (`/` to type it).
    filter: String,
    typing: bool,
    help: bool,
    color: bool,
    /// Where the numbers come from, for the title.
    pub source: String,
    pub report: Option<Report>,
    /// A row per device, op and cgroup (`c`).
    pub by_cgroup: bool,
    /// The main wait cause and its share in place of the percentile columns (`w`).
    waits: bool,
}

/// One row: a device and op, `depth` levels under the device stacked on it.
#[derive(Debug, PartialEq)]
struct RowData {
    depth: usize,
    device: String,
    label: String,
    /// The cgroup, in the view by cgroup.
    cgroup: Option<String>,
    op: &'static str,
    iops: f64,
    bytes_per_second: f64,
    queue_depth: Option<f64>,
    p50_s: Option<f64>,
    p99_s: Option<f64>,
    q2c_p99_s: Option<f64>,
    /// Of the Q2C time, the share waits explain, and the cause with the most and its share
    /// (config `causes`).
    waited: Option<f64>,
    main_wait: Option<(&'static str, f64)>,
}

impl RowData {
    fn of(depth: usize, d: &DeviceReport, op: &OpReport, stage: Stage) -> RowData {
        RowData {
            depth,
            device: d.device.clone(),
            label: d.label.clone(),
            cgroup: None,
            op: op.op.as_str(),
            iops: op.iops,
            bytes_per_second: op.bytes_per_second,
            queue_depth: op.queue_depth_mean,
            p50_s: op.stages.get(&stage).map(|s| s.p50_s),
            p99_s: op.stages.get(&stage).map(|s| s.p99_s),
            q2c_p99_s: op.stages.get(&Stage::Q2c).map(|s| s.p99_s),
            waited: op.unexplained_s.map(|_| op.waits.iter().map(|w| w.share_of_q2c).sum()),
            main_wait: op.waits.first().map(|w| (w.cause.name(), w.share_of_q2c)),
        }
    }

    /// The row's value for a sort (larger first).
    fn key(&self, sort: Sort) -> f64 {
        match sort {
            Sort::Q2cP99 => self.q2c_p99_s.unwrap_or(-1.0),
            Sort::StageP99 => self.p99_s.unwrap_or(-1.0),
            Sort::Iops => self.iops,
            Sort::Bytes => self.bytes_per_second,
            Sort::QueueDepth => self.queue_depth.unwrap_or(-1.0),
            Sort::Waited => self.waited.unwrap_or(-1.0),
            Sort::Name => 0.0,
        }
    }
}

impl View {
    /// Sorted by Q2C p99, D2C in the percentile columns, nothing shown yet.
    pub fn new(color: bool) -> View {
        View {
            stage: Stage::D2c,
            sort: Sort::Q2cP99,
            paused: false,
            filter: String::new(),
            typing: false,
            help: false,
            color,
            source: String::new(),
            report: None,
            by_cgroup: false,
            waits: false,
        }
    }

    fn sort_name(&self) -> String {
        match self.sort {
            Sort::Q2cP99 => "Q2C p99".into(),
            Sort::StageP99 => format!("{} p99", self.stage.as_str().to_uppercase()),
            Sort::Iops => "IOPS".into(),
            Sort::Bytes => "bytes/s".into(),
            Sort::QueueDepth => "queue depth".into(),
            Sort::Waited => "waited share".into(),
            Sort::Name => "name".into(),
        }
    }

    /// Rows in display order: the top devices of each stack sorted by the key of their
    /// largest op, each followed by the devices below it, indented.
    fn rows(&self) -> Vec<RowData> {
        let Some(report) = &self.report else { return vec![] };
        if self.by_cgroup {
            return self.cgroup_rows(report);
        }
        let shown = |d: &DeviceReport| self.filter.is_empty() || d.label.contains(&self.filter);
        let is_lower = |name: &str| report.devices.iter().any(|u| u.lowers.iter().any(|l| l == name));
        let mut tops: Vec<&DeviceReport> =
            report.devices.iter().filter(|d| !is_lower(&d.device) && shown(d)).collect();
        let best = |d: &DeviceReport| {
            d.ops.iter().map(|op| RowData::of(0, d, op, self.stage).key(self.sort)).fold(f64::MIN, f64::max)
        };
        if self.sort == Sort::Name {
            tops.sort_by(|a, b| a.device.cmp(&b.device));
        } else {
            tops.sort_by(|a, b| best(b).total_cmp(&best(a)).then(a.device.cmp(&b.device)));
        }
        let mut rows = Vec::new();
        for d in tops {
            self.tree(report, d, 0, &mut rows);
        }
        // A filter that names a lower device shows it on its own too.
        if !self.filter.is_empty() {
            for d in report.devices.iter().filter(|d| is_lower(&d.device) && shown(d)) {
                if !rows.iter().any(|r| r.device == d.device) {
                    self.tree(report, d, 0, &mut rows);
                }
            }
        }
        rows
    }

    /// A row per cgroup, device and op (no trees: a cgroup's IO on a stack is on each layer),
    /// the filter matching the cgroup or the device.
    fn cgroup_rows(&self, report: &Report) -> Vec<RowData> {
        let mut rows: Vec<RowData> = Vec::new();
        for c in &report.by_cgroup {
            for d in &c.devices {
                if !self.filter.is_empty()
                    && !d.label.contains(&self.filter)
                    && !c.cgroup.contains(&self.filter)
                {
                    continue;
                }
                for op in &d.ops {
                    let mut row = RowData::of(0, d, op, self.stage);
                    row.cgroup =
                        Some(if c.cgroup.is_empty() { "(unknown)".into() } else { c.cgroup.clone() });
                    rows.push(row);
                }
            }
        }
        if self.sort == Sort::Name {
            rows.sort_by(|a, b| (&a.cgroup, &a.device).cmp(&(&b.cgroup, &b.device)));
        } else {
            rows.sort_by(|a, b| b.key(self.sort).total_cmp(&a.key(self.sort)).then(a.cgroup.cmp(&b.cgroup)));
        }
        rows
    }

    fn tree(&self, report: &Report, d: &DeviceReport, depth: usize, rows: &mut Vec<RowData>) {
        rows.extend(d.ops.iter().map(|op| RowData::of(depth, d, op, self.stage)));
        for lower in &d.lowers {
            if let Some(l) = report.devices.iter().find(|x| &x.device == lower) {
                self.tree(report, l, depth + 1, rows);
            }
        }
    }

    /// Handles a key; true to quit.
    pub fn key(&mut self, code: KeyCode, modifiers: KeyModifiers) -> bool {
        if modifiers.contains(KeyModifiers::CONTROL) && code == KeyCode::Char('c') {
            return true;
        }
        if self.typing {
            match code {
                KeyCode::Enter => self.typing = false,
                KeyCode::Esc => (self.typing, self.filter) = (false, String::new()),
                KeyCode::Backspace => {
                    self.filter.pop();
                }
                KeyCode::Char(c) => self.filter.push(c),
                _ => {}
            }
            return false;
        }
        if self.help {
            self.help = false;
            return matches!(code, KeyCode::Char('q'));
        }
        match code {
            KeyCode::Char('q') | KeyCode::Esc => return true,
            KeyCode::Char('s') => {
                let at = SORTS.iter().position(|&s| s == self.sort).unwrap_or(0);
                self.sort = SORTS[(at + 1) % SORTS.len()];
            }
            KeyCode::Tab | KeyCode::Char('t') => {
                let at = STAGES.iter().position(|&s| s == self.stage).unwrap_or(0);
                self.stage = STAGES[(at + 1) % STAGES.len()];
            }
            // 0 is H2Q, before Q: 1-7 stay Q2G .. Q2C.
            KeyCode::Char(c @ '0'..='7') => self.stage = STAGES[c as usize - '0' as usize],
            KeyCode::Char('p') | KeyCode::Char(' ') => self.paused = !self.paused,
            KeyCode::Char('c') => self.by_cgroup = !self.by_cgroup,
            KeyCode::Char('w') => self.waits = !self.waits,
            KeyCode::Char('/') => (self.typing, self.filter) = (true, String::new()),
            KeyCode::Char('h') | KeyCode::Char('?') => self.help = true,
            _ => {}
        }
        false
    }

    fn look(&self, look: Look) -> Look {
        if self.color { look } else { Look::default() }
    }

    pub fn draw(&self, frame: &mut Frame) {
        let [title, table, footer] =
            Layout::vertical([Constraint::Length(1), Constraint::Min(3), Constraint::Length(1)])
                .areas(frame.area());
        let when = self.report.as_ref().and_then(|r| r.from_agent.as_ref()).map_or_else(
            || units::rfc3339(capture::unix_now())[11..19].to_owned(),
            |a| units::rfc3339(a.to_unix_s)[11..19].to_owned(),
        );
        let state = if self.paused { "  PAUSED" } else { "" };
        let filter = if self.filter.is_empty() && !self.typing {
            String::new()
        } else {
            format!("  filter: {}{}", self.filter, if self.typing { "_" } else { "" })
        };
        frame.render_widget(
            Paragraph::new(format!(
                "tracerd top {when}  {}  sort: {}{state}{filter}",
                self.source,
                self.sort_name()
            ))
            .style(self.look(Look::new().add_modifier(Modifier::BOLD))),
            title,
        );
        let stage = self.stage.as_str().to_uppercase();
        let (p50, p99) = match self.waits {
            true => ("MAIN WAIT".to_owned(), "SHARE".to_owned()),
            false => (format!("{stage} p50"), format!("{stage} p99")),
        };
        // By cgroup, the cgroup takes the room of the bytes column (80 columns hold the rest).
        let names: Vec<&str> = if self.by_cgroup {
            vec!["CGROUP", "DEVICE", "OP", "IOPS", "QD", &p50, &p99, "Q2C p99"]
        } else {
            vec!["DEVICE", "OP", "IOPS", "BYTES/S", "QD", &p50, &p99, "Q2C p99"]
        };
        let header = Row::new(names.into_iter().map(|h| Cell::from(h.to_owned())))
            .style(self.look(Look::new().add_modifier(Modifier::BOLD | Modifier::REVERSED)));
        let time = |s: Option<f64>| s.map_or("-".to_string(), |s| units::duration_ns(s * 1e9));
        let rows: Vec<Row> = self
            .rows()
            .into_iter()
            .map(|r| {
                let name = match r.depth {
                    0 => r.label.clone(),
                    n => format!("{}└─{}", "  ".repeat(n - 1), r.label),
                };
                let (first, second) = match &r.cgroup {
                    Some(c) => (units::keep_end(c, 20), name),
                    None => (name, r.op.to_owned()),
                };
                let middle = match &r.cgroup {
                    Some(_) => [r.op.to_owned(), format!("{:.0}", r.iops)],
                    None => [format!("{:.0}", r.iops), units::bytes(r.bytes_per_second)],
                };
                Row::new([
                    first,
                    second,
                    middle[0].clone(),
                    middle[1].clone(),
                    r.queue_depth.map_or("-".into(), |q| format!("{q:.1}")),
                    match self.waits {
                        true => r.main_wait.map_or("-".into(), |(cause, _)| cause.to_owned()),
                        false => time(r.p50_s),
                    },
                    match self.waits {
                        true => r.main_wait.map_or("-".into(), |(_, share)| format!("{:.0}%", share * 100.0)),
                        false => time(r.p99_s),
                    },
                    time(r.q2c_p99_s),
                ])
            })
            .collect();
        let widths = match (self.by_cgroup, self.waits) {
            (true, false) => [20, 8, 6, 7, 5, 9, 9, 9],
            (false, false) => [16, 7, 8, 9, 5, 9, 9, 9],
            // The longest cause name (journal_commit) and its share.
            (true, true) => [19, 7, 6, 7, 5, 14, 5, 9],
            (false, true) => [15, 7, 8, 9, 5, 14, 5, 9],
        }
        .map(Constraint::Length);
        let empty = rows.is_empty();
        frame.render_widget(Table::new(rows, widths).header(header), table);
        if empty {
            let why = if self.report.is_none() {
                "waiting for the first second..."
            } else if self.by_cgroup && self.source.starts_with("agent") {
                "no IO, or the agent keeps no per-cgroup series (its config's [cgroups] label)"
            } else {
                "no IO on the traced devices"
            };
            frame.render_widget(Paragraph::new(why), Rect { y: table.y + 1, height: 1, ..table });
        }
        let lost: Vec<String> = self
            .report
            .iter()
            .flat_map(|r| r.lost.iter().filter(|(_, n)| **n > 0).map(|(k, n)| format!("{k} {n}")))
            .collect();
        let (lost, look) = if lost.is_empty() {
            ("lost: none".to_string(), Look::default())
        } else {
            (format!("lost: {}", lost.join(", ")), Look::new().fg(Color::Red))
        };
        frame.render_widget(
            Paragraph::new(Line::from(format!(
                "{lost}  q quit  s sort  tab stage  c cgroups  w waits  / filter  p pause  h help"
            )))
            .style(self.look(look)),
            footer,
        );
        if self.help {
            let text = "tracerd top: one row per device and op, a second at a time\n\n\
                        s      sort by: Q2C p99, stage p99, IOPS, bytes/s, queue depth, waited, name\n\
                        tab    the stage of the two percentile columns (0: H2Q, 1-7: Q2G .. Q2C)\n\
                        c      a row per cgroup, device and op (again: per device)\n\
                        w      the cause most Q2C time waited for, and its share (--causes)\n\
                        /      show devices whose name holds a text (Enter keeps it, Esc clears)\n\
                        p      pause (space too)\n\
                        q      quit (Esc, Ctrl-C too)\n\n\
                        Stacked devices (md, dm) are shown over the devices below them.\n\
                        any key closes this help";
            let area = Rect { x: 1, y: 2, width: frame.area().width.saturating_sub(2).min(78), height: 14 }
                .intersection(frame.area());
            frame.render_widget(Clear, area);
            frame.render_widget(
                Paragraph::new(text).block(Block::default().borders(Borders::ALL).title("help")),
                area,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{model::capture::tests::capture, model::op::Op};

    fn view(report: Report) -> View {
        View { report: Some(report), ..View::new(false) }
    }

    fn report() -> Report {
        let (agg, topo, lost) = capture(300).to_aggregate();
        Report::build(&agg, &topo, &lost, &[], "6.18", 1.0)
    }

    #[test]
    fn keys_sort_switch_stage_filter_pause_and_quit() {
        let mut v = view(report());
        let rows = v.rows();
        assert!(rows.iter().any(|r| r.device == "loop0" && r.op == Op::Read.as_str()), "{rows:?}");
        assert!(!v.key(KeyCode::Char('s'), KeyModifiers::NONE));
        assert_eq!(v.sort, Sort::StageP99);
        for _ in 0..SORTS.len() - 1 {
            v.key(KeyCode::Char('s'), KeyModifiers::NONE);
        }
        assert_eq!(v.sort, Sort::Q2cP99, "s cycles through every sort");
        v.key(KeyCode::Tab, KeyModifiers::NONE);
        assert_eq!(v.stage, Stage::Q2c);
        v.key(KeyCode::Char('1'), KeyModifiers::NONE);
        assert_eq!(v.stage, Stage::Q2g);
        v.key(KeyCode::Char('p'), KeyModifiers::NONE);
        assert!(v.paused);
        v.key(KeyCode::Char('/'), KeyModifiers::NONE);
        for c in "dm".chars() {
            v.key(KeyCode::Char(c), KeyModifiers::NONE);
        }
        assert!(!v.key(KeyCode::Char('q'), KeyModifiers::NONE), "q is text while typing a filter");
        v.key(KeyCode::Backspace, KeyModifiers::NONE);
        v.key(KeyCode::Enter, KeyModifiers::NONE);
        assert_eq!(v.filter, "dm");
        assert!(v.rows().iter().all(|r| r.label.contains("dm")), "{:?}", v.rows());
        v.key(KeyCode::Char('h'), KeyModifiers::NONE);
        assert!(v.help);
        assert!(!v.key(KeyCode::Char('x'), KeyModifiers::NONE) && !v.help, "any key closes help");
        assert!(v.key(KeyCode::Char('q'), KeyModifiers::NONE));
        assert!(v.key(KeyCode::Char('c'), KeyModifiers::CONTROL));
    }

    #[test]
    fn c_shows_a_row_per_cgroup_device_and_op() {
        let (agg, topo, lost) = capture(300).to_aggregate();
        let (few, _, _) = capture(10).to_aggregate();
        let long = format!("/kubepods.slice/{}/cri-containerd-abc.scope", "x".repeat(40));
        let cgroups = [("/a".to_owned(), agg.clone()), (long.clone(), few)].into_iter().collect();
        let r = Report::build(&agg, &topo, &lost, &[], "6.18", 1.0).with_cgroups(&cgroups, &topo, None);
        let mut v = view(r);
        let per_device = v.rows().len();
        v.key(KeyCode::Char('c'), KeyModifiers::NONE);
        let rows = v.rows();
        assert_eq!(rows.len(), 2 * per_device, "{rows:?}");
        assert!(rows.iter().all(|r| r.depth == 0 && r.cgroup.is_some()));
        // Sorted by Q2C p99 across cgroups; `/` filters on the cgroup too.
        v.key(KeyCode::Char('/'), KeyModifiers::NONE);
        for ch in "cri-".chars() {
            v.key(KeyCode::Char(ch), KeyModifiers::NONE);
        }
        v.key(KeyCode::Enter, KeyModifiers::NONE);
        assert!(v.rows().iter().all(|r| r.cgroup.as_deref() == Some(long.as_str())), "{:?}", v.rows());
        assert_eq!(units::keep_end(&long, 20).chars().count(), 20);
        assert!(
            units::keep_end(&long, 20).starts_with('…') && units::keep_end(&long, 20).ends_with("abc.scope")
        );
        v.key(KeyCode::Char('c'), KeyModifiers::NONE);
        assert!(v.rows().iter().all(|r| r.cgroup.is_none()), "c again: per device");
    }

    #[test]
    fn w_shows_the_main_wait_cause_and_its_share_and_sorts_by_what_waited() {
        use ratatui::{Terminal, backend::TestBackend};
        // The capture's loop0 reads waited for tags, dm-0 less (`capture::tests::aggregate`).
        let mut v = view(report());
        let loop0 = v.rows().into_iter().find(|r| r.device == "loop0" && r.op == "read").unwrap();
        let (cause, share) = loop0.main_wait.expect("loop0 reads waited");
        assert_eq!(cause, "tag");
        assert!(share > 0.0 && loop0.waited == Some(share), "{loop0:?}");
        v.sort = Sort::Waited;
        assert_eq!(v.rows()[0].device, "loop0", "what waited most first");
        v.key(KeyCode::Char('w'), KeyModifiers::NONE);
        let mut t = Terminal::new(TestBackend::new(80, 12)).unwrap();
        t.draw(|f| v.draw(f)).unwrap();
        let screen: String = t.backend().buffer().content().iter().map(|c| c.symbol()).collect();
        assert!(screen.contains("MAIN WAIT") && screen.contains("tag"), "{screen}");
        v.key(KeyCode::Char('w'), KeyModifiers::NONE);
        t.draw(|f| v.draw(f)).unwrap();
        let screen: String = t.backend().buffer().content().iter().map(|c| c.symbol()).collect();
        assert!(!screen.contains("MAIN WAIT") && screen.contains("D2C p50"), "w again: percentiles");
    }

    #[test]
    fn stacks_are_trees_and_sorting_orders_the_tops() {
        let mut c = capture(300);
        c.devices[0].lowers = vec!["loop0".into()]; // dm-0 over loop0
        let (agg, topo, lost) = c.to_aggregate();
        let mut v = view(Report::build(&agg, &topo, &lost, &[], "6.18", 1.0));
        let rows = v.rows();
        let order: Vec<(usize, &str)> = rows.iter().map(|r| (r.depth, r.device.as_str())).collect();
        assert_eq!(order[0], (0, "dm-0"), "{order:?}");
        assert!(order[1..].iter().all(|&(d, n)| (d, n) == (1, "loop0")), "{order:?}");
        v.sort = Sort::Name;
        assert_eq!(v.rows()[0].device, "dm-0");
    }
}
