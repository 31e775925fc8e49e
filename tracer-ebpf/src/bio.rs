//! The bio path: Q (block_bio_queue), G (block_getrq), X (block_split), M/F (merges), and C
//! of bios that never became a request (bio-based devices: md, dm, brd).

use core::ptr::write_volatile;

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns};
use tracer_common::{IoRecord, agg, event, flag, head_key, kind, limits, lost};

use crate::{
    ahead::{counting, getrqs_so_far, number_getrq},
    kernel::{Mem, Probe, bio_cgroup, bio_dev, read_current_comm},
    maps::{
        BIOS, EVENTS, LINKS, commit_flags, count_lost, is_traced, layout, paths_traced, settings, stacking,
        streaming,
    },
    qos::take_qos_wait,
    record::{fill_bio_record, fill_issue},
    sched::{note_completing, note_holder, take_remap},
    slots::{copy_comm, copy_words, slot_claim, slot_claim_free, slot_free, slot_get, zero_words},
    stacking::{on_head_complete, queued_clone_upper, queued_own_kind},
};

/// H: blk-throttle checks a bio of a group with limits, before its Q. The bio's slot is claimed
/// now with no Q (`queued_ns` 0); its Q finds it there, whether blk-throttle let it through at
/// once or held it and queues it later from its dispatch worker. The submitter is noted here:
/// a held bio's Q runs in that worker.
pub(crate) fn on_throttle<M: Mem>(bio: u64) {
    let l = layout();
    let dev = bio_dev::<M>(l, bio);
    if !is_traced(dev) {
        return;
    }
    let Some(state) = slot_claim(&BIOS, limits::BIO_SLOTS, M::key(bio)) else {
        count_lost(lost::BIO_MAP_FULL);
        return;
    };
    // SAFETY: our slot's value; Q writes the rest.
    let state = unsafe { &mut *state };
    state.queued_ns = 0;
    state.held_ns = unsafe { bpf_ktime_get_ns() };
    state.dev = dev;
    state.pid = bpf_get_current_pid_tgid() as u32;
    if settings().aggregate == agg::mode::RECORDS || streaming() {
        read_current_comm(l, &mut state.comm);
    } else {
        zero_comm(&mut state.comm);
    }
}

/// Two word stores: `= [0; 16]` compiles to a call of a byte-loop memset.
#[inline(always)]
fn zero_comm(comm: &mut [u8; 16]) {
    let words = (comm as *mut [u8; 16]).cast::<u64>();
    // SAFETY: `comm` is 16 bytes at an 8-aligned offset of a slot value.
    unsafe {
        write_volatile(words, 0);
        write_volatile(words.add(1), 0);
    }
}

pub(crate) fn on_bio_queue<M: Mem>(bio: u64) {
    let key = M::key(bio);
    let l = layout();
    let dev = bio_dev::<M>(l, bio);
    if !is_traced(dev) {
        return;
    }
    if paths_traced() {
        evict_stale_head(key);
    }
    // Its own slot if H claimed it (or a pointer reused after a missed completion), else a free one.
    let (state, held) = match slot_get(&BIOS, limits::BIO_SLOTS, key) {
        // SAFETY: our slot's value. A claim of H left on another device (it stopped being
        // traced before this pointer's Q) is not this bio's.
        Some(state) => (state, unsafe { (*state).queued_ns == 0 && (*state).dev == dev }),
        None => match slot_claim_free(&BIOS, limits::BIO_SLOTS, key) {
            Some(state) => (state, false),
            None => {
                count_lost(lost::BIO_MAP_FULL);
                return;
            }
        },
    };
    // SAFETY: our slot's value; every field is written (H's own kept where it fired).
    let state = unsafe { &mut *state };
    state.queued_ns = unsafe { bpf_ktime_get_ns() };
    if !held {
        state.held_ns = 0;
    }
    // Volatile: see below.
    // SAFETY: fields of our slot's value.
    unsafe {
        write_volatile(&raw mut state.qos_ns, 0);
        write_volatile(&raw mut state.qos, 0);
    }
    state.getrq_ns = 0;
    state.sector = M::read(bio, l.bio_bi_sector);
    // Volatile: two neighbouring zero stores are otherwise merged into a byte-loop memset call.
    // SAFETY: fields of our slot's value.
    unsafe {
        write_volatile(&raw mut state.submit_ns, 0);
        write_volatile(&raw mut state.personality_ns, 0);
    }
    state.dev = dev;
    state.opf = M::read(bio, l.bio_bi_opf);
    state.bytes = M::read(bio, l.bio_bi_size);
    // Who queued the bio: the pid always (a slow IO's record names it; the daemon reads its
    // comm and cgroup from /proc), the comm and the cgroup only where IOs are shown whole
    // (records, a view streaming), the cgroup where series carry it: the agent's in-kernel
    // aggregation pays for neither otherwise.
    // A held bio keeps the pid and comm noted at H: this is blk-throttle's worker. The cgroup
    // is the bio's own, so it is read here either way.
    let s = settings();
    let whole = s.aggregate == agg::mode::RECORDS || streaming();
    (state.cgroup, state.flags) = if whole || s.cgroups != 0 { bio_cgroup::<M>(l, bio) } else { (0, 0) };
    if !held {
        state.pid = bpf_get_current_pid_tgid() as u32;
        if whole {
            read_current_comm(l, &mut state.comm);
        } else {
            zero_comm(&mut state.comm);
        }
    }
    state.parent = 0;
    (state.getrq_from, state.getrq_seq) = if counting() { (getrqs_so_far(dev), 0) } else { (0, 0) };
    note_holder(key, state.queued_ns, dev, state.opf);
    if let Some(s) = stacking() {
        // SAFETY: copy out of a map value.
        if let Some(parent) = unsafe { LINKS.get(&key) }.copied() {
            state.parent = parent;
            let _ = LINKS.remove(&key);
            take_remap(key, state.queued_ns);
        } else if let Some(parent) = queued_clone_upper(s, key) {
            state.parent = parent;
        } else {
            state.parent = queued_own_kind(s, key);
        }
    }
}

/// Q fires once per life of a bio (the kernel marks it until it completes), so a multipath
/// head's slot still open at this address is an earlier bio's whose completion went unseen.
/// Left there, this bio's remap to a path would take it for a failover of its own.
#[inline(always)]
fn evict_stale_head(bio: u64) {
    if let Some(stale) = slot_get(&BIOS, limits::BIO_SLOTS, head_key(bio)) {
        count_lost(lost::MISSED_COMPLETION);
        slot_free(stale);
    }
}

pub(crate) fn on_getrq<M: Mem>(bio: u64) {
    if let Some(state) = slot_get(&BIOS, limits::BIO_SLOTS, M::key(bio)) {
        // SAFETY: map value pointer from a successful lookup.
        let state = unsafe { &mut *state };
        state.getrq_ns = unsafe { bpf_ktime_get_ns() };
        if counting() {
            state.getrq_seq = number_getrq(state.dev);
        }
        take_qos_wait(state);
    }
}

pub(crate) fn on_split<M: Mem>(bio: u64) {
    // The split-off front part is chained to its parent: `bi_private` points at the parent bio.
    let l = layout();
    let parent_bio: u64 = M::read(bio, l.bio_bi_private);
    let Some(parent) = slot_get(&BIOS, limits::BIO_SLOTS, M::key(parent_bio)) else {
        return;
    };
    let Some(state) = slot_claim(&BIOS, limits::BIO_SLOTS, M::key(bio)) else {
        count_lost(lost::BIO_MAP_FULL);
        return;
    };
    // SAFETY: two slot values (distinct keys, so distinct slots).
    unsafe {
        copy_words(state, parent);
        (*state).flags |= flag::SPLIT;
        // Each part records its own data (the split has advanced the parent past the front
        // part), so a bio-based device's parts add up to what was queued, as its diskstats do.
        (*state).sector = M::read(bio, l.bio_bi_sector);
        (*state).bytes = M::read(bio, l.bio_bi_size);
        // The parent is no argument of the tracepoint: a probe read (tp_btf may not load
        // through a pointer it read).
        (*parent).sector = Probe::read(parent_bio, l.bio_bi_sector);
        (*parent).bytes = Probe::read(parent_bio, l.bio_bi_size);
    }
}

pub(crate) fn on_bio_merge<M: Mem>(bio: u64) {
    merge_bio::<M>(bio, 0);
}

/// `bio`'s record as a merge, from its slot, which it frees: sized and placed as the bio, or, for
/// a request `rq` (non-zero) that merged whole before its I, as that request.
pub(crate) fn merge_bio<M: Mem>(bio: u64, rq: u64) {
    let Some(state) = slot_get(&BIOS, limits::BIO_SLOTS, M::key(bio)) else {
        return;
    };
    let Some(mut entry) = EVENTS.reserve::<IoRecord>(0) else {
        slot_free(state);
        count_lost(lost::RINGBUF_FULL);
        return;
    };
    let l = layout();
    // SAFETY: the reserved entry is ours until submit; `state` is our slot until freed.
    unsafe {
        let rec = entry.as_mut_ptr();
        zero_words(rec);
        let (rec, state) = (&mut *rec, &*state);
        rec.kind = kind::MERGE;
        // A merged bio is a lower IO of its parent too: the request it joined ends it.
        rec.id = M::key(bio);
        rec.parent = state.parent;
        rec.flags = state.flags;
        rec.dev = state.dev;
        if rq == 0 {
            rec.cmd_flags = M::read(bio, l.bio_bi_opf);
            rec.bytes = M::read(bio, l.bio_bi_size);
            rec.sector = M::read(bio, l.bio_bi_sector);
        } else {
            fill_issue::<M>(l, rq, rec);
        }
        rec.pid = state.pid;
        rec.cgroup = state.cgroup;
        copy_comm(&mut rec.comm, &state.comm);
        rec.ts[event::H] = state.held_ns;
        rec.ts[event::Q] = state.queued_ns;
        rec.ts[event::M] = bpf_ktime_get_ns();
        rec.qos = state.qos;
        rec.qos_ns = state.qos_ns;
    }
    slot_free(state);
    entry.submit(commit_flags());
}

/// A bio is done. Bios that became requests left `BIOS` at I/D; what is left here is IO of a
/// bio-based device (md, dm, brd) or a bio that never became a request.
pub(crate) fn on_bio_complete<M: Mem>(bio: u64) {
    let key = M::key(bio);
    let state = slot_get(&BIOS, limits::BIO_SLOTS, key);
    // SAFETY: our slot's value.
    let Some(state) = state.filter(|&s| unsafe { (*s).flags } & flag::PATH == 0) else {
        // A bio that NVMe moved to a path, completing on its head.
        note_completing(key, 0, 0);
        on_head_complete(key, state.unwrap_or(core::ptr::null_mut()));
        return;
    };
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: our slot's value.
    note_completing(key, unsafe { (*state).dev }, now);
    let Some(mut entry) = EVENTS.reserve::<IoRecord>(0) else {
        slot_free(state);
        count_lost(lost::RINGBUF_FULL);
        return;
    };
    let l = layout();
    let status: u8 = M::read(bio, l.bio_bi_status);
    // SAFETY: the reserved entry is ours until submit; `state` is our slot until freed.
    unsafe {
        let rec = entry.as_mut_ptr();
        fill_bio_record(rec, &*state, key, now);
        (*rec).error = status as u32;
    }
    slot_free(state);
    entry.submit(commit_flags());
}
