//! `tracerd run`: the host agent. Traces until SIGINT/SIGTERM and serves `/metrics`.

use std::{
    cell::RefCell,
    collections::{BTreeMap, HashSet},
    sync::{Arc, Mutex, atomic::Ordering::Relaxed},
    time::Duration,
};

use anyhow::{Result, bail};
use tracer_common::{SeriesAgg, agg, flag, kind};

use crate::{
    config::Config,
    kernel::cgroup_series::{self, CgroupOf},
    kernel::cgroupfs::CgroupNames,
    kernel::session::{Io, Session, shutdown_signal},
    kernel::tracer::{self, Aggregation, LoadOptions, kernel_release},
    model::aggregate::{Aggregator, Lost},
    model::capture::hostname,
    model::cgroups::CgroupSeries,
    model::cgroups::Named,
    model::op::{Op, OpDecoder},
    model::recorder::{FrameBuilder, Recorder},
    model::selection::Selection,
    model::series::Series,
    model::topology::Topology,
    serve::api,
    serve::http,
    serve::metrics::{RecorderGauges, State, StoreGauges},
    store::{Start, Store},
    units::unix_ms,
    view::io_line as snoop,
};

/// How often devices are rescanned, lost counters refreshed and the kernel's series folded.
const HOUSEKEEPING: Duration = Duration::from_secs(1);
/// Stale in-flight entries are swept every this many housekeeping ticks at most (a sweep
/// reads both tables, 32768 lookups), and at least four times per `stale_after`.
const SWEEP_EVERY: u64 = 30;
/// The in-flight tables' occupancy is sampled every this many ticks (a scan is 32768 lookups).
const OCCUPANCY_EVERY: u64 = 10;

pub async fn run(config: &Config, selection: Selection, mut opts: LoadOptions) -> Result<()> {
    let (listen, stale_after) = (config.listen, config.stale_after);
    // Privileges and BTF first (without them binding fails or misleads), then bind and read the
    // TLS and password files: a port in use, a second agent or a bad certificate fails before
    // anything is loaded into the kernel.
    tracer::preflight()?;
    let listener = http::bind(listen).await?;
    let security = http::Security::load(&config.http)?;
    let scheme = security.scheme();
    let (api_listener, _socket_file) = api::bind(&config.socket)?;
    // The store too: a store another agent holds, or one of another format, is refused here.
    let mut recorder = Recorder::new(config.recorder);
    if let Some(limits) = &config.store {
        let mut store = Store::open(limits.clone())?;
        store.start(Start {
            started_ms: unix_ms(),
            pid: std::process::id(),
            tracerd_version: env!("CARGO_PKG_VERSION").into(),
            kernel: kernel_release(),
            host: hostname(),
        });
        if let Some((from, _)) = store.span() {
            tracing::info!(
                "recorder store {}: history from {} ({} frames)",
                limits.dir.display(),
                crate::units::rfc3339(from as f64 / 1e3),
                store.frame_count()
            );
        }
        recorder.attach_store(store);
    }
    // Labelled by cgroup, the kernel keeps (cgroup, device, op) series; a key idle for a while
    // gives its place back (at the latest when its label would expire).
    opts.cgroups = config.cgroups.enabled() && opts.aggregation != Aggregation::Records;
    opts.cgroup_idle = cgroup_series::IDLE.min(config.cgroups.expire_after);
    let mut session = Session::start(selection, &opts)?;
    let ops = session.tracer.ops;
    let aggregation = opts.aggregation;
    let cgroup_names = RefCell::new(CgroupNames::detect());
    let given = if aggregation != Aggregation::Records { give_series_to_all(&mut session)? } else { vec![] };
    let state = Arc::new(Mutex::new(State {
        agg: Aggregator::with_limits(false, config.series),
        hooks: session.tracer.hooks.clone(),
        kernel: kernel_release(),
        traced_devices: session.resolved.kernel_devs.len(),
        aggregation: aggregation_name(aggregation),
        kernel_series: if aggregation == Aggregation::Records {
            (0, 0)
        } else {
            session.tracer.series.usage()
        },
        kernel_cgroup_series: opts.cgroups.then(|| session.tracer.cgroup_series.usage()),
        cgroups: config.cgroups.enabled().then(|| CgroupSeries::new(config.cgroups.clone())),
        causes: session.tracer.causes_on(),
        ..Default::default()
    }));
    let shared = Arc::new(api::Shared::new(
        recorder,
        api::Status {
            tracerd_version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            kernel: kernel_release(),
            host: hostname(),
            started_unix_s: unix_ms() as f64 / 1e3,
            aggregation: aggregation_name(aggregation).into(),
            traced_devices: session.resolved.kernel_devs.len(),
            causes: session.tracer.causes_on(),
            skipped_hooks: session
                .tracer
                .hooks
                .iter()
                .filter(|h| !h.attached())
                .map(|h| api::SkippedHook {
                    hook: h.hook.into(),
                    reason: h.reason.clone().unwrap_or_default(),
                })
                .collect(),
            ..Default::default()
        },
    ));
    tokio::spawn(http::serve(listener, state.clone(), security, config.api_http.then(|| shared.clone())));
    for dev in given {
        shared.slowest.lock().unwrap_or_else(|e| e.into_inner()).track(dev);
    }
    set_slow_bars(&mut session, &shared)?;
    tokio::spawn(api::serve(api_listener, shared.clone()));
    tracing::info!("metrics on {scheme}://{listen}/metrics; API on {}", config.socket.display());
    // The frame being filled for the recorder, and the lost counters when it began.
    let frame = RefCell::new(FrameBuilder::default());
    let (mut frame_start, mut frame_lost) = (unix_ms(), Lost::default());
    let resolution_ms = config.recorder.resolution.as_millis() as u64;
    // Devices whose reads and writes came as records: each gets a series if one is free.
    let wants_series = RefCell::new(HashSet::new());
    // Likewise (cgroup, device, op) keys, where series are labelled by cgroup.
    let wants_cgroup_series = RefCell::new(HashSet::new());
    let check = RefCell::new(Check { by_cgroup: opts.cgroups, ..Check::default() });
    let on_io = |io: &Io, topo: &Topology| {
        let op = ops.op(io.rec.cmd_flags);
        // A slow IO of the in-kernel aggregation comes without comm and cgroup (the queue
        // program reads them only for records and streams): they are read from /proc, and
        // only for the IOs kept as the minute's slowest (a read per record would slow the
        // reader at the start of every minute, when the bar is low).
        let from_proc = io.rec.flags & flag::IN_KERNEL != 0 && io.rec.cgroup == 0;
        let named = if from_proc { Named::Unknown } else { cgroup_names.borrow_mut().of(io.rec) };
        if shared.stream_count.load(Relaxed) > 0 {
            stream(&shared, io, topo, &ops, &named);
        }
        let kept = keep_if_slow(&shared, io, topo, &ops, (!from_proc).then_some(&named));
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        // The series the IO was counted in (its cgroup label, where series carry one).
        let mut label = None;
        let mut named_label: Option<Arc<str>> = None;
        if io.rec.flags & flag::IN_KERNEL != 0 {
            // Counted in the kernel already: here for the check, or for a stream (and as a
            // slow IO, for the exemplars, which name the series it was counted in).
            if aggregation == Aggregation::Check {
                check.borrow_mut().count_record(io.target, op, io.rec);
            }
            if let Some(c) = &st.cgroups {
                let l = c.limits.label_of(&named);
                label = Some(c.counted_under(l.as_deref().map_err(|e| *e)));
                named_label = l.ok().map(Arc::from);
            }
        } else {
            frame.borrow_mut().add_record(io.target, op, io.rec, io.layers);
            st.agg.add(io.target, op, io.rec, io.layers, |d| topo.name_of(d));
            if let Some(c) = &mut st.cgroups {
                let l = c.limits.label_of(&named);
                let now = std::time::Instant::now();
                let counted = c.add(io.target, op, io.rec, l.as_deref().map_err(|e| *e), now);
                // Built once per IO: the exemplar below names the cgroup with it too.
                named_label = l.ok().map(Arc::from);
                // The recorder keeps the cgroup's series too: `report --since 10m --by cgroup`.
                frame.borrow_mut().add_cgroup_record(io.target, op, counted.clone(), io.rec);
                label = Some(counted);
            }
            if aggregation != Aggregation::Records
                && io.rec.kind == kind::REQUEST
                && io.rec.parent == 0
                && matches!(op, Op::Read | Op::Write)
            {
                wants_series.borrow_mut().insert(io.target);
                if opts.cgroups {
                    let op = if op == Op::Read { agg::READ } else { agg::WRITE };
                    let task = io.rec.flags & flag::CGROUP_TASK != 0;
                    let of = CgroupOf { dev: io.target, op, cgroup: io.rec.cgroup, task };
                    wants_cgroup_series.borrow_mut().insert(of);
                }
            }
        }
        // Exemplars: every IO seen whole with its names; of the agent's slow IOs, those kept.
        let (comm, named) = match (from_proc, kept) {
            (false, kept) => {
                // A slow IO the kernel counted carries its cgroup but no comm: /proc's, if kept.
                let comm = crate::kernel::record::comm(io.rec);
                let comm = if comm.is_empty() { kept.and_then(|k| k.0) } else { Some(comm.into()) };
                (comm, named)
            }
            (true, Some(kept)) => kept,
            (true, None) => return,
        };
        if aggregation != Aggregation::Check {
            let cgroup: Arc<str> = match (&named, &st.cgroups) {
                (Named::Path(p), Some(c)) => named_label.unwrap_or_else(|| c.limits.label.label(p).into()),
                (Named::Path(p), None) => p.clone(),
                (other, _) => snoop::cgroup_text(other).into(),
            };
            st.exemplars.offer((io.target, op, label), io.rec, comm, cgroup, unix_ms() as f64 / 1e3);
        }
    };
    let mut tick = tokio::time::interval(HOUSEKEEPING);
    let mut ticks = 0u64;
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            r = session.read(on_io) => {
                r?;
                set_slow_bars(&mut session, &shared)?;
            }
            _ = tick.tick() => {
                ticks += 1;
                fold_kernel(&mut session, &state, &frame, &cgroup_names, (aggregation == Aggregation::Check).then_some(&check))?;
                for dev in wants_series.borrow_mut().drain() {
                    if kernel_may_count(&session, dev) && session.tracer.give_series(dev)? {
                        shared.slowest.lock().unwrap_or_else(|e| e.into_inner()).track(dev);
                    }
                }
                for of in wants_cgroup_series.borrow_mut().drain() {
                    session.tracer.give_cgroup_series(of)?;
                }
                let filed = shared.slowest.lock().unwrap_or_else(|e| e.into_inner()).tick(unix_ms());
                store_slow(&shared, &filed);
                set_slow_bars(&mut session, &shared)?;
                if ticks.is_multiple_of((stale_after.as_secs() / 4).clamp(1, SWEEP_EVERY)) {
                    session.sweep(stale_after)?;
                }
                let in_flight = if ticks.is_multiple_of(OCCUPANCY_EVERY) || ticks == 1 {
                    Some(session.tracer.occupancy()?)
                } else {
                    None
                };
                session.refresh_devices()?;
                // A stack built on a device that has a series: its IO must come as records now,
                // so that IO naming no upper IO is seen. What the kernel counted is folded first.
                let stacked_on: Vec<u32> = session
                    .resolved
                    .targets()
                    .filter(|&dev| session.tracer.series.has(dev) && !kernel_may_count(&session, dev))
                    .collect();
                if !stacked_on.is_empty() {
                    for &dev in &stacked_on {
                        session.tracer.stop_series(dev)?;
                    }
                    // A completion that had already found the series as it stopped may land
                    // after this fold: at most one IO per CPU, in the instant a stack is built.
                    fold_kernel(&mut session, &state, &frame, &cgroup_names, (aggregation == Aggregation::Check).then_some(&check))?;
                    for dev in stacked_on {
                        session.tracer.release_series(dev)?;
                        tracing::info!("{}: a stack was built on it; its IO now goes as records", session.topo.name_of(dev));
                    }
                }
                // One bpf_prog_info read per program serves the run counters and the skips.
                let programs = session.tracer.program_totals();
                let lost = session.lost_with(&programs)?;
                let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
                st.agg.lost = Lost { series_limit: st.agg.over_limit, ..lost };
                let topo = &session.topo;
                st.agg.expire(|dev| topo.get(dev).is_some(), std::time::Instant::now());
                let st = &mut *st;
                let (agg, cgroups) = (&st.agg, &st.cgroups);
                st.exemplars.retain(|(dev, op, label)| match (label, cgroups) {
                    (Some(l), Some(c)) => c.series.contains_key(&(*dev, *op, l.clone())),
                    (None, _) => agg.series.contains_key(&(*dev, *op)),
                    (Some(_), None) => false,
                });
                if let Some(c) = &mut st.cgroups {
                    c.tick(std::time::Instant::now());
                    let mut names = cgroup_names.borrow_mut();
                    names.forget_idle(c.limits.expire_after);
                    c.names_cached = names.cached();
                }
                st.records = session.records;
                st.programs = programs;
                if let Some(n) = in_flight {
                    st.in_flight = n;
                }
                st.traced_devices = session.resolved.kernel_devs.len();
                if aggregation != Aggregation::Records {
                    st.kernel_series = session.tracer.series.usage();
                }
                if opts.cgroups {
                    st.kernel_cgroup_series = Some(session.tracer.cgroup_series.usage());
                }
                // Ticks come every second; a frame ends at the tick nearest its length.
                let now = unix_ms();
                if now.saturating_sub(frame_start) + 500 >= resolution_ms {
                    let lost = st.agg.lost;
                    st.recorder = seal_frame(&shared, &frame, topo, (frame_start, now), &lost.since(&frame_lost));
                    (frame_start, frame_lost) = (now, lost);
                }
                shared.status.lock().unwrap_or_else(|e| e.into_inner()).traced_devices = st.traced_devices;
            }
            // A view started or stopped streaming: the kernel sends its aggregated IOs as
            // records only while one streams.
            _ = shared.streams_changed.notified() => {
                if aggregation == Aggregation::Kernel {
                    session.tracer.set_streaming(shared.stream_count.load(Relaxed) > 0)?;
                }
            }
            _ = &mut shutdown => break,
        }
    }
    let stored = shared.recorder.lock().unwrap_or_else(|e| e.into_inner()).store().is_some();
    if aggregation == Aggregation::Check || stored {
        // Every IO done before the signal has its record in the ring buffer and its counts in
        // the kernel: take both, then compare; and keep the last frame, short as it is.
        session.drain_now(on_io);
        fold_kernel(
            &mut session,
            &state,
            &frame,
            &cgroup_names,
            (aggregation == Aggregation::Check).then_some(&check),
        )?;
        let lost = state.lock().unwrap_or_else(|e| e.into_inner()).agg.lost;
        let now = unix_ms();
        if now > frame_start {
            seal_frame(&shared, &frame, &session.topo, (frame_start, now), &lost.since(&frame_lost));
        }
        // This minute's slowest so far: the next agent's part of the minute joins them.
        let current = shared.slowest.lock().unwrap_or_else(|e| e.into_inner()).current();
        store_slow(&shared, &current);
        if aggregation == Aggregation::Check {
            let topo = session.topo.clone();
            check.borrow().verdict(|d| topo.name_of(d))?;
        }
    }
    tracing::info!("shutting down: detaching every program");
    drop(session);
    Ok(())
}

/// Writes filed minutes of the slowest IOs to the recorder's store, when it keeps one.
fn store_slow(shared: &api::Shared, minutes: &[crate::model::slowest::SlowMinute]) {
    if minutes.is_empty() {
        return;
    }
    if let Some(store) = shared.recorder.lock().unwrap_or_else(|e| e.into_inner()).store_mut() {
        store.append_slow(minutes);
    }
}

/// Seals the frame being filled, `[start_ms, end_ms)`, into the recorder (and its store), and
/// says what the recorder holds now.
fn seal_frame(
    shared: &api::Shared,
    frame: &RefCell<FrameBuilder>,
    topo: &Topology,
    (start_ms, end_ms): (u64, u64),
    lost: &Lost,
) -> RecorderGauges {
    let devices: Vec<_> = frame.borrow().devices().filter_map(|d| topo.get(d).cloned()).collect();
    let sealed = frame.borrow_mut().seal(start_ms, end_ms, lost);
    let mut recorder = shared.recorder.lock().unwrap_or_else(|e| e.into_inner());
    recorder.push(sealed, devices);
    RecorderGauges {
        bytes: recorder.bytes(),
        max_bytes: recorder.limits.max_bytes,
        frames: recorder.len(),
        span_s: recorder.span().map_or(0.0, |(a, b)| (b - a) as f64 / 1e3),
        dropped_for_memory: recorder.dropped_for_memory,
        store: recorder.store().map(|st| StoreGauges {
            bytes: st.bytes(),
            max_bytes: st.limits.max_bytes,
            frames_not_stored: st.health.frames_not_stored,
            slow_lists_not_stored: st.health.slow_lists_not_stored,
            write_errors: st.health.write_errors,
            damaged_records: st.health.damaged_records,
            torn_tails: st.health.torn_tails,
        }),
    }
}

/// Keeps the IO whole if it is among its device's slowest of the minute. The agent's queue
/// program does not copy the submitter's comm: it is read from /proc now ("?" if the task is
/// gone).
fn keep_if_slow(
    shared: &api::Shared,
    io: &Io,
    topo: &Topology,
    ops: &OpDecoder,
    named: Option<&Named>,
) -> Option<(Option<Arc<str>>, Named)> {
    use crate::model::stage::Stage;
    if io.rec.kind == kind::MERGE {
        return None;
    }
    let took = Stage::Q2c.of(io.rec).or_else(|| Stage::D2c.of(io.rec))?;
    let mut slowest = shared.slowest.lock().unwrap_or_else(|e| e.into_inner());
    if !slowest.wants(io.target, took) {
        return None;
    }
    // Without names in the record: the task's, read now ("?" / gone if it has exited).
    let named = named.cloned().unwrap_or_else(|| crate::kernel::cgroupfs::of_task(io.rec.pid));
    let device = topo.name_of(io.target);
    let line = snoop::line(&device, io, ops, topo, snoop::cgroup_text(&named));
    let mut line = serde_json::to_value(line).unwrap_or_default();
    if line["comm"] == "" && io.rec.pid != 0 {
        let comm = std::fs::read_to_string(format!("/proc/{}/comm", io.rec.pid));
        line["comm"] = comm.map_or_else(|_| "?".to_owned(), |c| c.trim_end().to_owned()).into();
    }
    slowest.offer(io.target, &device, took, &line);
    let comm = line["comm"].as_str().filter(|c| !c.is_empty() && *c != "?").map(Arc::from);
    Some((comm, named))
}

/// Writes the slow-IO bars the tracker asked for into the kernel.
fn set_slow_bars(session: &mut Session, shared: &api::Shared) -> Result<()> {
    let pending = shared.slowest.lock().unwrap_or_else(|e| e.into_inner()).take_pending();
    for (dev, ns) in pending {
        session.tracer.set_slow_threshold(dev, ns)?;
    }
    Ok(())
}

/// Sends one IO to every stream whose filter it passes, as a `snoop --json` line.
fn stream(shared: &api::Shared, io: &Io, topo: &Topology, ops: &OpDecoder, named: &Named) {
    let streams = shared.streams.lock().unwrap_or_else(|e| e.into_inner());
    let device = topo.name_of(io.target);
    let mut line: Option<String> = None;
    for s in streams.iter().filter(|s| s.filter.passes(&device, io.rec)) {
        let line = line.get_or_insert_with(|| {
            let snooped = snoop::line(&device, io, ops, topo, snoop::cgroup_text(named));
            let mut l = serde_json::to_string(&snooped).unwrap_or_default();
            l.push('\n');
            l
        });
        s.send(line);
    }
}

/// Series for every device traced at start, when there are enough for all; else they go to
/// devices as they first do IO (a host with dozens of idle loop devices).
/// Returns the devices given one.
fn give_series_to_all(session: &mut Session) -> Result<Vec<u32>> {
    let mut targets: Vec<u32> =
        session.resolved.targets().filter(|&dev| kernel_may_count(session, dev)).collect();
    if targets.len() > session.tracer.series.usage().1 {
        return Ok(vec![]);
    }
    targets.sort_unstable();
    let mut given = Vec::new();
    for dev in targets {
        if session.tracer.give_series(dev)? {
            given.push(dev);
        }
    }
    Ok(given)
}

/// Whether the kernel may count `dev`'s reads and writes itself: a traced device, not below a
/// traced stacked device (whose IO the daemon must see, to join it to its upper IO or count it
/// as naming none).
fn kernel_may_count(session: &Session, dev: u32) -> bool {
    session.resolved.is_target(dev) && session.resolved.upper_of(dev).is_none()
}

fn aggregation_name(a: Aggregation) -> &'static str {
    match a {
        Aggregation::Records => "records",
        Aggregation::Kernel => "kernel",
        Aggregation::Check => "check",
    }
}

/// Adds what the kernel counted since the last fold, and the waits read since (config
/// `causes`), to the series and to the recorder's frame (and to the check: `check` is None unless `--aggregation check`). A cgroup's series
/// is named now, and counted under its label (or `other`) as its records would be.
fn fold_kernel(
    session: &mut Session,
    state: &Mutex<State>,
    frame: &RefCell<FrameBuilder>,
    names: &RefCell<CgroupNames>,
    check: Option<&RefCell<Check>>,
) -> Result<()> {
    // Waits come without a record of their own: counted here, those of every IO.
    let waits = session.take_waits();
    let topo = &session.topo;
    let mut guard = state.lock().unwrap_or_else(|e| e.into_inner());
    let st = &mut *guard;
    let mut check = check.map(RefCell::borrow_mut);
    let mut names = names.borrow_mut();
    let now = std::time::Instant::now();
    if !waits.is_empty() {
        st.agg.add_waits(&waits, |d| topo.name_of(d));
        frame.borrow_mut().add_waits(&waits);
    }
    session.tracer.fold_series(|dev, op, cgroup, counted| {
        let op = if op == agg::READ { Op::Read } else { Op::Write };
        st.kernel_requests += counted.requests;
        st.agg.add_kernel(dev, op, counted, |d| topo.name_of(d));
        frame.borrow_mut().add_kernel(dev, op, counted);
        if let (Some(of), Some(c)) = (cgroup, &mut st.cgroups) {
            let hierarchy = names.mounts.hierarchy(of.task);
            let named = names.named(hierarchy, of.cgroup);
            let l = c.limits.label_of(&named);
            let under = c.add_kernel(dev, op, counted, l.as_deref().map_err(|e| *e), now);
            frame.borrow_mut().add_cgroup_kernel(dev, op, under, counted);
        }
        if let Some(check) = check.as_mut() {
            check.count_kernel(dev, op, cgroup.map(|of| (of.cgroup, of.task)), counted);
        }
    })
}

/// `--aggregation check`: the kernel's counters beside the same IOs' records, counted in the
/// daemon with its own stage definitions. Equal, series by series, or the run fails.
/// With cgroup labels, series by cgroup id (and whether it is the task's) too.
#[derive(Debug, Default)]
struct Check {
    by_cgroup: bool,
    kernel: BTreeMap<CheckKey, SeriesAgg>,
    records: BTreeMap<CheckKey, SeriesAgg>,
}

/// Device, op, and the cgroup (id, task's) where series are per cgroup.
type CheckKey = (u32, Op, Option<(u64, bool)>);

impl Check {
    fn count_kernel(&mut self, dev: u32, op: Op, cgroup: Option<(u64, bool)>, counted: &SeriesAgg) {
        let total = self.kernel.entry((dev, op, cgroup)).or_default();
        *total = total.wrapping_add(counted);
    }

    fn count_record(&mut self, dev: u32, op: Op, rec: &tracer_common::IoRecord) {
        let cgroup = self.by_cgroup.then_some((rec.cgroup, rec.flags & flag::CGROUP_TASK != 0));
        self.records.entry((dev, op, cgroup)).or_default().add_record(rec, &[]);
    }

    /// Prints one line per series; fails if any differs.
    fn verdict(&self, name: impl Fn(u32) -> String) -> Result<()> {
        let keys: std::collections::BTreeSet<_> = self.kernel.keys().chain(self.records.keys()).collect();
        let mut differ = 0;
        for key in keys {
            let (dev, op, cgroup) = *key;
            let (k, r) = (
                self.kernel.get(key).copied().unwrap_or_default(),
                self.records.get(key).copied().unwrap_or_default(),
            );
            let what = match cgroup {
                None => format!("{} {}", name(dev), op.as_str()),
                Some((id, task)) => {
                    format!("{} {} cgroup {id}{}", name(dev), op.as_str(), if task { " (task)" } else { "" })
                }
            };
            if k == r {
                println!("aggregation check: {what}: {} requests, kernel and records agree", k.requests);
            } else {
                differ += 1;
                println!(
                    "aggregation check: {what}: kernel and records DIFFER\n  kernel:  {k:?}\n  records: {r:?}"
                );
            }
        }
        if self.kernel.is_empty() {
            bail!("aggregation check: the kernel aggregated no IO, so nothing was compared");
        }
        if differ > 0 {
            bail!("aggregation check: {differ} series differ between the kernel's counters and the records");
        }
        Ok(())
    }
}
