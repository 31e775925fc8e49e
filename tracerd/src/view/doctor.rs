//! `tracerd doctor`'s findings and their text: each check's status, what was found and what
//! to do about it (the JSON output is a list of these), and one aligned line per check, then the
//! verdict, coloured by status through `Style`.

use serde::Serialize;

use crate::view::style::Style;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    /// Works, with something missing or unverified.
    Warn,
    /// tracerd cannot run here.
    Fail,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "FAIL",
        }
    }
}

/// One line of the report; the JSON output is an array of these.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Stable identifier for scripts: `btf`, `tracepoint:block_rq_issue`, `kprobe:md_submit_bio`.
    pub name: String,
    pub status: Status,
    /// What was found, and for a warn or FAIL what that costs.
    pub detail: String,
    /// What to do about it, where something can be done.
    pub advice: Option<String>,
}

impl Check {
    pub fn new(name: impl Into<String>, status: Status, detail: impl Into<String>) -> Check {
        Check { name: name.into(), status, detail: detail.into(), advice: None }
    }

    pub fn advice(mut self, advice: impl Into<String>) -> Check {
        self.advice = Some(advice.into());
        self
    }
}

/// Nothing FAILed (warnings pass).
pub fn passed(checks: &[Check]) -> bool {
    checks.iter().all(|c| c.status != Status::Fail)
}

/// The closing line: the verdict, and the first failure or the warnings.
pub fn summary(checks: &[Check]) -> String {
    let failed: Vec<&Check> = checks.iter().filter(|c| c.status == Status::Fail).collect();
    if let Some(first) = failed.first() {
        let more = match failed.len() {
            1 => String::new(),
            n => format!(" ({n} checks failed)"),
        };
        return format!("tracerd cannot run here: {}: {}{more}", first.name, first.detail);
    }
    let warned: Vec<&str> =
        checks.iter().filter(|c| c.status == Status::Warn).map(|c| c.name.as_str()).collect();
    match warned.len() {
        0 => "tracerd will work here: every check passed".to_owned(),
        n => format!(
            "tracerd will work here: {n} warning{} ({}), see above",
            if n == 1 { "" } else { "s" },
            warned.join(", ")
        ),
    }
}

/// `text` in its status' colour: a failure stands out most.
fn paint(style: Style, text: &str, status: Status) -> String {
    match status {
        Status::Ok => style.green(text),
        Status::Warn => style.yellow(text),
        Status::Fail => style.bold(&style.red(text)),
    }
}

/// One line per check (`status  name  detail -> advice`), then the summary.
pub fn render(checks: &[Check], style: Style) -> String {
    let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    let mut out = String::new();
    for c in checks {
        let label = paint(style, &format!("{:<4}", c.status.label()), c.status);
        out.push_str(&format!("{label}  {:<width$}  {}", c.name, c.detail));
        if let Some(advice) = &c.advice {
            out.push_str(" -> ");
            out.push_str(advice);
        }
        out.push('\n');
    }
    let verdict = if passed(checks) { Status::Ok } else { Status::Fail };
    out.push('\n');
    out.push_str(&paint(style, &summary(checks), verdict));
    out.push('\n');
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The check named `name`, for tests that look at one of many.
    pub fn find<'a>(checks: &'a [Check], name: &str) -> &'a Check {
        checks.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no {name} in {checks:?}"))
    }

    fn check(name: &str, status: Status) -> Check {
        Check::new(name, status, format!("{name} detail"))
    }

    #[test]
    fn render_aligns_names_appends_advice_and_colours_only_when_asked() {
        let checks = vec![
            check("kernel", Status::Ok),
            check("kprobes", Status::Warn).advice("use another kernel"),
            check("tracepoint:block_rq_issue", Status::Ok),
        ];
        let plain = render(&checks, Style::PLAIN);
        let lines: Vec<&str> = plain.lines().collect();
        assert_eq!(lines[0], "ok    kernel                     kernel detail");
        assert_eq!(lines[1], "warn  kprobes                    kprobes detail -> use another kernel");
        assert_eq!(lines[2], "ok    tracepoint:block_rq_issue  tracepoint:block_rq_issue detail");
        assert_eq!(lines[3], "");
        assert!(lines[4].starts_with("tracerd will work here"), "{}", lines[4]);
        assert!(!plain.contains('\x1b'), "no escapes without colour");
        let coloured = render(&checks, Style::COLOR);
        assert!(coloured.contains("\x1b[33mwarn\x1b[39m  kprobes "), "{coloured:?}");
        assert_eq!(coloured.lines().count(), lines.len());
    }

    #[test]
    fn fail_label_is_upper_case_and_json_has_the_four_fields() {
        let c = check("privileges", Status::Fail).advice("sudo");
        assert!(render(std::slice::from_ref(&c), Style::PLAIN).starts_with("FAIL  privileges"));
        let v: serde_json::Value = serde_json::to_value([c, check("kernel", Status::Ok)]).unwrap();
        assert_eq!(v[0]["name"], "privileges");
        assert_eq!(v[0]["status"], "fail");
        assert_eq!(v[0]["detail"], "privileges detail");
        assert_eq!(v[0]["advice"], "sudo");
        assert_eq!(v[1]["status"], "ok");
        assert!(v[1]["advice"].is_null());
    }

    #[test]
    fn summary_names_the_first_failure_and_warnings_keep_it_passing() {
        let all_ok = [check("kernel", Status::Ok), check("btf", Status::Ok)];
        assert!(passed(&all_ok));
        assert_eq!(summary(&all_ok), "tracerd will work here: every check passed");

        let warned =
            [check("kernel", Status::Ok), check("kprobes", Status::Warn), check("load", Status::Warn)];
        assert!(passed(&warned));
        assert_eq!(summary(&warned), "tracerd will work here: 2 warnings (kprobes, load), see above");

        let failed = [
            check("kernel", Status::Ok),
            check("privileges", Status::Fail),
            check("kprobes", Status::Warn),
            check("load", Status::Fail),
        ];
        assert!(!passed(&failed));
        assert_eq!(
            summary(&failed),
            "tracerd cannot run here: privileges: privileges detail (2 checks failed)"
        );
        assert!(render(&failed, Style::COLOR).ends_with(
            "\x1b[1m\x1b[31mtracerd cannot run here: privileges: privileges detail (2 checks failed)\x1b[39m\x1b[22m\n"
        ));
    }
}
