//! Waits inside an IO's phase (config `causes`), from the scheduler's own tracepoints.
//!
//! Q notes its submitter per CPU (`HOLDER`). When that task leaves the CPU while its bio is
//! still before G (or, on a bio-based device, while it is inside the device's submit function),
//! the wait starts in `WAITERS` with the task's kernel stack. The wakeup names its waker: the
//! IO whose completion is running on the waking CPU at that nesting level (`COMPLETING`, set by
//! the completion hooks, cleared when the level is left), else the current task (an interrupt
//! at a level above the task's). When the task runs again the wait goes to the ring buffer as a
//! `WaitRecord`. No edge comes from timing.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::{
    helpers::{bpf_ktime_get_ns, bpf_probe_read_kernel_buf, generated::bpf_map_lookup_percpu_elem},
    maps::PerCpuArray,
    programs::BtfTracePointContext,
    programs::tracing::StackIdContext,
};
use tracer_common::{Completing, Handoff, Holder, WaitRecord, bio_based, limits, lost, wait};

use crate::{
    kernel::{Direct, Mem, read_current_comm, thread_id},
    maps::{
        BIOS, COMPLETING, DEVICES, EARLY_WAKES, EVENTS, HANDING, HANDOFFS, HOLDER, LEVEL, STACKS, SUBMITTING,
        WAITERS, WAITING, WORKERS, commit_flags, count_lost, layout, settings,
    },
    slots::{copy_comm, copy_words, slot_get, zero_words},
};

/// The nesting level this CPU runs at (0: task context).
#[inline(always)]
fn level() -> u32 {
    LEVEL.get(0).copied().unwrap_or(0)
}

#[inline(always)]
fn completing_at(level: u32) -> Option<*mut Completing> {
    COMPLETING.get_ptr_mut(level)
}

/// Q: the current task holds `bio` until it leaves the CPU. Only in task context: a bio queued
/// from an interrupt is not the interrupted task's.
#[inline(always)]
pub(crate) fn note_holder(bio: u64, queued_ns: u64, dev: u32, opf: u32) {
    if settings().causes == 0 || level() != 0 {
        return;
    }
    if let Some(h) = HOLDER.get_ptr_mut(0) {
        let tid = thread_id();
        // SAFETY: per-CPU slot, no concurrent writer.
        unsafe {
            // A layer's thread stays one while it queues its own IO (md's bitmap writes); a new
            // bio has no lower bio remapped yet.
            (*h).flags = if (*h).tid == tid { (*h).flags & wait::flag::WORKER } else { 0 };
            (*h).bio = bio;
            (*h).queued_ns = queued_ns;
            (*h).dev = dev;
            (*h).opf = opf;
            (*h).tid = tid;
        }
    }
}

/// A stacked device remapped `lower`, a bio it sends for `upper`: noted until the lower bio's Q,
/// which tells whether the layer handed it to a thread of its own. Only in task context.
#[inline(always)]
pub(crate) fn note_remap(lower: u64, upper: u64) {
    if settings().causes == 0 || level() != 0 {
        return;
    }
    let Some(state) = slot_get(&BIOS, limits::BIO_SLOTS, upper) else { return };
    // SAFETY: a slot value; a stale read names an IO no record has, and the daemon drops it.
    let (queued_ns, dev, opf) = unsafe { ((*state).queued_ns, (*state).dev, (*state).opf) };
    if queued_ns == 0 {
        return;
    }
    let h = Handoff {
        remap_ns: unsafe { bpf_ktime_get_ns() },
        upper,
        upper_queued_ns: queued_ns,
        upper_dev: dev,
        upper_opf: opf,
        tid: thread_id(),
        _pad: 0,
    };
    let _ = HANDOFFS.insert(&lower, &h, 0);
    if let Some(handing) = HANDING.get_ptr_mut(0) {
        // SAFETY: per-CPU slot, no concurrent writer.
        unsafe { *handing = h.tid };
    }
    if let Some(holder) = HOLDER.get_ptr_mut(0) {
        // SAFETY: per-CPU slot, no concurrent writer.
        unsafe {
            if (*holder).tid == h.tid && (*holder).bio == upper {
                (*holder).flags |= wait::flag::REMAPPED;
                (*holder).lower = lower;
            }
        }
    }
}

/// Q of `lower` at `queued_ns`, in the current task: if another task remapped it, the layer
/// handed it to this one (md raid1's thread), and the time between is a wait of the upper IO,
/// ended by this task. The edge is the same bio pointer in two tasks, not a timing.
#[inline(always)]
pub(crate) fn take_remap(lower: u64, queued_ns: u64) {
    if settings().causes == 0 {
        return;
    }
    // SAFETY: copy out of a map value.
    let Some(h) = (unsafe { HANDOFFS.get(&lower) }).copied() else { return };
    let _ = HANDOFFS.remove(&lower);
    let tid = thread_id();
    if h.tid == tid || level() != 0 {
        return;
    }
    // Through the hand-off: its next sleeps are its own again.
    if WORKERS.remove(&tid).is_ok() {
        if let Some(holder) = HOLDER.get_ptr_mut(0) {
            // SAFETY: per-CPU slot, no concurrent writer.
            unsafe { (*holder).flags &= !wait::flag::WORKER };
        }
    }
    let Some(mut entry) = EVENTS.reserve::<WaitRecord>(0) else {
        count_lost(lost::RINGBUF_FULL);
        return;
    };
    // SAFETY: the reserved entry is ours until submit.
    unsafe {
        let rec = entry.as_mut_ptr();
        zero_words(rec);
        (*rec).slept_ns = h.remap_ns;
        (*rec).ran_ns = queued_ns;
        (*rec).bio = h.upper;
        (*rec).queued_ns = h.upper_queued_ns;
        (*rec).dev = h.upper_dev;
        (*rec).opf = h.upper_opf;
        (*rec).tid = h.tid;
        (*rec).phase = wait::HANDOFF;
        (*rec).state = wait::BLOCKED;
        (*rec).waker = wait::WAKER_TASK;
        (*rec).waker_tid = tid;
        read_current_comm(layout(), &mut (*rec).waker_comm);
        (*rec).stack = -1;
        (*rec).waker_stack = -1;
    }
    entry.submit(commit_flags());
}

/// A completion hook: `io` (a request's or bio's key, as its record's `id`) is completing on
/// this CPU, with `done_ns` as its C stamp. Wakeups at this level until it is left are its.
#[inline(always)]
pub(crate) fn note_completing(io: u64, disk: u32, done_ns: u64) {
    if settings().causes == 0 {
        return;
    }
    if let Some(c) = completing_at(level()) {
        // SAFETY: per-CPU slot, no concurrent writer.
        unsafe {
            (*c).io = io;
            (*c).done_ns = done_ns;
            (*c).disk = disk;
        }
    }
}

/// An interrupt level is entered (irq_handler_entry, softirq_entry): nothing completes there yet.
pub(crate) fn on_level_enter() {
    let Some(l) = LEVEL.get_ptr_mut(0) else { return };
    // SAFETY: per-CPU slot, no concurrent writer (the level is only changed by its own CPU).
    let next = unsafe { (*l + 1).min(wait::LEVELS - 1) };
    unsafe { *l = next };
    clear_completing(next);
}

/// An interrupt level is left: its completion marks go with it.
pub(crate) fn on_level_exit() {
    let Some(l) = LEVEL.get_ptr_mut(0) else { return };
    // SAFETY: per-CPU slot, no concurrent writer.
    let cur = unsafe { *l };
    clear_completing(cur);
    unsafe { *l = cur.saturating_sub(1) };
}

#[inline(always)]
fn clear_completing(level: u32) {
    if let Some(c) = completing_at(level) {
        // SAFETY: per-CPU slot, no concurrent writer.
        unsafe { (*c).io = 0 };
    }
}

#[inline(always)]
fn waiting() -> bool {
    WAITING.get(0).is_some_and(|n| *n != 0)
}

#[inline(always)]
fn add_waiting(delta: i64) {
    if let Some(n) = WAITING.get_ptr_mut(0) {
        // SAFETY: map value; CPUs update it concurrently.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::SeqCst }>(n, delta as u64) };
    }
}

/// sched_switch(preempt, prev, next, prev_state): the current task (`prev`) leaves the CPU.
pub(crate) fn on_sched_switch(ctx: &BtfTracePointContext, preempt: u64, next: u64, prev_state: u64) {
    // A new task: whatever the old one was completing at task level is not its.
    clear_completing(0);
    // The task leaving woke no thread for its hand-off before it left: none will be taken for one.
    if let Some(handing) = HANDING.get_ptr_mut(0) {
        // SAFETY: per-CPU slot, no concurrent writer.
        unsafe { *handing = 0 };
    }
    // No interrupt level schedules: a level still counted here is one whose exit went unseen
    // (the hooks were attached or detached inside it). Without this, Q on this CPU would
    // never note a holder again.
    if let Some(l) = LEVEL.get_ptr_mut(0) {
        // SAFETY: per-CPU slot, no concurrent writer.
        unsafe { *l = 0 };
    }
    if let Some(h) = HOLDER.get_ptr_mut(0) {
        // SAFETY: per-CPU slot, no concurrent writer.
        let tid = unsafe { (*h).tid };
        if tid != 0 {
            // Any sleeping state (interruptible, uninterruptible, an RT kernel's rtlock
            // wait), not preempted: asleep until woken.
            let state = if preempt == 0 && prev_state != 0 { wait::BLOCKED } else { wait::PREEMPTED };
            if tid == thread_id() {
                start_wait(ctx, h, tid, state, next);
            }
            // SAFETY: as above. The holder leaves with the task (or became its wait), only now:
            // a waker that finds it no longer here finds the wait in `WAITERS`.
            unsafe { (*h).tid = 0 };
        }
    }
    if waiting() {
        let tid: u32 = Direct::read(next, layout().task_pid);
        if tid != 0 {
            end_wait(tid);
        }
    }
}

/// The phase the held bio is in, if a sleep now is part of it: before G, and on a bio-based
/// device only until its submit function returned (after it, the task waits for its own IO).
#[inline(always)]
fn held_phase(tid: u32, h: &Holder) -> Option<u8> {
    let (bio, queued_ns, dev, flags) = (h.bio, h.queued_ns, h.dev, h.flags);
    if bio == 0 {
        return None;
    }
    let state = slot_get(&BIOS, limits::BIO_SLOTS, bio)?;
    // SAFETY: a slot value; a stale read only drops or keeps one wait.
    let (q, g) = unsafe { ((*state).queued_ns, (*state).getrq_ns) };
    if q != queued_ns || g != 0 {
        return None;
    }
    // SAFETY: copy out of a map value.
    if unsafe { SUBMITTING.get(&tid) }.is_some_and(|s| s.bio == bio) {
        return Some(wait::SUBMIT);
    }
    // Out of the submit function with a lower bio remapped and not yet queued: the layer's
    // plug callback is sending it (md raid1's bitmap writes first).
    // (Only while that bio is still to be queued by this task: once another task queued it,
    // this one waits for its own IO.)
    // SAFETY: copy out of a map value.
    if flags & wait::flag::REMAPPED != 0 && unsafe { HANDOFFS.get(&h.lower) }.is_some_and(|r| r.tid == tid) {
        return Some(wait::SUBMIT);
    }
    // SAFETY: copy out of a map value.
    let device = unsafe { DEVICES.get(&dev) }?;
    match device.bio_based {
        bio_based::NO => Some(wait::Q2G),
        // Between Q and the submit function's entry (`submit_bio_noacct`, `__submit_bio`): a
        // preemption there must not lose the holder, or every later wait of the IO is lost.
        // SAFETY: a slot value, as above.
        bio_based::SUBMIT_HOOKED if unsafe { (*state).submit_ns } == 0 => Some(wait::SUBMIT),
        _ => None,
    }
}

#[inline(always)]
fn start_wait(ctx: &BtfTracePointContext, h: *mut Holder, tid: u32, state: u8, next: u64) {
    // SAFETY: per-CPU slot, no concurrent writer.
    let h = unsafe { &*h };
    let (phase, bio, queued_ns) = match held_phase(tid, h) {
        Some(phase) => (phase, h.bio, h.queued_ns),
        None if h.flags & wait::flag::WORKER != 0 && still_worker(tid) => (wait::THREAD, 0, 0),
        None => return,
    };
    let Some(rec) = SCRATCH.get_ptr_mut(0) else { return };
    // SAFETY: per-CPU scratch, ours for this program run.
    unsafe {
        zero_words(rec);
        (*rec).slept_ns = bpf_ktime_get_ns();
        (*rec).bio = bio;
        (*rec).queued_ns = queued_ns;
        if bio != 0 {
            (*rec).dev = h.dev;
            (*rec).opf = h.opf;
        }
        (*rec).tid = tid;
        (*rec).phase = phase;
        (*rec).state = state;
        (*rec).flags = h.flags as u8;
        (*rec).lower = h.lower;
        (*rec).stack = stack_id(ctx);
        (*rec).waker_stack = -1;
        if state == wait::PREEMPTED {
            // No wakeup will come: the task that runs in its place is what it waits for.
            let l = layout();
            (*rec).waker = wait::WAKER_PREEMPTED;
            (*rec).waker_tid = Direct::read(next, l.task_pid);
            let _ =
                bpf_probe_read_kernel_buf((next + l.task_comm as u64) as *const u8, &mut (*rec).waker_comm);
        }
    }
    // SAFETY: the scratch value, read by the map update.
    if WAITERS.insert(&tid, unsafe { &*rec }, 0).is_err() {
        count_lost(lost::WAIT_MAP_FULL);
        return;
    }
    add_waiting(1);
    // A preempted task was not put to sleep: a wakeup kept for it ends no wait of this switch
    // (sched_wakeup drops it).
    if state == wait::BLOCKED {
        if let Some(w) = WAITERS.get_ptr_mut(&tid) {
            take_early_wake(tid, w);
        }
    }
}

/// Per CPU: a wait being built before it goes into `WAITERS` (0, by sched_switch) or an early
/// wakeup before it goes into `EARLY_WAKES` (1, by sched_waking): too large for the BPF stack.
#[aya_ebpf::macros::map]
static SCRATCH: PerCpuArray<WaitRecord> = PerCpuArray::with_max_entries(2, 0);

/// The current task's kernel stack id, or the error (counted) as a negative id.
#[inline(always)]
fn stack_id(ctx: &BtfTracePointContext) -> i32 {
    match ctx.get_stackid(&STACKS, 0) {
        Ok(id) => id as i32,
        Err(e) => {
            count_lost(lost::STACK);
            if e < 0 { e } else { -1 }
        }
    }
}

/// `tid` runs again: a wait of its ends and goes to the ring buffer; it holds its bio again on
/// this CPU (it may sleep again before G).
#[inline(always)]
fn end_wait(tid: u32) {
    let Some(w) = WAITERS.get_ptr_mut(&tid) else { return };
    let now = unsafe { bpf_ktime_get_ns() };
    match EVENTS.reserve::<WaitRecord>(0) {
        Some(mut entry) => {
            // SAFETY: the reserved entry is ours until submit; `w` is a live map value.
            unsafe {
                let rec = entry.as_mut_ptr();
                copy_words(rec, w);
                (*rec).ran_ns = now;
            }
            entry.submit(commit_flags());
        }
        None => count_lost(lost::RINGBUF_FULL),
    }
    if let Some(h) = HOLDER.get_ptr_mut(0) {
        // SAFETY: per-CPU slot; `w` is live until removed below.
        unsafe {
            (*h).bio = (*w).bio;
            (*h).queued_ns = (*w).queued_ns;
            (*h).dev = (*w).dev;
            (*h).opf = (*w).opf;
            (*h).tid = tid;
            (*h).flags = (*w).flags as u32;
            (*h).lower = (*w).lower;
        }
    }
    if WAITERS.remove(&tid).is_ok() {
        add_waiting(-1);
    }
}

/// sched_waking(p): the first wakeup of a waiting task names its waker. A task can be woken
/// before its sched_switch: the scheduler may have begun to put it to sleep (the waker then
/// waits for the switch to end), or it is still running, and the wakeup ends the sleep before
/// it begins. Which of the two is decided after this tracepoint, so while the task still holds
/// its bio on its CPU the wakeup is kept for the wait its switch starts (`EARLY_WAKES`), and
/// dropped by sched_wakeup if it woke a task that never left ([`on_sched_wakeup`]).
pub(crate) fn on_sched_waking(ctx: &BtfTracePointContext, task: u64) {
    let tid: u32 = Direct::read(task, layout().task_pid);
    // The holder first, `WAITERS` after: the switch fills them the other way round, so a
    // wakeup that no longer finds the holder finds the wait.
    keep_early_wake(ctx, task, tid);
    mark_worker(ctx, tid);
    if waiting() {
        if let Some(w) = WAITERS.get_ptr_mut(&tid) {
            name_waker(ctx, w);
        }
    }
}

/// sched_wakeup(p): the task is runnable again. Where the wakeup found it still queued, this
/// runs before any switch of it, and a wakeup kept for its next wait is not that wait's; where
/// the task had left (or was leaving) the CPU, this runs after its switch, which took the kept
/// wakeup already.
pub(crate) fn on_sched_wakeup(task: u64) {
    let tid: u32 = Direct::read(task, layout().task_pid);
    // A lookup before the delete: nearly every wakeup has nothing kept, and a hash delete
    // takes its bucket's lock even for a key that is not there.
    // SAFETY: a presence check on a map value.
    if unsafe { EARLY_WAKES.get(&tid) }.is_some() {
        let _ = EARLY_WAKES.remove(&tid);
    }
}

/// How long a layer's thread woken for a hand-off is followed without queuing a handed-off bio:
/// a task woken by a submitter between its remap and its switch that is not the layer's thread
/// is let go after this.
const WORKER_NS: u64 = 1_000_000_000;

/// The wakeup of `tid` by a task that remapped a lower bio on this CPU since it last switched:
/// the layer's thread it hands the bio to (md's `md_wakeup_thread`, right after the remap or
/// from the plug flushed as the submitter sleeps). From now until that thread queues a
/// handed-off bio, its waits are the hand-off's; the first is this one, until it runs.
#[inline(always)]
fn mark_worker(ctx: &BtfTracePointContext, tid: u32) {
    let Some(handing) = HANDING.get_ptr_mut(0) else { return };
    // SAFETY: per-CPU slot, no concurrent writer.
    let by = unsafe { *handing };
    if by == 0 || by != thread_id() || level() != 0 {
        return;
    }
    // SAFETY: as above. One thread per hand-off: the first task it wakes.
    unsafe { *handing = 0 };
    let now = unsafe { bpf_ktime_get_ns() };
    if WORKERS.insert(&tid, &now, 0).is_err() {
        return;
    }
    let Some(rec) = SCRATCH.get_ptr_mut(1) else { return };
    // SAFETY: per-CPU scratch, ours for this program run.
    unsafe {
        zero_words(rec);
        (*rec).slept_ns = now;
        (*rec).tid = tid;
        (*rec).phase = wait::THREAD;
        (*rec).state = wait::WOKEN;
        // Given back to its holder slot when it runs: a worker from then on.
        (*rec).flags = wait::flag::WORKER as u8;
        (*rec).stack = -1;
        name_waker(ctx, rec);
    }
    // A thread wait it is in (asleep since its last work, before this wakeup) is replaced: its
    // part in this hand-off starts now. A wait of an IO of its own is not.
    // SAFETY: copy out of a map value.
    let was = unsafe { WAITERS.get(&tid) }.map(|w| w.phase);
    if was.is_some_and(|p| p != wait::THREAD) {
        return;
    }
    // SAFETY: the scratch value, read by the map update.
    if WAITERS.insert(&tid, unsafe { &*rec }, 0).is_ok() && was.is_none() {
        add_waiting(1);
    }
}

/// Whether `tid` is still a layer's thread working for a hand-off, and not for too long.
#[inline(always)]
fn still_worker(tid: u32) -> bool {
    // SAFETY: copy out of a map value.
    let Some(since) = (unsafe { WORKERS.get(&tid) }).copied() else { return false };
    if unsafe { bpf_ktime_get_ns() }.saturating_sub(since) < WORKER_NS {
        return true;
    }
    let _ = WORKERS.remove(&tid);
    false
}

/// Keeps the wakeup of `task` for its wait if it still holds its bio on its CPU: not yet through
/// its sched_switch.
#[inline(always)]
fn keep_early_wake(ctx: &BtfTracePointContext, task: u64, tid: u32) {
    let cpu: u32 = Direct::read(task, layout().task_cpu);
    let index = 0u32;
    // SAFETY: the helper checks the map, key and CPU; a null result is handled.
    let h = unsafe {
        bpf_map_lookup_percpu_elem((&raw const HOLDER).cast_mut().cast(), (&raw const index).cast(), cpu)
    }
    .cast::<Holder>();
    // SAFETY: null-checked map value; another CPU's, so fields may be torn: the tid decides.
    if h.is_null() || unsafe { (*h).tid } != tid {
        return;
    }
    let Some(early) = SCRATCH.get_ptr_mut(1) else { return };
    // SAFETY: per-CPU scratch, ours for this program run; `h` as above.
    unsafe {
        zero_words(early);
        (*early).bio = (*h).bio;
        (*early).queued_ns = (*h).queued_ns;
        name_waker(ctx, early);
        let _ = EARLY_WAKES.insert(&tid, &*early, 0);
    }
}

/// Fills the waker of wait `w` from the current context, unless a wakeup did already.
#[inline(always)]
fn name_waker(ctx: &BtfTracePointContext, w: *mut WaitRecord) {
    // SAFETY: a live map value (or our scratch); only the first wakeup of a wait writes it.
    let w = unsafe { &mut *w };
    if w.woken_ns != 0 {
        return;
    }
    w.woken_ns = unsafe { bpf_ktime_get_ns() };
    let at = level();
    w.waker = if at == 0 { wait::WAKER_TASK } else { wait::WAKER_INTERRUPT };
    if let Some(c) = completing_at(at) {
        // SAFETY: per-CPU slot, no concurrent writer.
        let c = unsafe { &*c };
        if c.io != 0 {
            w.waker = wait::WAKER_IO;
            w.waker_io = c.io;
            w.waker_io_done_ns = c.done_ns;
            w.waker_disk = c.disk;
        }
    }
    w.waker_tid = thread_id();
    read_current_comm(layout(), &mut w.waker_comm);
    w.waker_stack = stack_id(ctx);
}

/// A wakeup kept in `EARLY_WAKES` for the wait just started as `w`, if it is for the same IO.
#[inline(always)]
fn take_early_wake(tid: u32, w: *mut WaitRecord) {
    // SAFETY: copy out of a map value.
    let Some(early) = (unsafe { EARLY_WAKES.get(&tid) }) else { return };
    // SAFETY: `w` is a live map value.
    let w = unsafe { &mut *w };
    if early.bio == w.bio && early.queued_ns == w.queued_ns && w.woken_ns == 0 {
        w.woken_ns = early.woken_ns;
        w.waker = early.waker;
        w.waker_io = early.waker_io;
        w.waker_io_done_ns = early.waker_io_done_ns;
        w.waker_disk = early.waker_disk;
        w.waker_tid = early.waker_tid;
        w.waker_stack = early.waker_stack;
        copy_comm(&mut w.waker_comm, &early.waker_comm);
    }
    let _ = EARLY_WAKES.remove(&tid);
}
