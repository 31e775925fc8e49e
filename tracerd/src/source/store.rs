//! A store as a source, read offline (`report --store`).

use std::path::Path;

use anyhow::Result;

use crate::{serve::api, source::Source, units};

/// A window of a store read offline (`report --store`): the window asked, or all of it, and
/// the slowest IOs of its minutes. An empty one is an error that says what the store holds.
pub fn store_window(
    dir: &Path,
    source: Source,
    by_cgroup: bool,
) -> Result<(api::WindowAnswer, Vec<crate::model::slowest::SlowMinute>)> {
    let mut store = crate::store::Store::open_read_only(dir)?;
    let Some((first, last)) = store.span() else {
        anyhow::bail!("the store {} holds no frame", dir.display());
    };
    let (from, to) = match source {
        Source::Window { from_unix_s, to_unix_s } => (from_unix_s, to_unix_s),
        _ => (first as f64 / 1e3, last as f64 / 1e3),
    };
    let (kernel, host) =
        store.newest_start().map_or_else(Default::default, |s| (s.kernel.clone(), s.host.clone()));
    let (slowest, bad) = store.plan_slow(from, to).slow_minutes();
    store.count_unreadable(bad);
    let mut recorder = crate::model::recorder::Recorder::default();
    recorder.attach_store(store);
    let window = recorder.window(api::window_ms(from), api::window_ms(to));
    if window.frames.is_empty() {
        anyhow::bail!(
            "the store {} has no frame between {} and {}: it holds {} to {}",
            dir.display(),
            units::rfc3339(from),
            units::rfc3339(to),
            units::rfc3339(first as f64 / 1e3),
            units::rfc3339(last as f64 / 1e3)
        );
    }
    let answer =
        api::window_answer(&window, from, by_cgroup, kernel, host).map_err(|e| anyhow::anyhow!(e))?;
    Ok((answer, crate::model::slowest::merge(slowest)))
}
