//! Stacked devices (md, dm): remaps link a lower bio or clone request to the upper IO being
//! submitted, and the submit-path kprobes time the layer's own work.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use tracer_common::{SubmitState, flag, limits, lost};

use crate::{
    kernel::{Mem, bio_dev, rq_disk, scalar, thread_id},
    maps::{BIOS, LINKS, REQUESTS, SUBMITTING, count_lost, layout},
    slots::slot_get,
};

/// A stacked device (dm, md) sent `lower` down; `upper_dev` is its own device. The upper bio is
/// the one this task is submitting (known from the submit-path kprobes).
pub(crate) fn on_bio_remap(lower: u64, upper_dev: u32) {
    let lower = scalar(lower);
    // SAFETY: copy out of a map value.
    let Some(sub) = (unsafe { SUBMITTING.get(&thread_id()) }).copied() else {
        return;
    };
    // A partition remap of the same bio, or a remap by another layer, is not this upper bio's.
    if sub.dev != upper_dev || sub.bio == lower {
        return;
    }
    if LINKS.insert(&lower, &sub.bio, 0).is_err() {
        count_lost(lost::LINK_MAP_FULL);
    }
}

/// Request-based dm sent the clone request `lower` down; the upper request is the one this task
/// is dispatching (known from the kprobe on `dm_mq_queue_rq`).
pub(crate) fn on_rq_remap(lower: u64, upper_dev: u32) {
    let lower = scalar(lower);
    // SAFETY: copy out of a map value.
    let Some(sub) = (unsafe { SUBMITTING.get(&thread_id()) }).copied() else {
        return;
    };
    if sub.dev != upper_dev {
        return;
    }
    if LINKS.insert(&lower, &sub.bio, 0).is_err() {
        count_lost(lost::LINK_MAP_FULL);
    }
    if let Some(upper) = slot_get(&REQUESTS, limits::REQUEST_SLOTS, sub.bio) {
        // SAFETY: map value pointer from a successful lookup.
        unsafe { (*upper).record.flags |= flag::CLONED };
    }
}

/// Entry of request-based dm's queue_rq: the upper request it dispatches.
pub(crate) fn on_queue_rq_enter<M: Mem>(queue_data: u64) {
    let l = layout();
    let rq: u64 = M::read(queue_data, l.queue_data_rq);
    let sub = SubmitState {
        bio: rq,
        entered_ns: unsafe { bpf_ktime_get_ns() },
        dev: rq_disk::<M>(l, rq),
        ..SubmitState::default()
    };
    let _ = SUBMITTING.insert(&thread_id(), &sub, 0);
}

/// The submit call this task is leaving (entered through a kprobe), removed from `SUBMITTING`.
pub(crate) fn take_submitting() -> Option<SubmitState> {
    let tid = thread_id();
    // SAFETY: copy out of a map value.
    let sub = (unsafe { SUBMITTING.get(&tid) }).copied()?;
    let _ = SUBMITTING.remove(&tid);
    Some(sub)
}

/// Return of queue_rq: its time goes to the upper request.
pub(crate) fn on_queue_rq_exit() {
    let Some(sub) = take_submitting() else {
        return;
    };
    if let Some(state) = slot_get(&REQUESTS, limits::REQUEST_SLOTS, sub.bio) {
        // SAFETY: map value pointer from a successful lookup.
        unsafe { (*state).record.submit_ns += bpf_ktime_get_ns() - sub.entered_ns };
    }
}

/// Entry of a stacked device's submit function (`md_submit_bio`, `dm_submit_bio`).
pub(crate) fn on_submit_enter<M: Mem>(bio: u64) {
    let l = layout();
    let sub = SubmitState {
        bio,
        entered_ns: unsafe { bpf_ktime_get_ns() },
        dev: bio_dev::<M>(l, bio),
        ..SubmitState::default()
    };
    // A full map only loses the submit time and the link, both visible as absent in the record.
    let _ = SUBMITTING.insert(&thread_id(), &sub, 0);
}

/// Return of the submit function: its time goes to the upper bio, which is still in flight
/// (lower bios queued inside it run after it returns).
pub(crate) fn on_submit_exit() {
    let Some(sub) = take_submitting() else {
        return;
    };
    if let Some(b) = slot_get(&BIOS, limits::BIO_SLOTS, sub.bio) {
        // SAFETY: map value pointer from a successful lookup.
        unsafe { (*b).submit_ns += bpf_ktime_get_ns() - sub.entered_ns };
    }
}

pub(crate) fn on_personality_enter() {
    if let Some(sub) = SUBMITTING.get_ptr_mut(&thread_id()) {
        // SAFETY: map value pointer from a successful lookup.
        unsafe { (*sub).personality_entered_ns = bpf_ktime_get_ns() };
    }
}

pub(crate) fn on_personality_exit() {
    // SAFETY: copy out of a map value.
    let Some(sub) = (unsafe { SUBMITTING.get(&thread_id()) }).copied() else {
        return;
    };
    if sub.personality_entered_ns == 0 {
        return;
    }
    if let Some(b) = slot_get(&BIOS, limits::BIO_SLOTS, sub.bio) {
        // SAFETY: map value pointer from a successful lookup.
        unsafe { (*b).personality_ns += bpf_ktime_get_ns() - sub.personality_entered_ns };
    }
}
