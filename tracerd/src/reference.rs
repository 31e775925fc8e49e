//! The CLI reference (`docs/reference/cli.md`), generated from the clap definitions so that it
//! cannot drift: a unit test fails when the committed page differs from what this writes, and
//! `cargo xtask docs` rewrites it.

use std::fmt::Write;

use clap::{Arg, ArgAction, Command, CommandFactory};

use crate::cli::Cli;

/// Where the generated page lives, from the workspace root.
pub const CLI_PAGE: &str = "docs/reference/cli.md";

/// The whole page: the global options, then each subcommand with its usage, options and examples.
pub fn cli_markdown() -> String {
    let mut root = Cli::command();
    root.build();
    let mut out = String::new();
    out.push_str(
        "# Command-line reference\n\n\
         Generated from tracerd's clap definitions by `cargo xtask docs`; a unit test fails when this \
         page and the code disagree, so edit the doc comments in `tracerd/src/cli.rs`, not this file. \
         `tracerd help SUBCOMMAND` and `tracerd SUBCOMMAND --help` print the same text.\n\n",
    );
    let _ = writeln!(out, "{}\n", one_line(&root.get_about().map(|s| s.to_string()).unwrap_or_default()));
    let _ = writeln!(out, "```\n{}\n```\n", usage(&root));
    out.push_str("Subcommands:\n\n");
    for sub in subcommands(&root) {
        let name = sub.get_name();
        let about = sub.get_about().map(|s| s.to_string()).unwrap_or_default();
        let _ = writeln!(out, "- [`tracerd {name}`](#tracerd-{name}): {}", first_sentence(&about));
    }
    out.push_str("\n## Global options\n\nThese go before or after the subcommand.\n\n");
    options_table(&mut out, root.get_arguments().filter(|a| !a.is_hide_set()));
    for sub in subcommands(&root) {
        let _ = writeln!(out, "\n## tracerd {}\n", sub.get_name());
        let about = sub.get_long_about().or(sub.get_about()).map(|s| s.to_string()).unwrap_or_default();
        let _ = writeln!(out, "{}\n", one_line(&about));
        let _ = writeln!(out, "```\n{}\n```\n", usage(sub));
        let positionals: Vec<&Arg> = sub.get_positionals().collect();
        if !positionals.is_empty() {
            out.push_str("Arguments:\n\n| argument | description |\n|---|---|\n");
            for a in positionals {
                let name = a
                    .get_value_names()
                    .and_then(|v| v.first())
                    .map_or(a.get_id().to_string(), |n| n.to_string());
                let _ = writeln!(out, "| `{name}` | {} |", cell(&help(a)));
            }
            out.push('\n');
        }
        // Global options are the root's; help and version are clap's own.
        let own: Vec<&Arg> = sub
            .get_arguments()
            .filter(|a| !a.is_positional() && !a.is_global_set() && !a.is_hide_set())
            .filter(|a| !matches!(a.get_action(), ArgAction::Help | ArgAction::HelpLong | ArgAction::Version))
            .collect();
        if !own.is_empty() {
            out.push_str("Options:\n\n");
            options_table(&mut out, own.into_iter());
        }
        if let Some(examples) = sub.get_after_help() {
            let _ = writeln!(out, "\n```\n{}\n```", examples.to_string().trim_end());
        }
    }
    out
}

fn subcommands(cmd: &Command) -> impl Iterator<Item = &Command> {
    cmd.get_subcommands().filter(|c| c.get_name() != "help")
}

/// `tracerd report [OPTIONS]`, without clap's "Usage: " prefix or styling.
fn usage(cmd: &Command) -> String {
    let text = cmd.clone().render_usage().to_string();
    text.trim().strip_prefix("Usage: ").unwrap_or(text.trim()).to_owned()
}

fn options_table<'a>(out: &mut String, args: impl Iterator<Item = &'a Arg>) {
    out.push_str("| option | value | default | description |\n|---|---|---|---|\n");
    for a in args {
        let mut flag = String::new();
        if let Some(s) = a.get_short() {
            let _ = write!(flag, "`-{s}`, ");
        }
        if let Some(l) = a.get_long() {
            let _ = write!(flag, "`--{l}`");
        }
        let takes_value = a.get_action().takes_values();
        let value = match a.get_value_names() {
            Some(names) if takes_value => {
                names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(" ")
            }
            None if takes_value => format!("`{}`", a.get_id().as_str().to_uppercase()),
            _ => String::new(),
        };
        let default = if takes_value {
            a.get_default_values()
                .iter()
                .map(|v| format!("`{}`", v.to_string_lossy()))
                .collect::<Vec<_>>()
                .join(", ")
        } else {
            String::new()
        };
        // clap drops a help text's final period; the cell gets it back before more is added.
        let mut text = help(a);
        if !text.is_empty() && !text.ends_with('.') {
            text.push('.');
        }
        let values: Vec<String> = a
            .get_possible_values()
            .iter()
            .filter(|v| !v.is_hide_set())
            .map(|v| match v.get_help() {
                Some(h) => format!("`{}` ({})", v.get_name(), one_line(&h.to_string()).trim_end_matches('.')),
                None => format!("`{}`", v.get_name()),
            })
            .collect();
        if takes_value && !values.is_empty() {
            let _ = write!(text, " One of: {}.", values.join(", "));
        }
        if matches!(a.get_action(), ArgAction::Append) && !text.to_lowercase().contains("repeatable") {
            text.push_str(" Repeatable.");
        }
        let _ = writeln!(out, "| {flag} | {value} | {default} | {} |", cell(&text));
    }
}

/// An argument's help, the long form where it has one.
fn help(a: &Arg) -> String {
    one_line(&a.get_long_help().or(a.get_help()).map(|s| s.to_string()).unwrap_or_default())
}

/// Doc comments wrap at 100 columns; a table cell is one line.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn first_sentence(s: &str) -> String {
    let s = one_line(s);
    match s.find(": ").or_else(|| s.find(". ")) {
        Some(i) => s[..i].to_owned(),
        None => s.trim_end_matches('.').to_owned(),
    }
}

/// Markdown table cells cannot hold a bare `|`.
fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The committed page is what the code generates; `cargo xtask docs` (which sets
    /// TRACERD_BLESS) writes it anew.
    #[test]
    fn the_cli_reference_is_generated_from_the_code() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(CLI_PAGE);
        let page = cli_markdown();
        if std::env::var_os("TRACERD_BLESS").is_some() {
            std::fs::write(&path, &page).unwrap();
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == page,
            "{CLI_PAGE} is not what tracerd/src/cli.rs says: run `cargo xtask docs` and commit the page"
        );
    }

    #[test]
    fn every_flag_of_every_subcommand_is_on_the_page() {
        let page = cli_markdown();
        let root = Cli::command();
        for sub in subcommands(&root) {
            let section =
                page.split(&format!("\n## tracerd {}\n", sub.get_name())).nth(1).expect("a section");
            let section = section.split("\n## ").next().unwrap_or_default();
            for long in sub.get_arguments().filter_map(Arg::get_long) {
                assert!(section.contains(&format!("`--{long}`")), "tracerd {} --{long}", sub.get_name());
            }
        }
        for long in root.get_arguments().filter_map(Arg::get_long) {
            assert!(page.contains(&format!("`--{long}`")), "--{long}");
        }
    }
}
