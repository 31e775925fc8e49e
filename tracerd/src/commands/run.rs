//! `tracerd run`: the host agent. Traces until SIGINT/SIGTERM and serves `/metrics`.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Result;

use crate::{
    config::HttpSecurity,
    kernel::session::{Session, shutdown_signal},
    kernel::tracer::{LoadOptions, kernel_release},
    model::aggregate::{Aggregator, Lost, SeriesLimits},
    model::selection::Selection,
    serve::http,
    serve::metrics::State,
};

/// How often devices are rescanned and lost counters refreshed.
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
    let state = Arc::new(Mutex::new(State {
        agg: Aggregator::with_limits(false, limits),
        hooks: session.tracer.hooks.clone(),
        kernel: kernel_release(),
        traced_devices: session.resolved.kernel_devs.len(),
        records: 0,
        programs: Default::default(),
        in_flight: (0, 0),
    }));
    tokio::spawn(http::serve(listener, state.clone(), security));
    tracing::info!("metrics on {scheme}://{listen}/metrics");
    let mut tick = tokio::time::interval(HOUSEKEEPING);
    let mut ticks = 0u64;
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            r = session.read(|io, topo| {
                let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
                st.agg.add(io.target, ops.op(io.rec.cmd_flags), io.rec, io.layers, |d| topo.name_of(d));
            }) => r?,
            _ = tick.tick() => {
                ticks += 1;
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
            }
            _ = &mut shutdown => break,
        }
    }
    tracing::info!("shutting down: detaching every program");
    drop(session);
    Ok(())
}
