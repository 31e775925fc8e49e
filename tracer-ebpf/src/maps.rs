//! The maps and read-only globals the programs share, with the small accessors every hook
//! uses: the loader's layout and settings, ring-buffer commit flags, lost-event counters, and
//! the device filter.

use core::ptr::read_volatile;

use aya_ebpf::{
    bindings::BPF_F_MMAPABLE,
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf, StackTrace},
};
use tracer_common::{
    BioState, CgroupSeriesKey, Completing, DeviceState, Handoff, Holder, IoRecord, KernelLayout, QosWait,
    RequestState, SeriesAgg, Settings, Slot, StackLayout, SubmitState, WaitRecord, agg, event, limits, lost,
    wait,
};

/// Struct offsets of the running kernel, written by the loader (read-only data).
#[unsafe(no_mangle)]
pub(crate) static LAYOUT: KernelLayout = KernelLayout::ZERO;

/// Bios between Q and their request (or merge, or completion). Key: `struct bio *`. The slot
/// tables are mmapable: the daemon scans them in place (tracerd/src/kernel/slot_view.rs).
#[map]
pub(crate) static BIOS: Array<Slot<BioState>> = Array::with_max_entries(limits::BIO_SLOTS, BPF_F_MMAPABLE);

/// Requests between first I/D and full completion. Key: `struct request *`.
#[map]
pub(crate) static REQUESTS: Array<Slot<RequestState>> =
    Array::with_max_entries(limits::REQUEST_SLOTS, BPF_F_MMAPABLE);

/// Traced disks and partitions, with each disk's in-flight count. Key: kernel `dev_t`.
#[map]
pub(crate) static DEVICES: HashMap<u32, DeviceState> = HashMap::with_max_entries(limits::MAX_DEVICES, 0);

/// One `IoRecord` per completed request or merged bio.
#[map]
pub(crate) static EVENTS: RingBuf = RingBuf::with_byte_size(limits::RINGBUF_BYTES, 0);

/// Start-up choices (read-only data).
#[unsafe(no_mangle)]
pub(crate) static SETTINGS: Settings = Settings {
    wakeup_records: 0,
    all_devices: 0,
    aggregate: 0,
    op_mask: 0,
    op_read: 0,
    op_write: 0,
    cgroups: 0,
    rq_qos: 0,
    causes: 0,
    _pad: 0,
    wbt_inflight_cb: 0,
    iolat_acquire_inflight: 0,
};

/// The in-kernel aggregation (`tracer_common::agg`): per CPU, one entry per (device series,
/// op). Index: `(series - 1) * agg::OPS + op`.
#[map]
pub(crate) static SERIES: PerCpuArray<SeriesAgg> =
    PerCpuArray::with_max_entries(limits::SERIES_DEVICES * agg::OPS, 0);

/// Each traced device's series (1-based; 0 = none), indexed by `DeviceState::index`. Apart
/// from `DEVICES` so that the daemon can give a busy device a series without rewriting its
/// in-flight count.
#[map]
pub(crate) static SERIES_OF: Array<u32> = Array::with_max_entries(limits::MAX_DEVICES + 1, 0);

/// Per-cgroup series, with `Settings::cgroups`: (cgroup, device series, op) to an index into
/// `CGROUP_AGG`. Written by the daemon; sized at load (one entry where labels are off).
#[map]
pub(crate) static CGROUP_SERIES: HashMap<CgroupSeriesKey, u32> = HashMap::with_max_entries(1, 0);

/// The per-cgroup series' counters, per CPU, by the index `CGROUP_SERIES` gives.
#[map]
pub(crate) static CGROUP_AGG: PerCpuArray<SeriesAgg> = PerCpuArray::with_max_entries(1, 0);

/// Non-zero while a view streams IOs from the agent: IOs the kernel aggregates are then sent
/// as records too (flagged `IN_KERNEL`). Written by the daemon; `SETTINGS` cannot change after
/// load.
#[map]
pub(crate) static STREAM: Array<u32> = Array::with_max_entries(1, 0);

/// Per traced device (by `DeviceState::index`): an IO the kernel aggregates is also sent as a
/// record when it took at least this long (ns; 0: never). The daemon keeps it at the slowest
/// IOs' entry bar of the minute, so that it sees the slowest IOs whole.
#[map]
pub(crate) static SLOW_NS: Array<u64> = Array::with_max_entries(limits::MAX_DEVICES + 1, 0);

/// How lower IOs are linked, and the stacked drivers' offsets (`StackLayout`): one entry,
/// written by the daemon at load and again when a module's BTF appears.
#[map]
pub(crate) static STACK: Array<StackLayout> = Array::with_max_entries(1, 0);

/// Lower bios remapped by a stacked device, until their Q. Key: lower `struct bio *`;
/// value: the upper `struct bio *`.
#[map]
pub(crate) static LINKS: HashMap<u64, u64> = HashMap::with_max_entries(limits::MAX_LINKS, 0);

/// Tasks in an rq-qos wait, then with a finished wait for their bio's G to take. Key: thread id.
#[map]
pub(crate) static QOS_WAITS: HashMap<u32, QosWait> = HashMap::with_max_entries(limits::MAX_SUBMITTERS, 0);

/// Finished waits in `QOS_WAITS` not yet taken: G looks there only while this is non-zero.
#[map]
pub(crate) static QOS_PENDING: Array<u64> = Array::with_max_entries(1, 0);

/// Tasks inside a stacked device's submit function. Key: thread id.
#[map]
pub(crate) static SUBMITTING: HashMap<u32, SubmitState> =
    HashMap::with_max_entries(limits::MAX_SUBMITTERS, 0);

/// Per CPU: the running task that queued a bio and has not left the CPU since (`sched`).
#[map]
pub(crate) static HOLDER: PerCpuArray<Holder> = PerCpuArray::with_max_entries(1, 0);

/// Per CPU: how deep in interrupts it runs (0 task, then softirq and hardirq levels).
#[map]
pub(crate) static LEVEL: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Per CPU and level: the IO whose completion is running there, if any.
#[map]
pub(crate) static COMPLETING: PerCpuArray<Completing> = PerCpuArray::with_max_entries(wait::LEVELS, 0);

/// Tasks asleep (or preempted) inside an IO's phase, with their wait so far. Key: thread id.
#[map]
pub(crate) static WAITERS: HashMap<u32, WaitRecord> = HashMap::with_max_entries(limits::MAX_WAITERS, 0);

/// Wakeups of a task that came between its dequeue and its sched_switch (the waker does not
/// wait for the switch to end before its tracepoint), kept for the wait that switch starts.
/// Key: thread id.
#[map]
pub(crate) static EARLY_WAKES: LruHashMap<u32, WaitRecord> =
    LruHashMap::with_max_entries(limits::EARLY_WAKES, 0);

/// Lower bios remapped by a task and not yet queued (`causes` on): a Q in another task is a
/// hand-off to the layer's thread. LRU: a lower bio the layer drops without a Q leaves no entry
/// for good. Key: the lower bio's key.
#[map]
pub(crate) static HANDOFFS: LruHashMap<u64, Handoff> = LruHashMap::with_max_entries(limits::HANDOFFS, 0);

/// Per CPU: the task that remapped a lower bio here (`causes` on) and has not since woken a
/// task or left the CPU. The next task it wakes is the layer's thread it hands the bio to.
#[map]
pub(crate) static HANDING: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Layers' threads woken by a task with a lower bio to hand off, until they queue a handed-off
/// bio: their sleeps are the hand-off's. Value: when they were woken. Key: thread id. LRU: a
/// thread that exits while followed (a kworker) leaves no entry for good.
#[map]
pub(crate) static WORKERS: LruHashMap<u32, u64> = LruHashMap::with_max_entries(limits::WORKERS, 0);

/// How many entries `WAITERS` holds: wakeups and switches look there only while it is non-zero.
#[map]
pub(crate) static WAITING: Array<u64> = Array::with_max_entries(1, 0);

/// Kernel stacks of sleepers and their wakers, by id.
#[map]
pub(crate) static STACKS: StackTrace = StackTrace::with_max_entries(limits::STACKS, 0);

/// Records committed on this CPU since it last woke the reader.
#[map]
pub(crate) static SINCE_WAKEUP: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Lost events per reason (`tracer_common::lost`), per CPU.
#[map]
pub(crate) static LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(lost::KERNEL_COUNT, 0);

/// The layout the loader wrote. The pointer goes through a volatile read so the compiler
/// neither folds the fields to the compiled-in zeros nor copies the whole struct per use.
#[inline(always)]
pub(crate) fn layout() -> &'static KernelLayout {
    let layout = &raw const LAYOUT;
    // SAFETY: a pointer to our own global, read back from the stack.
    unsafe { &*read_volatile(&layout) }
}

/// Whether a view streams IOs from the agent (`STREAM`).
#[inline(always)]
pub(crate) fn streaming() -> bool {
    STREAM.get(0).is_some_and(|v| *v != 0)
}

/// Whether an IO of `disk` is among the slow ones the daemon wants whole (`SLOW_NS`): Q to C,
/// or D to C where no Q was seen. While the bar is at its floor the minute's list is not full:
/// such a record wakes the reader at once (its commit), so the bar rises after a read of a few
/// records, not after a poll's worth of IOs sent whole.
#[inline(always)]
pub(crate) fn slow(rec: &IoRecord, disk: Option<*mut DeviceState>) -> bool {
    let Some(disk) = disk else { return false };
    // SAFETY: a live map value; `index` is written once, at insert.
    let index = unsafe { (*disk).index };
    let Some(&threshold) = SLOW_NS.get(index) else { return false };
    let start = if rec.ts[event::Q] != 0 { rec.ts[event::Q] } else { rec.ts[event::D] };
    if threshold == 0 || start == 0 || rec.ts[event::C].wrapping_sub(start) < threshold {
        return false;
    }
    if threshold <= limits::SLOW_FLOOR_NS {
        wake_at_next_commit();
    }
    true
}

/// The next record this CPU commits wakes the reader (see `commit_flags`).
#[inline(always)]
fn wake_at_next_commit() {
    if let Some(since) = SINCE_WAKEUP.get_ptr_mut(0) {
        // SAFETY: per-CPU slot, no concurrent writer.
        unsafe { *since = u32::MAX - 1 };
    }
}

/// The start-up choices, read once per use (volatile: the loader's values, not the zeros).
#[inline(always)]
pub(crate) fn settings() -> Settings {
    // SAFETY: a plain read of our own global.
    unsafe { read_volatile(&SETTINGS) }
}

/// The stacking layout, where something can link lower IOs to upper ones (`links`).
#[inline(always)]
pub(crate) fn stacking() -> Option<&'static StackLayout> {
    STACK.get(0).filter(|s| s.links != 0)
}

/// Whether an NVMe multipath path disk is traced (see `StackLayout::paths`).
#[inline(always)]
pub(crate) fn paths_traced() -> bool {
    STACK.get(0).is_some_and(|s| s.paths != 0)
}

/// Commit flags: no wakeup, but for every `wakeup_records`-th record of a CPU. Asking the ring
/// buffer how much data waits (BPF_RB_AVAIL_DATA) reads the reader's position, a cache line
/// the reader's CPU writes: about 80 ns per record. A per-CPU count costs nothing shared.
#[inline(always)]
pub(crate) fn commit_flags() -> u64 {
    const BPF_RB_NO_WAKEUP: u64 = 1;
    const BPF_RB_FORCE_WAKEUP: u64 = 2;
    // SAFETY: a plain read of our own global.
    let threshold = unsafe { read_volatile(&SETTINGS) }.wakeup_records;
    let Some(since) = SINCE_WAKEUP.get_ptr_mut(0) else { return BPF_RB_NO_WAKEUP };
    // SAFETY: per-CPU slot, no concurrent writer.
    unsafe {
        *since += 1;
        if *since < threshold {
            return BPF_RB_NO_WAKEUP;
        }
        *since = 0;
    }
    BPF_RB_FORCE_WAKEUP
}

#[inline(always)]
pub(crate) fn count_lost(reason: u32) {
    if let Some(counter) = LOST.get_ptr_mut(reason) {
        // SAFETY: per-CPU slot, no concurrent writer.
        unsafe { *counter += 1 };
    }
}

/// A traced multipath path disk (the daemon marks them).
#[inline(always)]
pub(crate) fn is_path(dev: u32) -> bool {
    // SAFETY: copy out of a map value.
    unsafe { DEVICES.get(&dev) }.is_some_and(|d| d.path != 0)
}

pub(crate) fn is_traced(dev: u32) -> bool {
    // SAFETY: a plain read of our own global; then a read-only presence check.
    unsafe { read_volatile(&SETTINGS).all_devices != 0 || DEVICES.get(&dev).is_some() }
}
