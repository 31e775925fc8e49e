//! The guest's console protocol, read on the host: the markers `/init` and the scenarios print
//! (see `vm/guest/init.sh` and `vm/guest.rs`), the result sections between them, and the
//! kernel's own lines that the serial console interleaves with both. `cargo xtask vm-test` (its
//! checks of a run) and tests/tests/vm (the assertions) read a console only through here.
//!
//! A console here is the cleaned text `vm::qemu` writes: no carriage returns, no escapes.

/// `/init` printed its set-up failure: the rest of the line says which step.
pub const SETUP_FAILED: &str = "VM-SETUP-FAILED";
/// A guest step made no progress for the guest's hang bound: the rest of the line says which.
pub const HANG: &str = "VM-HANG";
/// Lines `/init` prints alone once the devices exist, and once the scenarios are done.
pub const SETUP_DONE: &str = "VM-SETUP-DONE";
pub const DONE: &str = "VM-DONE";

/// The first line that starts with `marker`.
pub fn line_starting<'a>(console: &'a str, marker: &str) -> Option<&'a str> {
    console.lines().find(|l| l.starts_with(marker))
}

/// Whether `marker` is a line of its own.
pub fn has_line(console: &str, marker: &str) -> bool {
    console.lines().any(|l| l == marker)
}

/// `uname -r` of the guest, from the `VM-BOOTED release ...` line.
pub fn release(console: &str) -> Option<&str> {
    let line = console.lines().find_map(|l| l.strip_prefix("VM-BOOTED "))?;
    Some(line.split_whitespace().next().unwrap_or_default())
}

/// What became of a scenario on this kernel.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome<'a> {
    /// It printed `VM-SCENARIO name` and ran.
    Ran,
    /// It did not run: the `VM-SKIPPED name: ...` line says which modules the kernel lacks.
    Skipped(&'a str),
    /// Neither: the guest never reached it, or it was not chosen.
    Silent,
}

pub fn outcome<'a>(console: &'a str, name: &str) -> Outcome<'a> {
    if console.lines().any(|l| l == format!("VM-SCENARIO {name}")) {
        return Outcome::Ran;
    }
    match console.lines().find(|l| l.starts_with(&format!("VM-SKIPPED {name}:"))) {
        Some(line) => Outcome::Skipped(line),
        None => Outcome::Silent,
    }
}

/// How long each scenario that ran took, in guest seconds, from its `VM-ELAPSED name start end`
/// line, in the order they ran.
pub fn scenario_seconds(console: &str) -> Vec<(&str, f64)> {
    console
        .lines()
        .filter_map(|l| {
            let mut f = l.strip_prefix("VM-ELAPSED ")?.split_whitespace();
            let (name, start, end) =
                (f.next()?, f.next()?.parse::<f64>().ok()?, f.next()?.parse::<f64>().ok()?);
            Some((name, end - start))
        })
        .collect()
}

/// Why a result section could not be read.
#[derive(Debug, PartialEq, Eq)]
pub enum SectionError {
    /// No `VM-RESULT-BEGIN name` line.
    Missing,
    /// A `VM-RESULT-BEGIN name` line but no `VM-RESULT-END name` after it.
    Unclosed,
}

/// The lines between `VM-RESULT-BEGIN name` and `VM-RESULT-END name`, without the kernel lines
/// that the serial console interleaved. A marker ends its line (trailing blanks aside) but need
/// not start it: a result whose last line has no newline puts the next marker at its end, and
/// the text before that marker still belongs to the result.
pub fn section_lines<'a>(console: &'a str, name: &str) -> Result<Vec<&'a str>, SectionError> {
    let (begin, end) = (format!("VM-RESULT-BEGIN {name}"), format!("VM-RESULT-END {name}"));
    let mut lines = console.lines().skip_while(|l| !l.trim_end().ends_with(&begin));
    lines.next().ok_or(SectionError::Missing)?;
    let mut out = Vec::new();
    for line in lines {
        let (text, last) = match line.trim_end().strip_suffix(&end) {
            Some("") => return Ok(out),
            Some(before) => (before, true),
            None => (line, false),
        };
        if !is_kernel_line(text) {
            out.push(text);
        }
        if last {
            return Ok(out);
        }
    }
    Err(SectionError::Unclosed)
}

/// [`section_lines`] joined by newlines; None if the guest never printed both markers.
pub fn result_section(console: &str, name: &str) -> Option<String> {
    section_lines(console, name).ok().map(|lines| lines.join("\n"))
}

/// The last `n` lines.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A kernel line of the form "[    1.234567] ..." (printk time stamps are on in Debian's kernel).
pub fn is_kernel_line(line: &str) -> bool {
    let Some((stamp, _)) = line.strip_prefix('[').and_then(|l| l.split_once("] ")) else {
        return false;
    };
    let Some((secs, frac)) = stamp.trim_start().split_once('.') else {
        return false;
    };
    !secs.is_empty()
        && secs.bytes().all(|b| b.is_ascii_digit())
        && frac.len() == 6
        && frac.bytes().all(|b| b.is_ascii_digit())
}

/// The lines around the first panic, BUG or oops the guest kernel printed, if any.
pub fn kernel_crash(console: &str) -> Option<String> {
    const SIGNS: &[&str] = &["Kernel panic", "BUG:", "Oops", "kernel BUG at", "general protection fault"];
    let lines: Vec<&str> = console.lines().collect();
    let first = lines.iter().position(|l| is_kernel_line(l) && SIGNS.iter().any(|s| l.contains(s)))?;
    let mut report = lines[first.saturating_sub(5)..(first + 50).min(lines.len())].join("\n");
    if console.contains("Attempted to kill init") {
        report.push_str("\n(/init exited: a guest script must end with `poweroff -f`)");
    }
    Some(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_section_skips_kernel_lines() {
        let console =
            "noise\nVM-RESULT-BEGIN a\n{\"x\":\n[    3.141592] md: md0 stopped.\n1}\nVM-RESULT-END a\n";
        assert_eq!(result_section(console, "a").as_deref(), Some("{\"x\":\n1}"));
        assert_eq!(result_section(console, "b"), None);
        assert_eq!(result_section("VM-RESULT-BEGIN a\nunterminated\n", "a"), None);
    }

    #[test]
    fn sections_whose_text_ends_without_a_newline() {
        let console =
            "errVM-RESULT-BEGIN a\nx\nlastVM-RESULT-END a\nVM-RESULT-BEGIN ab\ny\nVM-RESULT-END ab\n";
        assert_eq!(section_lines(console, "a"), Ok(vec!["x", "last"]));
        assert_eq!(section_lines(console, "ab"), Ok(vec!["y"]));
        assert_eq!(section_lines(console, "b"), Err(SectionError::Missing));
        assert_eq!(section_lines("VM-RESULT-BEGIN b\n", "b"), Err(SectionError::Unclosed));
    }

    #[test]
    fn scenario_outcomes() {
        let console = "VM-BOOTED 6.1.0-57-amd64 scenarios=all absent=raid1\nVM-SCENARIO md\n\
                       VM-SKIPPED md_parity: kernel 6.1.0-57-amd64 has no module raid456 \n";
        assert_eq!(release(console), Some("6.1.0-57-amd64"));
        assert_eq!(outcome(console, "md"), Outcome::Ran);
        assert!(matches!(outcome(console, "md_parity"), Outcome::Skipped(l) if l.ends_with("raid456 ")));
        assert_eq!(outcome(console, "dm_copy"), Outcome::Silent);
    }

    #[test]
    fn scenario_durations() {
        let console = "VM-SCENARIO md\nVM-ELAPSED md 10.50 70.25\n[   71.000000] md0: stopped\n\
                       VM-ELAPSED cut 80.0\nVM-ELAPSED nvme 80.00 81.5\n";
        assert_eq!(scenario_seconds(console), vec![("md", 59.75), ("nvme", 1.5)]);
    }

    #[test]
    fn kernel_lines() {
        assert!(is_kernel_line("[    0.000000] Linux version 6.1.0"));
        assert!(is_kernel_line("[12345.123456] BUG: kernel NULL pointer dereference"));
        assert!(!is_kernel_line("[1.5] json"));
        assert!(!is_kernel_line("BUG: printed by a script"));
    }

    #[test]
    fn crash_detection() {
        let ok = "[    1.000000] brd: module loaded\nBUG: not from the kernel\nVM-DONE\n";
        assert_eq!(kernel_crash(ok), None);
        let crashed =
            "[    1.000000] x\n[    2.000000] Kernel panic - not syncing: Attempted to kill init!\n";
        let report = kernel_crash(crashed).unwrap();
        assert!(report.contains("Kernel panic") && report.contains("poweroff -f"), "{report}");
    }
}
