//! `tracerd diff A B`: each side a capture file or a window of the running agent's recorder,
//! compared and shown by `view::diff`.

use std::{io::Write as _, path::Path};

use anyhow::{Result, bail};

use crate::{model::capture::Capture, view::diff::Diff, view::style::Style};

/// One side of a diff: a capture file, or a window of the running agent's recorder.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    File(std::path::PathBuf),
    Window { from_unix_s: f64, to_unix_s: f64 },
}

impl Source {
    /// `@FROM..TO` (times as `report --from` takes them: RFC 3339, `now`, or a time ago) is a
    /// window of the agent; anything else is a capture file.
    pub fn parse(arg: &str, now: f64) -> Result<Source> {
        let Some(window) = arg.strip_prefix('@') else { return Ok(Source::File(arg.into())) };
        let Some((from, to)) = window.split_once("..") else {
            bail!("'{arg}': a window of the agent is @FROM..TO, as @1h5m..1h or @2026-11-30T14:00:00Z..now");
        };
        let time = |t: &str| crate::units::parse_time(t, now).map_err(|e| anyhow::anyhow!("'{arg}': {e}"));
        let (from_unix_s, to_unix_s) = (time(from)?, time(to)?);
        if from_unix_s >= to_unix_s {
            bail!("'{arg}': the window is empty: FROM must be before TO");
        }
        Ok(Source::Window { from_unix_s, to_unix_s })
    }

    /// The capture, and what to call it.
    fn load(&self, socket: &Path) -> Result<(Capture, String)> {
        match self {
            Source::File(path) => Ok((Capture::load(path)?, path.display().to_string())),
            Source::Window { from_unix_s, to_unix_s } => {
                let w = crate::source::agent::window(socket, *from_unix_s, *to_unix_s, false)?;
                let name = format!(
                    "agent {}..{}",
                    crate::units::rfc3339(w.from_unix_s),
                    &crate::units::rfc3339(w.to_unix_s)[11..]
                );
                Ok((w.capture, name))
            }
        }
    }
}

/// `tracerd diff A B [--json]`; text emphasised by `style`.
pub fn diff(a: &Source, b: &Source, socket: &Path, json: bool, style: Style) -> Result<()> {
    let ((ca, name_a), (cb, name_b)) = (a.load(socket)?, b.load(socket)?);
    let d = Diff::compare(&ca, &name_a, &cb, &name_b)?;
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &d)?;
        writeln!(out)?;
    } else {
        write!(out, "{}", d.render_text_styled(style))?;
    }
    Ok(())
}
