//! `tracerd top`: a live full-screen view (`view::top`), refreshed every second. Beside a
//! running agent it reads the agent's frames (one per second); without one it loads tracerd's
//! own programs.

use std::{io::IsTerminal, path::Path, time::Duration};

use anyhow::Result;

use ratatui::crossterm::event::{self, Event, KeyEventKind};

use crate::{
    kernel::session::{Session, shutdown_signal},
    kernel::tracer::LoadOptions,
    model::capture,
    model::selection::Selection,
    serve::api,
    source::rolling::Rolling,
    view::top::View,
};

/// Runs the view until `q`, SIGINT or SIGTERM; the terminal is restored however it ends.
pub async fn top(color: bool, selection: Selection, opts: LoadOptions, attach: Option<&Path>) -> Result<()> {
    if !std::io::stdout().is_terminal() {
        anyhow::bail!(
            "top draws on a terminal; for tables in a pipe or file use `tracerd report --interval 1`"
        );
    }
    let status = match attach.map(|s| api::call::<api::Status>(s, &api::Request::Status {}, "status")) {
        Some(Ok(status)) => Some(status),
        Some(Err(api::AttachError::NoAgent(_))) | None => None,
        Some(Err(e)) => {
            tracing::warn!("{e}; tracing with tracerd's own programs instead");
            None
        }
    };
    let mut view = View::new(color);
    match (status, attach) {
        (Some(status), Some(socket)) => {
            view.source = format!("agent {}", status.pid);
            let mut terminal = ratatui::try_init()?;
            let r = from_agent(&mut terminal, &mut view, &selection, socket, status).await;
            ratatui::restore();
            r
        }
        _ => {
            let mut session = Session::start(selection, &opts)?;
            view.source = "own programs".into();
            let mut terminal = ratatui::try_init()?;
            let r = standalone(&mut terminal, &mut view, &mut session).await;
            ratatui::restore();
            r
        }
    }
}

/// Reads keys that are waiting; true to quit.
fn keys(view: &mut View) -> Result<bool> {
    while event::poll(Duration::ZERO)? {
        if let Event::Key(k) = event::read()?
            && k.kind == KeyEventKind::Press
            && view.key(k.code, k.modifiers)
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Beside the agent: every second, the frames it sealed since the last ones shown.
async fn from_agent(
    terminal: &mut ratatui::DefaultTerminal,
    view: &mut View,
    selection: &Selection,
    socket: &Path,
    status: api::Status,
) -> Result<()> {
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let mut from = status.recorder.to_unix_s.unwrap_or_else(capture::unix_now);
    let mut poll = tokio::time::interval(Duration::from_millis(100));
    let mut second = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = poll.tick() => {
                if keys(view)? {
                    return Ok(());
                }
            }
            _ = second.tick() => {
                let now: api::Status = api::call(socket, &api::Request::Status {}, "status")?;
                if let Some(newest) = now.recorder.to_unix_s.filter(|&t| t > from) {
                    let request =
                        api::Request::Window { from_unix_s: from, to_unix_s: newest, by_cgroup: view.by_cgroup };
                    let w: api::WindowAnswer = api::call(socket, &request, "window")?;
                    from = newest;
                    if !view.paused {
                        view.report = Some(crate::view::report::window_report_for(w, selection, socket)?);
                    }
                }
            }
            _ = &mut shutdown => return Ok(()),
        }
        terminal.draw(|f| view.draw(f))?;
    }
}

/// With tracerd's own programs: the aggregate is shown and started afresh every second.
async fn standalone(
    terminal: &mut ratatui::DefaultTerminal,
    view: &mut View,
    session: &mut Session,
) -> Result<()> {
    let ops = session.tracer.ops;
    let mut rolling = Rolling::new(session, false)?;
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let mut poll = tokio::time::interval(Duration::from_millis(100));
    let mut second = tokio::time::interval(Duration::from_secs(1));
    second.tick().await;
    loop {
        tokio::select! {
            r = session.read(|io, topo| rolling.add(io, topo, &ops)) => {
                r?;
                continue;
            }
            _ = poll.tick() => {
                if keys(view)? {
                    return Ok(());
                }
            }
            _ = second.tick() => {
                session.refresh_devices()?;
                let report = rolling.roll(session, None)?;
                rolling.by_cgroup(view.by_cgroup);
                if !view.paused {
                    view.report = Some(report);
                }
            }
            _ = &mut shutdown => return Ok(()),
        }
        terminal.draw(|f| view.draw(f))?;
    }
}
