//! Where a view's IO comes from: the running agent (its recorder's windows), a store read
//! offline, or tracerd's own programs aggregated here (`Rolling`).

use std::path::PathBuf;

use anyhow::Result;

use crate::{model::capture, units};

pub mod agent;
pub mod rolling;
pub mod store;

/// Where `report` takes its IO from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Source {
    /// The running agent's recorder if an agent answers, else tracerd's own programs.
    Auto,
    /// Always tracerd's own programs (`--standalone`).
    Standalone,
    /// A window of the past, from the agent's recorder (`--since`, `--from`, `--to`).
    Window { from_unix_s: f64, to_unix_s: f64 },
}

impl Source {
    /// From the command line; times are read against now.
    pub fn from_args(
        since: Option<f64>,
        from: Option<&str>,
        to: Option<&str>,
        standalone: bool,
    ) -> Result<Source> {
        let now = capture::unix_now();
        let window = |from_unix_s: f64, to_unix_s: f64| {
            if from_unix_s >= to_unix_s {
                anyhow::bail!(
                    "the window from {} to {} is empty: --from must be before --to",
                    units::rfc3339(from_unix_s),
                    units::rfc3339(to_unix_s)
                );
            }
            Ok(Source::Window { from_unix_s, to_unix_s })
        };
        let time = |t: &str| units::parse_time(t, now).map_err(|e| anyhow::anyhow!(e));
        match (since, from) {
            (Some(span), _) => window(now - span, now),
            (None, Some(from)) => window(time(from)?, to.map_or(Ok(now), time)?),
            (None, None) if standalone => Ok(Source::Standalone),
            (None, None) => Ok(Source::Auto),
        }
    }
}

/// Where the IO comes from, and the agent's socket.
#[derive(Clone, Debug)]
pub struct Attach {
    pub source: Source,
    pub socket: PathBuf,
    /// A store to read instead of an agent (`--store`).
    pub store: Option<PathBuf>,
}
