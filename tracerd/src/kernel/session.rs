//! A tracing session: the loaded programs, the device selection, and the ring-buffer reader
//! that hands each decoded record (with the traced device it counts towards) to a consumer.

use std::{collections::HashSet, time::Duration};

use anyhow::Result;
use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;
use tracer_common::{AheadRecord, IoRecord, WaitRecord, flag, kind, own};

use crate::{
    kernel::causes::WaitReader,
    kernel::record,
    kernel::tracer::{LoadOptions, ProgramTotals, Tracer},
    kernel::uevents::{Rescan, Uevents},
    model::aggregate::Lost,
    model::causes::{PendingWaits, Phase as WaitPhase, ThreadWaits, Wait, WaitSum, WaitTotals, Waker},
    model::layers::{LayerSplit, Layers, MAX_LOWERS},
    model::op::OpDecoder,
    model::selection::{Resolved, Selection},
    model::topology::Topology,
};

/// One traced IO as handed to consumers.
pub struct Io<'a> {
    /// The traced device (series) it counts towards.
    pub target: u32,
    pub rec: &'a IoRecord,
    /// For an IO of a stacked device: its time split against each device below.
    pub layers: &'a [LayerSplit],
    /// Its submitter's waits inside its phases (config `causes`), in the order they ended.
    pub waits: &'a [Wait],
    /// A request's numbers among its disk's G's and D's (config `causes`, tracerd's own
    /// programs), from which who went ahead of it counts.
    pub ahead: Option<&'a AheadRecord>,
}

/// How often the ring buffer is drained when the kernel has not woken us, while records come.
const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// The longest wait between drains: each empty drain doubles the wait up to it, so that an
/// agent whose IO is counted in the kernel does not wake 50 times a second for nothing.
const POLL_IDLE: Duration = Duration::from_millis(320);

pub struct Session {
    pub tracer: Tracer,
    pub topo: Topology,
    selection: Selection,
    pub resolved: Resolved,
    events: AsyncFd<RingBuf<MapData>>,
    /// Counters of the daemon's own losses (decode errors, stale entries).
    own_lost: Lost,
    layers: Layers,
    /// All records read, including those of untraced devices.
    pub records: u64,
    /// Block device events, where the socket opened: sysfs is rescanned when they say so.
    uevents: Option<Uevents>,
    rescan: Rescan,
    /// The wait before the next drain (POLL_INTERVAL to POLL_IDLE).
    poll: Duration,
    /// With causes on: wait records read, and those whose IO's record has not come yet.
    waits: Option<Waits>,
    /// Requests' numbers (config `causes`), until their records come.
    numbered: Numbered,
}

/// Requests' numbers among their disk's G's and D's, sent at their D, until their record comes
/// at C. A request is issued again only after it completed, so its address names one request.
#[derive(Default)]
struct Numbered(std::collections::HashMap<u64, AheadRecord>);

impl Numbered {
    /// More requests than any machine has in flight: numbers left here are those of requests
    /// whose record was lost (counted where it was lost), kept until the address is reused.
    const MAX: usize = 1 << 18;

    fn put(&mut self, a: AheadRecord) {
        if self.0.len() >= Numbered::MAX && !self.0.contains_key(&a.id) {
            tracing::warn!("{} requests numbered without a record: dropped their numbers", self.0.len());
            self.0.clear();
        }
        self.0.insert(a.id, a);
    }

    fn take(&mut self, id: u64) -> Option<AheadRecord> {
        if self.0.is_empty() { None } else { self.0.remove(&id) }
    }
}

/// Waits as the reader joins them to their IOs.
pub struct Waits {
    reader: WaitReader,
    pending: PendingWaits,
    /// Layers' threads' waits, until the hand-offs they fall in are read.
    threads: ThreadWaits,
    /// Waits of traced devices' IOs read since the last `take_waits`.
    fresh: WaitTotals,
}

impl Session {
    /// Resolves the devices, loads and attaches the programs. Needs a tokio runtime.
    pub fn start(selection: Selection, opts: &LoadOptions) -> Result<Session> {
        // Listening before the first scan: no device can come between the two unseen.
        let uevents = Uevents::open()
            .inspect_err(|e| {
                tracing::info!("no device events ({e}): block devices are rescanned every second instead")
            })
            .ok();
        let topo = Topology::scan()?;
        // Resolve before loading, so an unknown --device fails before anything is attached.
        let resolved = selection.resolve(&topo)?;
        let opts = LoadOptions { targets: resolved.targets().count(), ..opts.clone() };
        let mut tracer = Tracer::load(&opts)?;
        tracer.set_devices(&resolved.kernel_devs, &resolved.paths, &topo)?;
        let waits = match tracer.causes_on() {
            true => Some(Waits {
                reader: WaitReader::new(tracer.take_stacks()?),
                pending: PendingWaits::default(),
                threads: ThreadWaits::default(),
                fresh: WaitTotals::default(),
            }),
            false => None,
        };
        // SAFETY: the ring buffer owns its fd and lives inside the AsyncFd until both drop.
        let attached = tracer.hooks.iter().filter(|h| h.attached()).count();
        tracing::info!("attached {attached} hooks; tracing {} block devices", resolved.kernel_devs.len());
        let events = unsafe { AsyncFd::register(tracer.take_events()?) }
            .map_err(|e| anyhow::anyhow!("cannot poll the ring buffer: {e}"))?;
        Ok(Session {
            tracer,
            topo,
            selection,
            resolved,
            events,
            own_lost: Lost::default(),
            layers: Layers::default(),
            records: 0,
            uevents,
            rescan: Rescan::default(),
            poll: POLL_INTERVAL,
            waits,
            numbered: Numbered::default(),
        })
    }

    /// Picks up devices that came or went since the last scan; called every second, it scans
    /// sysfs when a device event came, and otherwise only now and then (`kernel::uevents`).
    pub fn refresh_devices(&mut self) -> Result<()> {
        if !self.rescan.due(self.uevents.as_mut().map(Uevents::block_changed)) {
            return Ok(());
        }
        let topo = Topology::scan()?;
        // IOs still in flight on a device that vanished will never complete here.
        let gone: HashSet<u32> =
            self.topo.devices().map(|d| d.dev).filter(|dev| topo.get(*dev).is_none()).collect();
        if !gone.is_empty() {
            let n = self.tracer.sweep_devices(&gone)?;
            self.own_lost.device_gone += n;
            if n > 0 {
                tracing::warn!("{n} IOs were in flight on vanished devices; counted as lost (device_gone)");
            }
        }
        match self.selection.resolve(&topo) {
            Ok(resolved) => {
                if resolved != self.resolved {
                    let names = |a: &HashSet<u32>, b: &HashSet<u32>| {
                        let mut v: Vec<String> = a.difference(b).map(|d| topo.name_of(*d)).collect();
                        v.sort();
                        v.join(" ")
                    };
                    tracing::info!(
                        "traced devices changed: added [{}], removed [{}]",
                        names(&resolved.kernel_devs, &self.resolved.kernel_devs),
                        names(&self.resolved.kernel_devs, &resolved.kernel_devs)
                    );
                    // New devices may come with their modules (md, dm): probe their submit paths
                    // (before the devices are set, which records whether those are hooked) and
                    // read their BTF.
                    self.tracer.retry_kprobes();
                    self.tracer.set_devices(&resolved.kernel_devs, &resolved.paths, &topo)?;
                    self.resolved = resolved;
                    if let Err(e) = self.tracer.retry_chains() {
                        tracing::warn!("{e:#}");
                    }
                }
            }
            // A named device vanished: keep tracing the rest as they were.
            Err(e) => tracing::warn!("{e:#}"),
        }
        self.topo = topo;
        Ok(())
    }

    /// Evicts in-flight entries older than `stale_after`, counting them.
    pub fn sweep(&mut self, stale_after: Duration) -> Result<()> {
        let (bios, requests) = self.tracer.sweep_stale(stale_after)?;
        self.own_lost.stale_bio += bios;
        self.own_lost.stale_request += requests;
        Ok(())
    }

    /// Every lost-event counter, kernel and daemon.
    pub fn lost(&self) -> Result<Lost> {
        self.lost_with(&self.tracer.program_totals())
    }

    /// [`Session::lost`], with program counters the caller has just read.
    pub fn lost_with(&self, programs: &ProgramTotals) -> Result<Lost> {
        Ok(Lost {
            kernel: self.tracer.kernel_lost()?,
            orphaned_lower: self.layers.orphaned,
            recursion: programs.recursion_misses,
            ..self.own_lost
        })
    }

    /// Waits until records are ready, then hands each to `f` with its traced device.
    /// The kernel commits records without waking us (a wakeup per IO costs an IPI), so this
    /// also returns every POLL_INTERVAL to drain what accumulated, less often while nothing
    /// does (up to POLL_IDLE); a reader far behind is woken at once.
    pub async fn read(&mut self, f: impl FnMut(&Io, &Topology)) -> Result<()> {
        let mut reader = Reader {
            resolved: &self.resolved,
            topo: &self.topo,
            layers: &mut self.layers,
            decode_errors: &mut self.own_lost.decode_error,
            wakeups_unseen: &mut self.own_lost.wakeup_unseen,
            waits: self.waits.as_mut(),
            numbered: &mut self.numbered,
            ops: &self.tracer.ops,
        };
        let n = match tokio::time::timeout(self.poll, self.events.readable_mut()).await {
            Ok(guard) => {
                let mut guard = guard?;
                let n = reader.drain(guard.get_inner_mut(), f);
                guard.clear_ready();
                n
            }
            Err(_) => reader.drain(self.events.get_mut(), f),
        };
        self.poll = if n == 0 { (self.poll * 2).min(POLL_IDLE) } else { POLL_INTERVAL };
        self.records += n;
        Ok(())
    }

    /// The waits of traced devices' IOs read since the last call (empty with causes off),
    /// counted per (device, op, phase, cause): every wait, also of IOs the kernel aggregates.
    pub fn take_waits(&mut self) -> WaitTotals {
        self.waits.as_mut().map(|w| std::mem::take(&mut w.fresh)).unwrap_or_default()
    }

    /// Hands over whatever is in the ring buffer now, without waiting.
    pub fn drain_now(&mut self, f: impl FnMut(&Io, &Topology)) {
        let mut reader = Reader {
            resolved: &self.resolved,
            topo: &self.topo,
            layers: &mut self.layers,
            decode_errors: &mut self.own_lost.decode_error,
            wakeups_unseen: &mut self.own_lost.wakeup_unseen,
            waits: self.waits.as_mut(),
            numbered: &mut self.numbered,
            ops: &self.tracer.ops,
        };
        let n = reader.drain(self.events.get_mut(), f);
        self.records += n;
    }
}

/// Decodes records, joins lower IOs to their upper IO and waits to their IO, and hands traced
/// ones on.
struct Reader<'a> {
    resolved: &'a Resolved,
    topo: &'a Topology,
    layers: &'a mut Layers,
    decode_errors: &'a mut u64,
    wakeups_unseen: &'a mut u64,
    waits: Option<&'a mut Waits>,
    numbered: &'a mut Numbered,
    ops: &'a OpDecoder,
}

impl Reader<'_> {
    fn drain(&mut self, ring: &mut RingBuf<MapData>, mut f: impl FnMut(&Io, &Topology)) -> u64 {
        let mut n = 0;
        let mut splits = [LayerSplit::default(); MAX_LOWERS];
        let mut newest_ns = 0;
        while let Some(item) = ring.next() {
            n += 1;
            if item.len() == size_of::<AheadRecord>() {
                match record::decode_ahead(&item) {
                    Ok(a) => self.numbered.put(a),
                    Err(e) => {
                        *self.decode_errors += 1;
                        tracing::debug!("undecodable record: {e}");
                    }
                }
                continue;
            }
            if item.len() == size_of::<WaitRecord>() {
                match (record::decode_wait(&item), self.waits.as_deref_mut()) {
                    (Ok(rec), Some(w)) => {
                        newest_ns = newest_ns.max(rec.ran_ns);
                        // A hand-off ends with a Q, not a wakeup.
                        if rec.state == tracer_common::wait::BLOCKED
                            && rec.woken_ns == 0
                            && rec.phase != tracer_common::wait::HANDOFF
                        {
                            *self.wakeups_unseen += 1;
                        }
                        if let Some(mut wait) = w.reader.read(&rec) {
                            if wait.phase == WaitPhase::Thread {
                                w.threads.add(wait);
                                continue;
                            }
                            // A hand-off's thread, or a thread the submitter waited for.
                            if let Waker::Task { tid, .. } = &wait.waker {
                                wait.thread = w.threads.within(*tid, wait.slept_ns, wait.ran_ns);
                            }
                            if let Some(target) = self.resolved.target_of_dev(wait.dev) {
                                let key = (target, self.ops.op(rec.opf), wait.phase, wait.cause);
                                w.fresh
                                    .entry(key)
                                    .or_default()
                                    .add(WaitSum { waits: 1, ns: wait.waited_ns() });
                            }
                            w.pending.add(wait);
                        }
                    }
                    (Ok(_), None) => {}
                    (Err(e), _) => {
                        *self.decode_errors += 1;
                        tracing::debug!("undecodable record: {e}");
                    }
                }
                continue;
            }
            let mut rec = match record::decode(&item) {
                Ok(rec) => rec,
                Err(e) => {
                    *self.decode_errors += 1;
                    tracing::debug!("undecodable record: {e}");
                    continue;
                }
            };
            if rec.kind == kind::LINK {
                self.layers.link_also(&rec);
                continue;
            }
            let target = self.resolved.target_of(&rec);
            // The kernel names the kind of a stacked driver's own IO where a parent would be.
            if rec.parent != 0 && rec.parent < own::LIMIT {
                rec.own = rec.parent as u8;
                rec.parent = 0;
            }
            // IO below a traced stack that names no upper IO is counted as such, never lost in
            // the lower device's own numbers.
            let submitted_to = if rec.dev != 0 { rec.dev } else { rec.disk };
            if rec.parent == 0 && rec.kind != kind::MERGE && self.resolved.upper_of(submitted_to).is_some() {
                rec.flags |= flag::UNLINKED;
            }
            if let Some(t) = target {
                self.layers.lower_done(t, &rec);
            }
            let n_splits = self.layers.upper_done(&rec, &mut splits);
            if let Some(target) = target {
                let waits = match self.waits.as_deref_mut() {
                    Some(w) if !w.pending.is_empty() => {
                        w.pending.take(rec.dev, rec.ts[tracer_common::event::Q])
                    }
                    _ => Vec::new(),
                };
                let ahead = match rec.kind {
                    kind::REQUEST => self.numbered.take(rec.id),
                    _ => None,
                };
                let io = Io {
                    target,
                    rec: &rec,
                    layers: &splits[..n_splits],
                    waits: &waits,
                    ahead: ahead.as_ref(),
                };
                f(&io, self.topo);
            }
        }
        if let Some(w) = self.waits.as_deref_mut()
            && newest_ns != 0
        {
            w.pending.expire(newest_ns);
            w.threads.expire(newest_ns);
        }
        n
    }
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
