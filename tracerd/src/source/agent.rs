//! The running agent as a source: windows of its recorder, and waiting for a frame to be sealed.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::Result;

use crate::{serve::api, units};

/// A window of the agent's recorder; an empty one is an error that says what the recorder holds.
pub fn window(socket: &Path, from_unix_s: f64, to_unix_s: f64, by_cgroup: bool) -> Result<api::WindowAnswer> {
    let request = api::Request::Window { from_unix_s, to_unix_s, by_cgroup };
    let w: api::WindowAnswer = api::call(socket, &request, "window").map_err(|e| match e {
        api::AttachError::NoAgent(_) => anyhow::anyhow!(
            "{e}: windows of the past come from the agent's flight recorder, and no agent runs"
        ),
        e => e.into(),
    })?;
    if w.frames == 0 {
        let status: api::Status = api::call(socket, &api::Request::Status {}, "status")?;
        let holds = match (status.recorder.from_unix_s, status.recorder.to_unix_s) {
            (Some(a), Some(b)) => format!("it holds {} to {}", units::rfc3339(a), units::rfc3339(b)),
            _ => "it holds nothing yet (the first frame ends a second after the agent starts)".into(),
        };
        anyhow::bail!(
            "the agent's recorder has no frame between {} and {}: {holds}",
            units::rfc3339(from_unix_s),
            units::rfc3339(to_unix_s)
        );
    }
    Ok(w)
}

/// Waits until the agent has sealed the frame that holds `until`: within one resolution and a
/// tick; after a few seconds more, what it has is taken.
pub async fn sealed(socket: &Path, until: f64, resolution_s: f64) -> Result<()> {
    let patience = Instant::now() + Duration::from_secs_f64(resolution_s + 3.0);
    loop {
        let now: api::Status = api::call(socket, &api::Request::Status {}, "status")?;
        if now.recorder.to_unix_s.is_some_and(|t| t >= until) || Instant::now() > patience {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
