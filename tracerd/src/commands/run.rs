//! `tracerd run`: the host agent. Traces until SIGINT/SIGTERM and serves `/metrics`.

use std::{
    cell::RefCell,
    collections::{BTreeMap, HashSet},
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Result, bail};
use tracer_common::{SeriesAgg, agg, flag, kind};

use crate::{
    config::HttpSecurity,
    kernel::session::{Io, Session, shutdown_signal},
    kernel::tracer::{Aggregation, LoadOptions, kernel_release},
    model::aggregate::{Aggregator, Lost, SeriesLimits, count_like_the_kernel},
    model::op::Op,
    model::selection::Selection,
    model::topology::Topology,
    serve::http,
    serve::metrics::State,
};

/// How often devices are rescanned, lost counters refreshed and the kernel's series folded.
const HOUSEKEEPING: Duration = Duration::from_secs(1);
/// Stale in-flight entries are swept every this many housekeeping ticks at most (a sweep
/// reads both tables, 32768 lookups), and at least four times per `stale_after`.
const SWEEP_EVERY: u64 = 30;
/// The in-flight tables' occupancy is sampled every this many ticks (a scan is 32768 lookups).
const OCCUPANCY_EVERY: u64 = 10;

pub async fn run(
    listen: SocketAddr,
    limits: SeriesLimits,
    security: &HttpSecurity,
    stale_after: Duration,
    selection: Selection,
    opts: LoadOptions,
) -> Result<()> {
    // Bind first, read the TLS and password files: a port in use or a bad certificate fails
    // before anything is loaded into the kernel.
    let listener = http::bind(listen).await?;
    let security = http::Security::load(security)?;
    let scheme = security.scheme();
    let mut session = Session::start(selection, &opts)?;
    let ops = session.tracer.ops;
    let aggregation = opts.aggregation;
    if aggregation != Aggregation::Records {
        give_series_to_all(&mut session)?;
    }
    let state = Arc::new(Mutex::new(State {
        agg: Aggregator::with_limits(false, limits),
        hooks: session.tracer.hooks.clone(),
        kernel: kernel_release(),
        traced_devices: session.resolved.kernel_devs.len(),
        aggregation: aggregation_name(aggregation),
        kernel_series: if aggregation == Aggregation::Records {
            (0, 0)
        } else {
            session.tracer.series.usage()
        },
        ..Default::default()
    }));
    tokio::spawn(http::serve(listener, state.clone(), security));
    tracing::info!("metrics on {scheme}://{listen}/metrics");
    // Devices whose reads and writes came as records: each gets a series if one is free.
    let wants_series = RefCell::new(HashSet::new());
    let check = RefCell::new(Check::default());
    let on_io = |io: &Io, topo: &Topology| {
        let op = ops.op(io.rec.cmd_flags);
        if io.rec.flags & flag::IN_KERNEL != 0 {
            check.borrow_mut().count_record(io.target, op, io.rec);
            return;
        }
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        st.agg.add(io.target, op, io.rec, io.layers, |d| topo.name_of(d));
        if aggregation != Aggregation::Records
            && io.rec.kind == kind::REQUEST
            && io.rec.parent == 0
            && matches!(op, Op::Read | Op::Write)
        {
            wants_series.borrow_mut().insert(io.target);
        }
    };
    let mut tick = tokio::time::interval(HOUSEKEEPING);
    let mut ticks = 0u64;
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            r = session.read(on_io) => r?,
            _ = tick.tick() => {
                ticks += 1;
                fold_kernel(&mut session, &state, (aggregation == Aggregation::Check).then_some(&check))?;
                for dev in wants_series.borrow_mut().drain() {
                    if session.resolved.is_target(dev) {
                        session.tracer.give_series(dev)?;
                    }
                }
                if ticks.is_multiple_of((stale_after.as_secs() / 4).clamp(1, SWEEP_EVERY)) {
                    session.sweep(stale_after)?;
                }
                let in_flight = if ticks.is_multiple_of(OCCUPANCY_EVERY) || ticks == 1 {
                    Some(session.tracer.occupancy()?)
                } else {
                    None
                };
                session.refresh_devices()?;
                // One bpf_prog_info read per program serves the run counters and the skips.
                let programs = session.tracer.program_totals();
                let lost = session.lost_with(&programs)?;
                let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
                st.agg.lost = Lost { series_limit: st.agg.over_limit, ..lost };
                let topo = &session.topo;
                st.agg.expire(|dev| topo.get(dev).is_some(), std::time::Instant::now());
                st.records = session.records;
                st.programs = programs;
                if let Some(n) = in_flight {
                    st.in_flight = n;
                }
                st.traced_devices = session.resolved.kernel_devs.len();
                if aggregation != Aggregation::Records {
                    st.kernel_series = session.tracer.series.usage();
                }
            }
            _ = &mut shutdown => break,
        }
    }
    if aggregation == Aggregation::Check {
        // Every IO done before the signal has its record in the ring buffer and its counts in
        // the kernel: take both, then compare.
        session.drain_now(on_io);
        fold_kernel(&mut session, &state, (aggregation == Aggregation::Check).then_some(&check))?;
        let topo = session.topo.clone();
        check.borrow().verdict(|d| topo.name_of(d))?;
    }
    tracing::info!("shutting down: detaching every program");
    drop(session);
    Ok(())
}

/// Series for every device traced at start, when there are enough for all; else they go to
/// devices as they first do IO (a host with dozens of idle loop devices).
fn give_series_to_all(session: &mut Session) -> Result<()> {
    let mut targets: Vec<u32> = session.resolved.targets().collect();
    if targets.len() > session.tracer.series.usage().1 {
        return Ok(());
    }
    targets.sort_unstable();
    for dev in targets {
        session.tracer.give_series(dev)?;
    }
    Ok(())
}

fn aggregation_name(a: Aggregation) -> &'static str {
    match a {
        Aggregation::Records => "records",
        Aggregation::Kernel => "kernel",
        Aggregation::Check => "check",
    }
}

/// Adds what the kernel counted since the last fold to the series (and to the check).
/// `check` is None unless `--aggregation check`.
fn fold_kernel(session: &mut Session, state: &Mutex<State>, check: Option<&RefCell<Check>>) -> Result<()> {
    let topo = &session.topo;
    let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
    let mut check = check.map(RefCell::borrow_mut);
    session.tracer.fold_series(|dev, op, counted| {
        let op = if op == agg::READ { Op::Read } else { Op::Write };
        st.agg.add_kernel(dev, op, counted, |d| topo.name_of(d));
        if let Some(check) = check.as_mut() {
            check.count_kernel(dev, op, counted);
        }
    })
}

/// `--aggregation check`: the kernel's counters beside the same IOs' records, counted in the
/// daemon with its own stage definitions. Equal, series by series, or the run fails.
#[derive(Debug, Default)]
struct Check {
    kernel: BTreeMap<(u32, Op), SeriesAgg>,
    records: BTreeMap<(u32, Op), SeriesAgg>,
}

impl Check {
    fn count_kernel(&mut self, dev: u32, op: Op, counted: &SeriesAgg) {
        let total = self.kernel.entry((dev, op)).or_default();
        *total = total.wrapping_add(counted);
    }

    fn count_record(&mut self, dev: u32, op: Op, rec: &tracer_common::IoRecord) {
        count_like_the_kernel(self.records.entry((dev, op)).or_default(), rec);
    }

    /// Prints one line per series; fails if any differs.
    fn verdict(&self, name: impl Fn(u32) -> String) -> Result<()> {
        let keys: std::collections::BTreeSet<_> = self.kernel.keys().chain(self.records.keys()).collect();
        let mut differ = 0;
        for key in keys {
            let (dev, op) = *key;
            let (k, r) = (
                self.kernel.get(key).copied().unwrap_or_default(),
                self.records.get(key).copied().unwrap_or_default(),
            );
            let what = format!("{} {}", name(dev), op.as_str());
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
