//! `tracerd run`: the host agent. Traces until SIGINT/SIGTERM and serves `/metrics`.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Result;

use crate::{
    aggregate::Aggregator,
    http,
    metrics::State,
    session::{shutdown_signal, Session},
    selection::Selection,
    tracer::{kernel_release, LoadOptions},
};

/// How often devices are rescanned and lost counters refreshed.
const HOUSEKEEPING: Duration = Duration::from_secs(1);
/// Stale in-flight entries are swept every this many housekeeping ticks.
const SWEEP_EVERY: u64 = 30;

pub async fn run(listen: SocketAddr, selection: Selection, opts: LoadOptions) -> Result<()> {
    // Bind first: a port in use fails before anything is loaded into the kernel.
    let listener = http::bind(listen).await?;
    let mut session = Session::start(selection, &opts)?;
    let ops = session.tracer.ops;
    let state = Arc::new(Mutex::new(State {
        agg: Aggregator::new(false),
        hooks: session.tracer.hooks.clone(),
        kernel: kernel_release(),
        traced_devices: session.resolved.kernel_devs.len(),
        records: 0,
    }));
    tokio::spawn(http::serve(listener, state.clone()));
    let attached = session.tracer.hooks.iter().filter(|h| h.attached()).count();
    tracing::info!(
        "tracing {} block devices with {attached} hooks; metrics on http://{listen}/metrics",
        session.resolved.kernel_devs.len()
    );
    let mut tick = tokio::time::interval(HOUSEKEEPING);
    let mut ticks = 0u64;
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            r = session.read(|dev, rec, topo| {
                let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
                st.agg.add(dev, ops.op(rec.cmd_flags), rec, || topo.name_of(dev));
            }) => r?,
            _ = tick.tick() => {
                ticks += 1;
                if ticks % SWEEP_EVERY == 0 {
                    session.sweep()?;
                }
                session.refresh_devices()?;
                let lost = session.lost()?;
                let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
                st.agg.lost = lost;
                st.records = session.records;
                st.traced_devices = session.resolved.kernel_devs.len();
            }
            _ = &mut shutdown => break,
        }
    }
    tracing::info!("shutting down: detaching every program");
    drop(session);
    Ok(())
}
