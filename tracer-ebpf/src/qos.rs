//! rq-qos waits inside Q2G. `blk_mq_submit_bio` calls the queue's rq-qos throttles (wbt,
//! io.latency, io.cost) after Q and just before it allocates the request (G), in the same
//! task. The waits are timed per task from their functions' entry to their return, and the
//! bio's G takes what its task waited.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::helpers::bpf_ktime_get_ns;
use tracer_common::{BioState, QosWait, qos};

use crate::{
    kernel::thread_id,
    maps::{QOS_PENDING, QOS_WAITS, settings},
};

/// The policy whose `rq_qos_wait` calls back through `acquire`.
#[inline(always)]
pub(crate) fn rq_qos_policy(acquire: u64) -> u8 {
    let s = settings();
    if acquire != 0 && acquire == s.wbt_inflight_cb {
        qos::WBT
    } else if acquire != 0 && acquire == s.iolat_acquire_inflight {
        qos::IOLATENCY
    } else {
        qos::OTHER
    }
}

/// A throttle of `policy` begins to wait (or to decide it need not).
pub(crate) fn on_qos_enter(policy: u8) {
    let tid = thread_id();
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(w) = QOS_WAITS.get_ptr_mut(&tid) {
        // SAFETY: map value pointer; only this task writes its entry.
        unsafe {
            (*w).entered_ns = now;
            (*w).waiting = policy;
        }
        return;
    }
    let w = QosWait { entered_ns: now, waiting: policy, ..QosWait::default() };
    // A full map loses this wait: Q2G still holds it, unsplit.
    let _ = QOS_WAITS.insert(&tid, &w, 0);
}

/// The throttle returns: its wait joins the task's finished ones.
pub(crate) fn on_qos_exit() {
    let Some(w) = QOS_WAITS.get_ptr_mut(&thread_id()) else {
        return;
    };
    // SAFETY: map value pointer; only this task writes its entry.
    let w = unsafe { &mut *w };
    if w.waiting == 0 {
        return;
    }
    w.waited_ns += unsafe { bpf_ktime_get_ns() } - w.entered_ns;
    w.done |= w.waiting;
    w.waiting = 0;
    if w.pending == 0 {
        w.pending = 1;
        add_pending(1);
    }
}

/// At G: the waits this task finished since the bio's Q go to the bio. Waits left by a bio that
/// never reached G (it failed, or went another way) began before this bio's Q, and are dropped.
#[inline(always)]
pub(crate) fn take_qos_wait(state: &mut BioState) {
    if settings().rq_qos == 0 {
        return;
    }
    // SAFETY: array value pointer.
    match QOS_PENDING.get_ptr(0) {
        Some(p) if unsafe { *p } != 0 => {}
        _ => return,
    }
    let tid = thread_id();
    let Some(w) = QOS_WAITS.get_ptr_mut(&tid) else {
        return;
    };
    // SAFETY: map value pointer; only this task writes its entry.
    let w = unsafe { &mut *w };
    if w.pending == 0 {
        return;
    }
    if w.entered_ns >= state.queued_ns {
        state.qos_ns += w.waited_ns;
        state.qos |= w.done;
    }
    w.waited_ns = 0;
    w.done = 0;
    w.pending = 0;
    add_pending(-1);
}

#[inline(always)]
fn add_pending(delta: i64) {
    if let Some(p) = QOS_PENDING.get_ptr_mut(0) {
        // SAFETY: array value pointer; shared by every CPU, so atomic.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, delta as u64) };
    }
}
