//! Stacked devices (md, dm): a lower bio or clone request is linked to the upper IO it serves,
//! from what the kernel states (dm's clone points back to its original through dm's own
//! structs, whichever task submits it), else from the task inside the stacked driver's submit
//! call (the submit-path kprobes, which also time the layer's own work).

use aya_ebpf::helpers::bpf_ktime_get_ns;
use tracer_common::{KernelLayout, StackLayout, SubmitState, dm, flag, limits, lost};

use crate::{
    kernel::{Mem, Probe, bio_dev, rq_disk, scalar, thread_id},
    maps::{BIOS, LINKS, REQUESTS, SUBMITTING, count_lost, layout, stacking},
    slots::slot_get,
};

/// The bio a dm clone was made from: clone -> its `dm_target_io` -> `dm_io` -> `orig_bio`, each
/// step checked by dm's magic numbers, so for any other bio there is none.
#[inline(always)]
fn dm_original(s: &StackLayout, clone: u64) -> Option<u64> {
    if s.dm == 0 || clone == 0 {
        return None;
    }
    let tio = clone.wrapping_sub(s.tio_clone as u64);
    if Probe::read::<u16>(tio, s.tio_magic) != dm::TIO_MAGIC {
        return None;
    }
    let io: u64 = Probe::read(tio, s.tio_io);
    if io == 0 || Probe::read::<u16>(io, s.io_magic) != dm::IO_MAGIC {
        return None;
    }
    let orig: u64 = Probe::read(io, s.io_orig_bio);
    (orig != 0).then_some(orig)
}

/// The upper bio of a remapped lower bio as dm states it: a dm clone's original, or for
/// dm-crypt's own clone (its `bi_private` is the crypt IO) the original of the crypt IO's base.
#[inline(always)]
fn dm_upper(l: &KernelLayout, s: &StackLayout, bio: u64) -> Option<u64> {
    if let Some(upper) = dm_original(s, bio) {
        return Some(upper);
    }
    if s.crypt == 0 {
        return None;
    }
    let crypt_io: u64 = Probe::read(bio, l.bio_bi_private);
    if crypt_io == 0 {
        return None;
    }
    dm_original(s, Probe::read(crypt_io, s.crypt_io_base_bio))
}

/// At Q, for a bio no remap linked: a dm clone that its target sent on without a remap
/// (dm-snapshot, dm-integrity, writecache discards) still points back to its original.
#[inline(always)]
pub(crate) fn queued_clone_upper(s: &StackLayout, bio: u64) -> Option<u64> {
    if s.dm == 0 || Probe::read::<u16>(bio, s.bio_bi_flags) & (1 << s.bio_cloned_bit) == 0 {
        return None;
    }
    dm_original(s, bio)
}

/// A stacked device (dm, md) sent `lower` down; `upper_dev` is its own device. The upper bio
/// is the one dm's structs name, else the one this task is submitting (the submit kprobes).
pub(crate) fn on_bio_remap(lower: u64, upper_dev: u32) {
    let Some(s) = stacking() else { return };
    let lower = scalar(lower);
    let upper = match dm_upper(layout(), s, lower) {
        Some(upper) => upper,
        None => {
            // SAFETY: copy out of a map value.
            let Some(sub) = (unsafe { SUBMITTING.get(&thread_id()) }).copied() else {
                return;
            };
            // A partition remap of the same bio, or a remap by another layer, is not this
            // upper bio's.
            if sub.dev != upper_dev {
                return;
            }
            sub.bio
        }
    };
    // NVMe multipath and partitions remap the bio itself: it is not a lower IO of its own.
    if upper == lower {
        return;
    }
    if LINKS.insert(&lower, &upper, 0).is_err() {
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
