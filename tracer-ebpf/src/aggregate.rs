//! In-kernel aggregation for the agent: a completed read or write of a device with a series is
//! counted into this CPU's `SeriesAgg` (stages, queue depth, path), instead of crossing the
//! ring buffer as a record; with cgroup labels on, into its (cgroup, device, op) series. The
//! daemon folds the per-CPU counters into its histograms.

use core::{
    intrinsics::{AtomicOrdering, atomic_xadd},
    ptr::read_volatile,
};

use tracer_common::{CgroupSeriesKey, DeviceState, IoRecord, SeriesAgg, agg, event, flag};

use crate::maps::{CGROUP_AGG, CGROUP_SERIES, DEVICES, SERIES, SERIES_OF, settings};

/// Adds to a per-CPU counter. Atomic (a local, uncontended cache line) because a program run
/// in task context can be preempted by another on the same CPU on preemptible kernels.
#[inline(always)]
fn add<T: Copy>(counter: *mut T, n: T) {
    // SAFETY: a counter inside a map value; Relaxed lowers to BPF's non-fetching atomic add.
    unsafe { atomic_xadd::<T, T, { AtomicOrdering::Relaxed }>(counter, n) };
}

/// The series index of a device (`SERIES_OF` by its `DeviceState::index`); 0 = none.
#[inline(always)]
fn series_of(dev: *const DeviceState) -> u32 {
    // SAFETY: map value pointer from a successful lookup.
    let index = unsafe { (*dev).index };
    match SERIES_OF.get(index) {
        Some(&series) => series,
        None => 0,
    }
}

/// Counts a completed request into its device's series. False when it has none (no series
/// given out yet, an op other than read and write, a stacked device's IO whose record the
/// daemon must join): the caller sends it as a record.
pub(crate) fn aggregate(rec: &IoRecord, disk: Option<*mut DeviceState>) -> bool {
    let s = settings();
    let op = match rec.cmd_flags & s.op_mask {
        o if o == s.op_read => agg::READ,
        o if o == s.op_write => agg::WRITE,
        _ => return false,
    };
    // A bio blk-throttle checked has H2Q, and one an rq-qos policy held has a wait, which the
    // series do not count: such IO is limited to its policy's rate, so sending it whole costs
    // little.
    if rec.parent != 0 || rec.flags & flag::CLONED != 0 || rec.ts[event::H] != 0 || rec.qos != 0 {
        return false;
    }
    // The series the daemon counts the IO towards: its partition's when that has one (it was
    // selected), else its disk's.
    let mut series = 0;
    if rec.dev != 0 && rec.dev != rec.disk {
        if let Some(part) = DEVICES.get_ptr(&rec.dev) {
            series = series_of(part);
        }
    }
    if series == 0 {
        if let Some(disk) = disk {
            series = series_of(disk);
        }
    }
    if series == 0 {
        return false;
    }
    if s.cgroups != 0 {
        // Labelled by cgroup: the (cgroup, device, op) series alone; the daemon adds it to the
        // device's when it folds. A key it has not given out yet: a record.
        let key = CgroupSeriesKey {
            cgroup: rec.cgroup,
            series,
            op: op as u16,
            task: (rec.flags & flag::CGROUP_TASK != 0) as u16,
        };
        // SAFETY: copy out of a map value.
        let Some(index) = (unsafe { CGROUP_SERIES.get(&key) }).copied() else {
            return false;
        };
        let Some(a) = CGROUP_AGG.get_ptr_mut(index) else {
            return false;
        };
        count(a, rec);
        return true;
    }
    let Some(a) = SERIES.get_ptr_mut((series - 1) * agg::OPS + op) else {
        return false;
    };
    count(a, rec);
    true
}

#[inline(always)]
fn count(a: *mut SeriesAgg, rec: &IoRecord) {
    // SAFETY: `a` is this CPU's value of a SERIES entry; every index below is bounded.
    unsafe {
        add(&raw mut (*a).requests, 1);
        add(&raw mut (*a).bytes, rec.bytes as u64);
        if rec.error != 0 {
            add(&raw mut (*a).errors, 1);
        }
        if rec.queue_depth != 0 {
            add(&raw mut (*a).qd_sum, rec.queue_depth as u64);
            add(&raw mut (*a).qd_count, 1);
            if let Some(b) = (*a).qd.get_mut(agg::qd_bucket(rec.queue_depth)) {
                add(b, 1);
            }
        }
        let ts = &rec.ts;
        let fired = |e: usize| (ts[e] != 0) as usize;
        let path = fired(event::Q) | fired(event::G) << 1 | fired(event::I) << 2 | fired(event::D) << 3;
        if let Some(p) = (*a).paths.get_mut(path & (agg::PATHS - 1)) {
            add(p, 1);
        }
        // The daemon's stage definitions (model::stage): an interval exists where both of its
        // events fired; G2D only for requests never inserted. One call per stage: an array of
        // intervals would be copied by a byte-loop memmove on the BPF target.
        let ts = &raw const rec.ts;
        count_stage(a, 0, ts, event::Q, event::G);
        count_stage(a, 1, ts, event::G, event::I);
        count_stage(a, 2, ts, event::I, event::D);
        count_stage(a, 3, ts, NOT_INSERTED, event::D);
        count_stage(a, 4, ts, event::Q, event::D);
        count_stage(a, 5, ts, event::D, event::C);
        count_stage(a, 6, ts, event::Q, event::C);
    }
}

/// `count_stage`'s `from` for G2D: G, where I did not fire.
const NOT_INSERTED: usize = usize::MAX;

/// Counts stage `k` (index into `SeriesAgg::hist`) if both of its events fired.
///
/// Each stage reads its stamps from the record again: stamps kept in registers across the
/// seven stages carry what each stage's tests learnt (fired or not, and the bucket search's
/// bounds), so the verifier would walk every combination (on 6.1, past its million
/// instructions); read afresh, every stage's paths end in the same state.
#[inline(always)]
fn count_stage(a: *mut SeriesAgg, k: usize, ts: *const [u64; event::COUNT], from: usize, to: usize) {
    // SAFETY: `ts` points into the record, a map value; the indices are events.
    let read = |e: usize| unsafe { read_volatile(&raw const (*ts)[e]) };
    let from = match from {
        NOT_INSERTED if read(event::I) != 0 => return,
        NOT_INSERTED => read(event::G),
        e => read(e),
    };
    let to = read(to);
    if from == 0 || to == 0 {
        return;
    }
    let ns = to.saturating_sub(from);
    // SAFETY: `a` is this CPU's value of a SERIES entry; the indices are bounded.
    unsafe {
        if let (Some(sum), Some(h)) = ((*a).stage_ns.get_mut(k), (*a).hist.get_mut(k)) {
            add(sum, ns);
            if let Some(b) = h.get_mut(agg::bucket_of(ns)) {
                add(b, 1);
            }
        }
    }
}
