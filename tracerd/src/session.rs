//! A tracing session: the loaded programs, the device selection, and the ring-buffer reader
//! that hands each decoded record (with the traced device it counts towards) to a consumer.

use std::time::Duration;

use anyhow::Result;
use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;
use tracer_common::IoRecord;

use crate::{
    aggregate::Lost,
    record,
    selection::{Resolved, Selection},
    topology::Topology,
    tracer::{LoadOptions, Tracer},
};

/// In-flight entries older than this are taken as missed completions.
pub const STALE_AFTER: Duration = Duration::from_secs(120);

pub struct Session {
    pub tracer: Tracer,
    pub topo: Topology,
    selection: Selection,
    pub resolved: Resolved,
    events: AsyncFd<RingBuf<MapData>>,
    /// Counters of the daemon's own losses (decode errors, stale entries).
    own_lost: Lost,
    /// All records read, including those of untraced devices.
    pub records: u64,
}

impl Session {
    /// Resolves the devices, loads and attaches the programs. Needs a tokio runtime.
    pub fn start(selection: Selection, opts: &LoadOptions) -> Result<Session> {
        let topo = Topology::scan()?;
        // Resolve before loading, so an unknown --device fails before anything is attached.
        let resolved = selection.resolve(&topo)?;
        let mut tracer = Tracer::load(opts)?;
        tracer.set_devices(&resolved.kernel_devs)?;
        // SAFETY: the ring buffer owns its fd and lives inside the AsyncFd until both drop.
        let attached = tracer.hooks.iter().filter(|h| h.attached()).count();
        tracing::info!("attached {attached} hooks; tracing {} block devices", resolved.kernel_devs.len());
        let events = unsafe { AsyncFd::register(tracer.take_events()?) }
            .map_err(|e| anyhow::anyhow!("cannot poll the ring buffer: {e}"))?;
        Ok(Session { tracer, topo, selection, resolved, events, own_lost: Lost::default(), records: 0 })
    }

    /// Picks up devices that came or went since the last scan.
    pub fn refresh_devices(&mut self) -> Result<()> {
        let topo = Topology::scan()?;
        match self.selection.resolve(&topo) {
            Ok(resolved) => {
                if resolved != self.resolved {
                    self.tracer.set_devices(&resolved.kernel_devs)?;
                    self.resolved = resolved;
                }
            }
            // A named device vanished: keep tracing the rest as they were.
            Err(e) => tracing::warn!("{e:#}"),
        }
        self.topo = topo;
        Ok(())
    }

    /// Evicts stale in-flight entries, counting them.
    pub fn sweep(&mut self) -> Result<()> {
        let (bios, requests) = self.tracer.sweep_stale(STALE_AFTER)?;
        self.own_lost.stale_bio += bios;
        self.own_lost.stale_request += requests;
        Ok(())
    }

    /// Every lost-event counter, kernel and daemon.
    pub fn lost(&self) -> Result<Lost> {
        Ok(Lost { kernel: self.tracer.kernel_lost()?, ..self.own_lost })
    }

    /// Waits until records are ready, then hands each to `f` with its traced device.
    pub async fn read(&mut self, f: impl FnMut(u32, &IoRecord, &Topology)) -> Result<()> {
        let mut guard = self.events.readable_mut().await?;
        let n = drain(guard.get_inner_mut(), &self.resolved, &self.topo, &mut self.own_lost.decode_error, f);
        self.records += n;
        guard.clear_ready();
        Ok(())
    }

    /// Hands over whatever is in the ring buffer now, without waiting.
    pub fn drain_now(&mut self, f: impl FnMut(u32, &IoRecord, &Topology)) {
        let n = drain(self.events.get_mut(), &self.resolved, &self.topo, &mut self.own_lost.decode_error, f);
        self.records += n;
    }
}

fn drain(
    ring: &mut RingBuf<MapData>,
    resolved: &Resolved,
    topo: &Topology,
    decode_errors: &mut u64,
    mut f: impl FnMut(u32, &IoRecord, &Topology),
) -> u64 {
    let mut n = 0;
    while let Some(item) = ring.next() {
        n += 1;
        match record::decode(&item) {
            Ok(rec) => {
                if let Some(target) = resolved.target_of(&rec) {
                    f(target, &rec, topo);
                }
            }
            Err(e) => {
                *decode_errors += 1;
                tracing::debug!("undecodable record: {e}");
            }
        }
    }
    n
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
