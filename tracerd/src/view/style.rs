//! Terminal emphasis with plain ANSI escapes, and the one rule for when to use it.
//!
//! Colour only when it cannot end up in a file or a pipe, and when the user has not opted out:
//! `--color auto` (the default) colours when the stream is a terminal, `NO_COLOR` is unset or
//! empty (<https://no-color.org>) and `TERM` is not `dumb`. `--color always` and `--color never`
//! override all three (a command-line flag wins over the environment, as no-color.org asks).
//! Uncoloured output is exactly the text without escapes: every method returns its input as is.

use std::ffi::OsStr;

use clap::ValueEnum;

/// When to colour text output (`--color`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum ColorWhen {
    /// Only on a terminal, unless NO_COLOR is set or TERM is dumb.
    #[default]
    Auto,
    /// Always, even into a pipe or file.
    Always,
    /// Never.
    Never,
}

/// Whether to emphasise; `Copy` so renderers take it by value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Style {
    on: bool,
}

/// Decides colour from the flag, whether the stream is a terminal, and `NO_COLOR` and `TERM`
/// (passed in, so the rule is testable without a terminal).
pub fn enabled(when: ColorWhen, is_terminal: bool, no_color: Option<&OsStr>, term: Option<&OsStr>) -> bool {
    match when {
        ColorWhen::Always => true,
        ColorWhen::Never => false,
        ColorWhen::Auto => {
            is_terminal
                && no_color.is_none_or(OsStr::is_empty)
                && term.is_none_or(|t| t != OsStr::new("dumb"))
        }
    }
}

impl Style {
    /// No emphasis at all.
    pub const PLAIN: Style = Style { on: false };
    /// Always emphasise (`--color always`, and tests).
    pub const COLOR: Style = Style { on: true };

    /// The style for a stream, by the rule above and this process's environment.
    pub fn detect(when: ColorWhen, is_terminal: bool) -> Style {
        let (no_color, term) = (std::env::var_os("NO_COLOR"), std::env::var_os("TERM"));
        Style { on: enabled(when, is_terminal, no_color.as_deref(), term.as_deref()) }
    }

    /// The style for standard output.
    pub fn stdout(when: ColorWhen) -> Style {
        Style::detect(when, std::io::IsTerminal::is_terminal(&std::io::stdout()))
    }

    pub fn is_on(self) -> bool {
        self.on
    }

    /// `s` between an SGR code and the code that ends only that attribute, so that styles nest
    /// (a red word inside a bold line leaves the rest of the line bold).
    fn wrap(self, s: &str, start: &str, end: &str) -> String {
        if self.on && !s.is_empty() { format!("\x1b[{start}m{s}\x1b[{end}m") } else { s.to_owned() }
    }

    pub fn bold(self, s: &str) -> String {
        self.wrap(s, "1", "22")
    }

    pub fn dim(self, s: &str) -> String {
        self.wrap(s, "2", "22")
    }

    pub fn red(self, s: &str) -> String {
        self.wrap(s, "31", "39")
    }

    pub fn green(self, s: &str) -> String {
        self.wrap(s, "32", "39")
    }

    pub fn yellow(self, s: &str) -> String {
        self.wrap(s, "33", "39")
    }

    pub fn cyan(self, s: &str) -> String {
        self.wrap(s, "36", "39")
    }
}

/// `s` without ANSI SGR escapes (ESC `[` ... `m`): for tests and width checks.
pub fn strip(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_colours_only_a_terminal_without_no_color_or_dumb_term() {
        let os = |s: &'static str| Some(OsStr::new(s));
        let auto = |tty, no_color, term| enabled(ColorWhen::Auto, tty, no_color, term);
        assert!(auto(true, None, os("xterm-256color")));
        assert!(auto(true, None, None), "no TERM at all is not `dumb`");
        assert!(auto(true, os(""), os("xterm")), "an empty NO_COLOR does not opt out");
        assert!(!auto(false, None, os("xterm")), "a pipe or file");
        assert!(!auto(true, os("1"), os("xterm")), "NO_COLOR set, whatever its value");
        assert!(!auto(true, os("0"), os("xterm")));
        assert!(!auto(true, None, os("dumb")));
        // The flag wins over the environment and the stream.
        assert!(enabled(ColorWhen::Always, false, os("1"), os("dumb")));
        assert!(!enabled(ColorWhen::Never, true, None, os("xterm")));
    }

    #[test]
    fn plain_is_the_text_itself_and_colour_nests() {
        for f in [Style::bold, Style::dim, Style::red, Style::green, Style::yellow, Style::cyan] {
            assert_eq!(f(Style::PLAIN, "x 1"), "x 1");
            assert_eq!(strip(&f(Style::COLOR, "x 1")), "x 1");
        }
        let c = Style::COLOR;
        let line = c.bold(&format!("lost: {}", c.red("3")));
        assert_eq!(line, "\x1b[1mlost: \x1b[31m3\x1b[39m\x1b[22m");
        assert_eq!(c.red(""), "", "nothing to colour, no escapes");
        assert_eq!(strip("a\x1b[1mb\x1b[22mµ"), "abµ");
    }
}
