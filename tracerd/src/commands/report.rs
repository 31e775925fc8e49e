//! `tracerd report`: a btt-style report of a capture (tracerd's own programs, or a window of the
//! running agent or of a store), once, every interval, or saved for `diff`.

use std::{
    io::IsTerminal,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::Result;

use tracer_common::IoRecord;

use crate::{
    kernel::cgroupfs::CgroupNames,
    kernel::record::comm,
    kernel::session::{Io, Session, shutdown_signal},
    kernel::tracer::{LoadOptions, kernel_release},
    model::aggregate::{Aggregator, Lost},
    model::ahead::Ahead,
    model::capture::{self, Capture},
    model::cgroups::Named,
    model::op::Op,
    model::selection::Selection,
    serve::api,
    source::{
        Attach, Source,
        agent::{sealed, window},
        rolling::{ByCgroup, Rolling},
        store::store_window,
    },
    view::report::{Interval, Origin, Report, View, window_report},
};

/// Captures for `duration` seconds (or until SIGINT), then prints the report, and with `save`
/// writes the capture for `tracerd diff`. With an agent running, its recorder is asked, and
/// no program is loaded.
pub async fn report(
    duration: f64,
    view: View,
    save: Option<&Path>,
    selection: Selection,
    opts: LoadOptions,
    attach: Attach,
) -> Result<()> {
    // Before tracing, so a bad path costs no capture.
    if let Some(path) = save {
        Capture::check_save_path(path)?;
        // Version-1 captures hold histograms of the default range only.
        if crate::model::aggregate::histogram_range() != crate::model::aggregate::HistogramRange::default() {
            anyhow::bail!(
                "--save writes histograms of the default range (100 ns to 60 s, 3 significant digits), \
                 and the config's [histogram] section sets another: remove it to save a capture"
            );
        }
    }
    let socket = attach.socket.as_path();
    if let Some(dir) = &attach.store {
        if view.by_qd {
            anyhow::bail!("{BY_QD_NEEDS_RECORDS}");
        }
        let (w, slowest) = store_window(dir, attach.source, view.by_cgroup.is_some())?;
        return window_report(w, view, save, &selection, Origin::Store(dir), Some(slowest))?.print(view);
    }
    match attach.source {
        Source::Window { from_unix_s, to_unix_s } => {
            if view.by_qd {
                anyhow::bail!("{BY_QD_NEEDS_RECORDS}");
            }
            let w = window(socket, from_unix_s, to_unix_s, view.by_cgroup.is_some())?;
            return show_window(w, view, save, &selection, socket);
        }
        Source::Auto => match api::call::<api::Status>(socket, &api::Request::Status {}, "status") {
            Ok(status) if !view.by_qd => {
                return match view.interval {
                    Some(every) => intervals_from_agent(every, view, &selection, socket, status).await,
                    None => report_from_agent(duration, view, save, &selection, socket, status).await,
                };
            }
            Ok(_) => tracing::info!("--by needs every IO's record: tracing with tracerd's own programs"),
            Err(api::AttachError::NoAgent(_)) => {}
            Err(e) => tracing::warn!("{e}; tracing with tracerd's own programs instead"),
        },
        Source::Standalone => {}
    }
    let mut session = Session::start(selection, &opts)?;
    if let Some(every) = view.interval {
        return intervals_standalone(&mut session, every, view).await;
    }
    let ops = session.tracer.ops;
    let base = session.lost()?;
    let mut agg = Aggregator::new(view.by_qd);
    let mut by_cgroup = ByCgroup::new(view.by_cgroup);
    let mut ahead = session.tracer.causes_on().then(AheadOf::default);
    let progress = std::io::stderr().is_terminal();
    let started = Instant::now();
    let started_unix_s = capture::unix_now();
    let deadline = tokio::time::sleep(Duration::from_secs_f64(duration));
    tokio::pin!(deadline);
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            r = session.read(|io, topo| {
                agg.add(io.target, ops.op(io.rec.cmd_flags), io.rec, io.layers, |d| topo.name_of(d));
                by_cgroup.add(io, ops.op(io.rec.cmd_flags), topo);
                if let Some(a) = &mut ahead { a.add(io, ops.op(io.rec.cmd_flags)) }
            }) => r?,
            _ = tick.tick() => {
                session.refresh_devices()?;
                if progress {
                    let ios: u64 = agg.series.values().map(|s| s.requests).sum();
                    eprint!("\rcapturing: {:.0}/{duration:.0} s, {ios} requests ", started.elapsed().as_secs_f64());
                }
            }
            _ = &mut deadline => break,
            _ = &mut shutdown => break,
        }
    }
    session.drain_now(|io, topo| {
        agg.add(io.target, ops.op(io.rec.cmd_flags), io.rec, io.layers, |d| topo.name_of(d));
        by_cgroup.add(io, ops.op(io.rec.cmd_flags), topo);
        if let Some(a) = &mut ahead {
            a.add(io, ops.op(io.rec.cmd_flags))
        }
    });
    let waits = session.take_waits();
    agg.add_waits(&waits, |d| session.topo.name_of(d));
    if progress {
        eprint!("\r\x1b[K");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let lost = Lost { series_limit: agg.over_limit, ..session.lost()?.since(&base) };
    let hooks = session.tracer.hooks.clone();
    let topo = session.topo.clone();
    drop(session);
    let kernel = kernel_release();
    let report = Report::build_with(&agg, &topo, &lost, &hooks, &kernel, elapsed, view.hist).with_cgroups(
        &by_cgroup.aggs,
        &topo,
        view.hist,
    );
    let report = match &ahead {
        Some(a) => report.with_ahead(&a.ahead, &topo),
        None => report,
    };
    report.print(view)?;
    if let Some(path) = save {
        let meta = capture::Meta { kernel, host: capture::hostname(), started_unix_s, duration_s: elapsed };
        Capture::from_aggregate(&agg, &topo, &lost, meta).save(path)?;
        tracing::info!("capture saved to {}", path.display());
    }
    Ok(())
}

/// Who went ahead of waiting IOs (config `causes`): each request, with its group.
#[derive(Default)]
struct AheadOf {
    ahead: Ahead,
    names: Option<CgroupNames>,
}

impl AheadOf {
    fn add(&mut self, io: &Io, op: Op) {
        let Some(numbers) = io.ahead else { return };
        let rec = io.rec;
        let names = self.names.get_or_insert_with(CgroupNames::detect);
        self.ahead.add(rec.disk, op, &group_of(names, rec), numbers);
    }
}

/// An IO's group: the cgroup it was charged to, or its command where none below the root is
/// known (a machine without cgroups, or all IO from the root).
fn group_of(names: &mut CgroupNames, rec: &IoRecord) -> String {
    match names.of(rec) {
        Named::Path(p) if &*p != "/" => p.to_string(),
        _ => match comm(rec) {
            "" => "?".into(),
            c => c.to_owned(),
        },
    }
}

const BY_QD_NEEDS_RECORDS: &str = "--by qd needs every IO's record, and the agent's recorder keeps no \
     per-queue-depth tables: report the present with --standalone --by qd";

/// `report --duration` beside a running agent: waits as long, then asks its recorder for the
/// frames of that time. Nothing is loaded into the kernel.
async fn report_from_agent(
    duration: f64,
    view: View,
    save: Option<&Path>,
    selection: &Selection,
    socket: &Path,
    status: api::Status,
) -> Result<()> {
    let started = capture::unix_now();
    tracing::info!(
        "reading from the running agent (pid {}) on {}: no programs loaded (--standalone loads them)",
        status.pid,
        socket.display()
    );
    let deadline = tokio::time::sleep(Duration::from_secs_f64(duration));
    tokio::pin!(deadline);
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    tokio::select! {
        _ = &mut deadline => {}
        _ = &mut shutdown => {}
    }
    let ended = capture::unix_now();
    sealed(socket, ended, status.recorder.resolution_s).await?;
    show_window(window(socket, started, ended, view.by_cgroup.is_some())?, view, save, selection, socket)
}

/// `report --interval` beside a running agent: each interval is the agent's frames after the
/// last one shown, so intervals never share a frame; each prints its own span.
async fn intervals_from_agent(
    every: Interval,
    view: View,
    selection: &Selection,
    socket: &Path,
    status: api::Status,
) -> Result<()> {
    tracing::info!(
        "reading from the running agent (pid {}) on {}: a report every {} s",
        status.pid,
        socket.display(),
        every.secs
    );
    let resolution = status.recorder.resolution_s;
    if every.secs < resolution {
        anyhow::bail!(
            "the agent's frames are {resolution} s long: give --interval {resolution} or more (or --standalone)"
        );
    }
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    // Intervals start where the agent's frame in progress started, and each ends half a frame
    // short of its length: the frames overlapping it are then those that start in it, one
    // interval's frames follow the last one's, and none is taken twice.
    let (mut from, mut shown) = (status.recorder.to_unix_s.unwrap_or_else(capture::unix_now), 0);
    loop {
        let until = from + every.secs - resolution / 2.0;
        let wait = Duration::from_secs_f64((until - capture::unix_now()).max(0.0));
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = &mut shutdown => return Ok(()),
        }
        sealed(socket, until, resolution).await?;
        let request = api::Request::Window { from_unix_s: from, to_unix_s: until, by_cgroup: false };
        let w: api::WindowAnswer = api::call(socket, &request, "window")?;
        from = if w.frames > 0 { w.to_unix_s } else { until + resolution / 2.0 };
        window_report(w, view, None, selection, Origin::Agent(socket), None)?.print_interval(view)?;
        shown += 1;
        if every.count == Some(shown) {
            return Ok(());
        }
    }
}

/// `report --interval` with tracerd's own programs: the aggregate is printed and started
/// afresh every interval.
async fn intervals_standalone(session: &mut Session, every: Interval, view: View) -> Result<()> {
    let ops = session.tracer.ops;
    let mut rolling = Rolling::new(session, view.by_qd)?;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(every.secs));
    tick.tick().await;
    let mut rescan = tokio::time::interval(Duration::from_secs(1));
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let mut shown = 0;
    loop {
        let last = tokio::select! {
            r = session.read(|io, topo| rolling.add(io, topo, &ops)) => {
                r?;
                continue;
            }
            _ = rescan.tick() => {
                session.refresh_devices()?;
                continue;
            }
            _ = tick.tick() => false,
            // Interrupted: the interval so far is printed too, as biolatency does.
            _ = &mut shutdown => {
                session.drain_now(|io, topo| rolling.add(io, topo, &ops));
                true
            }
        };
        rolling.roll(session, view.hist)?.print_interval(view)?;
        shown += 1;
        if last || every.count == Some(shown) {
            return Ok(());
        }
    }
}

/// Prints (and saves) a window of the agent's recorder, for the devices selected.
fn show_window(
    w: api::WindowAnswer,
    view: View,
    save: Option<&Path>,
    selection: &Selection,
    socket: &Path,
) -> Result<()> {
    let request = api::Request::Slowest { from_unix_s: w.from_unix_s, to_unix_s: w.to_unix_s };
    let slowest = api::call(socket, &request, "slowest")?;
    window_report(w, view, save, selection, Origin::Agent(socket), Some(slowest))?.print(view)
}
