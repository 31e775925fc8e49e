//! Shell completions and man pages, generated from the clap definitions (so they cannot drift
//! from the flags): what the Debian package installs, and what an operator can write by hand.

use std::{io::Write, path::Path};

use anyhow::{Context, Result};
use clap::CommandFactory;
use clap_complete::Shell;

use crate::cli::Cli;

/// Writes `shell`'s completion script for tracerd to `out`.
pub fn completions(shell: Shell, out: &mut dyn Write) -> Result<()> {
    // Into a buffer first: clap_complete panics on a write error (`| head`).
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "tracerd", &mut script);
    match out.write_all(&script).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Writes `tracerd.1` and a `tracerd-SUBCOMMAND.1` per subcommand into `dir` (created if
/// missing); returns the files written.
pub fn manpages(dir: &Path) -> Result<Vec<String>> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let top = Cli::command();
    let mut pages = vec![("tracerd".to_owned(), top.clone())];
    for sub in top.get_subcommands().filter(|c| c.get_name() != "help") {
        let name = format!("tracerd-{}", sub.get_name());
        // The page's NAME and SYNOPSIS read `tracerd-report`, as man(1) finds it.
        pages.push((
            name.clone(),
            sub.clone().name(name.clone()).bin_name(format!("tracerd {}", sub.get_name())),
        ));
    }
    let mut written = Vec::new();
    for (name, cmd) in pages {
        let mut page = Vec::new();
        clap_mangen::Man::new(cmd).render(&mut page).with_context(|| format!("rendering {name}.1"))?;
        let file = format!("{name}.1");
        std::fs::write(dir.join(&file), page)
            .with_context(|| format!("cannot write {}", dir.join(&file).display()))?;
        written.push(file);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_know_every_subcommand() {
        for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
            let mut out = Vec::new();
            completions(shell, &mut out).unwrap();
            let text = String::from_utf8(out).unwrap();
            for sub in ["run", "report", "snoop", "top", "diff", "doctor", "completions", "manpages"] {
                assert!(text.contains(sub), "{shell:?} completion lacks {sub}");
            }
        }
    }

    #[test]
    fn a_man_page_per_subcommand_with_its_flags() {
        let dir = std::env::temp_dir().join(format!("tracerd-man-{}", std::process::id()));
        let files = manpages(&dir).unwrap();
        assert!(files.contains(&"tracerd.1".to_owned()) && files.contains(&"tracerd-report.1".to_owned()));
        let report = std::fs::read_to_string(dir.join("tracerd-report.1")).unwrap();
        assert!(report.contains("tracerd\\-report") && report.contains("\\-\\-since"), "{report}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
