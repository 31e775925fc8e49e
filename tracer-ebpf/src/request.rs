//! The request path: I (block_rq_insert), D (block_rq_issue), R (block_rq_requeue) and C
//! (block_rq_complete), with the per-disk in-flight count that gives the queue depth at issue.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::helpers::bpf_ktime_get_ns;
use tracer_common::{
    AheadRecord, DeviceState, IoRecord, KernelLayout, RequestState, agg, event, flag, kernel_ts, kind,
    limits, lost,
};

use crate::{
    aggregate::aggregate,
    ahead::{counting, issues_so_far, number_issue},
    bio::merge_bio,
    kernel::{Mem, Probe, rq_disk, scalar},
    maps::{
        BIOS, DEVICES, EVENTS, LINKS, REQUESTS, commit_flags, count_lost, is_traced, layout, settings, slow,
        stacking, streaming,
    },
    record::fill_issue,
    sched::note_completing,
    slots::{copy_comm, copy_words, slot_claim_free, slot_free, slot_get, zero_words},
    stacking::on_path_done,
};

/// Front merges followed from a request's first bio back to the bio that allocated it.
const FRONT_MERGES_FOLLOWED: u32 = 4;

/// A request's record on first sight (I, D, or C for one never issued itself), taking its
/// first bio's Q and G. `rec` (a slot value or a reserved ring-buffer entry) is filled in place:
/// the BPF stack is small. `id` is the request's key. Returns the first bio's numbers among
/// its disk's G's (`AheadRecord::getrq_from`, `getrq_seq`; zeroes where not counted).
pub(crate) fn init_request_record<M: Mem>(rq: u64, id: u64, disk: u32, rec: *mut IoRecord) -> (u32, u32) {
    // Read here, not passed: a BPF call takes five arguments, the returned pair one of them.
    let l = layout();
    // SAFETY: `rec` is ours to fill.
    unsafe { zero_words(rec) };
    // SAFETY: as above.
    let rec = unsafe { &mut *rec };
    rec.kind = kind::REQUEST;
    rec.disk = disk;
    rec.id = id;
    let mut getrq = (0, 0);
    // The first bio holds Q and G; a front merge puts the merged bio before it, so walk on.
    let mut bio: u64 = M::read(rq, l.rq_bio);
    for _ in 0..FRONT_MERGES_FOLLOWED {
        if bio == 0 {
            break;
        }
        if let Some(state) = slot_get(&BIOS, limits::BIO_SLOTS, M::key(bio)) {
            // SAFETY: our slot's value until freed below.
            let b = unsafe { &*state };
            rec.ts[event::H] = b.held_ns;
            rec.ts[event::Q] = b.queued_ns;
            rec.ts[event::G] = b.getrq_ns;
            getrq = (b.getrq_from, b.getrq_seq);
            rec.qos = b.qos;
            rec.qos_ns = b.qos_ns;
            rec.dev = b.dev;
            rec.pid = b.pid;
            rec.cgroup = b.cgroup;
            copy_comm(&mut rec.comm, &b.comm);
            rec.flags = b.flags;
            rec.parent = b.parent;
            slot_free(state);
            break;
        }
        bio = M::read(bio, l.bio_bi_next);
    }
    if stacking().is_some() {
        // A clone request of request-based dm (multipath): linked at its remap. The key is a
        // stack copy: older kernels refuse ring-buffer memory as a map key.
        let key = id;
        // SAFETY: copy out of a map value.
        if let Some(parent) = unsafe { LINKS.get(&key) }.copied() {
            rec.parent = parent;
            let _ = LINKS.remove(&key);
        }
    }
    getrq
}

/// Adds `delta` to a disk's in-flight count and returns the new count.
pub(crate) fn add_in_flight_at(dev: *mut DeviceState, delta: i32) -> u32 {
    // SAFETY: map value pointer; CPUs issue concurrently, hence the atomic add. SeqCst, because
    // LLVM 22's BPF backend lowers a Relaxed add to a non-fetching add and the old value is lost.
    let old = unsafe {
        atomic_xadd::<u32, u32, { AtomicOrdering::SeqCst }>(&raw mut (*dev).in_flight, delta as u32)
    };
    old.wrapping_add(delta as u32)
}

/// Adds `delta` to the disk's in-flight count and returns the new count (0 if untraced).
pub(crate) fn add_in_flight(disk: u32, delta: i32) -> u32 {
    match DEVICES.get_ptr_mut(&disk) {
        Some(dev) => add_in_flight_at(dev, delta),
        None => 0,
    }
}

/// A request seen again at I or D whose slot holds an earlier request's record: its last
/// issue still open (no completion, no requeue), or, not issued, its first bio still holding
/// the Q that a record of this request would have taken. Either way a completion was missed:
/// counts it and releases the issue's share of the queue depth; the caller then starts the
/// request afresh. False for a request in its normal course (I then D, requeue then I or D).
pub(crate) fn missed_completion<M: Mem>(rq: u64, state: *mut RequestState) -> bool {
    // SAFETY: map value pointer from a successful lookup.
    let state = unsafe { &mut *state };
    if state.issued != 0 {
        add_in_flight(state.record.disk, -1);
        state.issued = 0;
    } else {
        // An earlier request's completion skipped while it was not issued (a failover from
        // `queue_rq` completes a requeued request without D): the address is reused, and the
        // new request would go on with the old one's Q, G and parent.
        let bio: u64 = M::read(rq, layout().rq_bio);
        if bio == 0 || slot_get(&BIOS, limits::BIO_SLOTS, M::key(bio)).is_none() {
            return false;
        }
    }
    count_lost(lost::MISSED_COMPLETION);
    true
}

pub(crate) fn on_rq_insert<M: Mem>(rq: u64) {
    let now = unsafe { bpf_ktime_get_ns() };
    let key = M::key(rq);
    let open = slot_get(&REQUESTS, limits::REQUEST_SLOTS, key);
    if let Some(state) = open {
        if !missed_completion::<M>(rq, state) {
            // SAFETY: map value pointer from a successful lookup.
            let state = unsafe { &mut *state };
            state.record.ts[event::I] = now;
            note_insert(state);
            return;
        }
    }
    let l = layout();
    let disk = rq_disk::<M>(l, rq);
    if !is_traced(disk) {
        return;
    }
    // The slot is the stale one just found, or a free way (the lookup above missed).
    let Some(state) = open.or_else(|| slot_claim_free(&REQUESTS, limits::REQUEST_SLOTS, key)) else {
        count_lost(lost::REQUEST_MAP_FULL);
        return;
    };
    // SAFETY: our slot's value.
    let state = unsafe { &mut *state };
    state.issued = 0;
    let getrq = init_request_record::<M>(rq, key, disk, &raw mut state.record);
    state.record.ts[event::I] = now;
    start_ahead(state, getrq);
    note_insert(state);
}

/// A request's first sight: its numbers among the disk's G's, none yet among its D's.
#[inline(always)]
fn start_ahead(state: &mut RequestState, (getrq_from, getrq_seq): (u32, u32)) {
    state.ahead = AheadRecord {
        id: state.record.id,
        disk: state.record.disk,
        getrq_from,
        getrq_seq,
        ..Default::default()
    };
}

/// At I: the disk's count of D's, from which the requests issued ahead of this one count.
#[inline(always)]
fn note_insert(state: &mut RequestState) {
    if counting() {
        if let Some(disk) = DEVICES.get_ptr_mut(&state.record.disk) {
            state.ahead.issue_from = issues_so_far(disk);
        }
    }
}

/// At D: the request joins its disk's queue depth, and takes its number among the disk's D's
/// (one never inserted had nothing ahead of it); its numbers go out now, ahead of its record.
#[inline(always)]
fn note_issue(state: &mut RequestState, disk: *mut DeviceState) {
    state.record.queue_depth = add_in_flight_at(disk, 1);
    if counting() {
        let a = &mut state.ahead;
        a.issue_seq = number_issue(disk);
        if state.record.ts[event::I] == 0 {
            a.issue_from = a.issue_seq.wrapping_sub(1);
        }
        if EVENTS.output::<AheadRecord>(&*a, commit_flags()).is_err() {
            count_lost(lost::RINGBUF_FULL);
        }
    }
}

pub(crate) fn on_rq_issue<M: Mem>(rq: u64) {
    let now = unsafe { bpf_ktime_get_ns() };
    let l = layout();
    let key = M::key(rq);
    let open = slot_get(&REQUESTS, limits::REQUEST_SLOTS, key);
    if let Some(state) = open {
        if !missed_completion::<M>(rq, state) {
            // SAFETY: map value pointer from a successful lookup.
            let state = unsafe { &mut *state };
            state.record.ts[event::D] = now;
            fill_issue::<M>(l, rq, &mut state.record);
            match DEVICES.get_ptr_mut(&state.record.disk) {
                Some(disk) => {
                    note_issue(state, disk);
                    state.issued = 1;
                }
                None => state.record.queue_depth = 0,
            }
            return;
        }
    }
    // First sight at D (direct dispatch): one device lookup serves the filter and the depth.
    let disk = rq_disk::<M>(l, rq);
    // (Tracing every device, a disk the daemon has not registered yet is traced without depth.)
    let dev = DEVICES.get_ptr_mut(&disk);
    if dev.is_none() && !is_traced(disk) {
        return;
    }
    // The slot is the stale one just found, or a free way (the lookup above missed).
    let Some(state) = open.or_else(|| slot_claim_free(&REQUESTS, limits::REQUEST_SLOTS, key)) else {
        count_lost(lost::REQUEST_MAP_FULL);
        return;
    };
    // SAFETY: our slot's value.
    let state = unsafe { &mut *state };
    let getrq = init_request_record::<M>(rq, key, disk, &raw mut state.record);
    start_ahead(state, getrq);
    state.record.ts[event::D] = now;
    fill_issue::<M>(l, rq, &mut state.record);
    state.issued = 0;
    if let Some(dev) = dev {
        note_issue(state, dev);
        state.issued = 1;
    }
}

/// block_rq_merge(next): an elevator joined request `next` to a neighbour, which took its bios
/// and will complete them; `next` is freed with no completion. It goes out as a merge record
/// with its size and position, and the Q of the bio that allocated it: from `next`'s slot where
/// it was inserted (merged after a bio or request filled the gap before it), else from that
/// bio's own slot (merged as it was being inserted, before its I). Bios merged into `next`
/// earlier went out at their own merge.
pub(crate) fn on_rq_merge<M: Mem>(next: u64) {
    let l = layout();
    let first: u64 = M::read(next, l.rq_bio);
    let Some(state) = slot_get(&REQUESTS, limits::REQUEST_SLOTS, M::key(next)) else {
        // The bio holding Q: the first, or the one after bios merged in front of it.
        let mut bio = first;
        for _ in 0..FRONT_MERGES_FOLLOWED {
            if bio == 0 {
                return;
            }
            if slot_get(&BIOS, limits::BIO_SLOTS, M::key(bio)).is_some() {
                merge_bio::<M>(bio, next);
                return;
            }
            bio = M::read(bio, l.bio_bi_next);
        }
        return;
    };
    // SAFETY: our slot's value until freed below.
    let s = unsafe { &mut *state };
    if s.issued != 0 {
        // Never for a request the driver has (the elevator merges only queued ones).
        add_in_flight(s.record.disk, -1);
    }
    let Some(mut entry) = EVENTS.reserve::<IoRecord>(0) else {
        slot_free(state);
        count_lost(lost::RINGBUF_FULL);
        return;
    };
    // SAFETY: the reserved entry is ours until submit.
    unsafe {
        let rec = entry.as_mut_ptr();
        copy_words(rec, &raw const s.record);
        let rec = &mut *rec;
        rec.kind = kind::MERGE;
        rec.ts[event::M] = bpf_ktime_get_ns();
        rec.queue_depth = 0;
        rec.disk = 0;
        // Its size and position as it merged (the neighbour takes them after this tracepoint).
        fill_issue::<M>(l, next, rec);
    }
    slot_free(state);
    entry.submit(commit_flags());
}

pub(crate) fn on_rq_requeue(rq: u64) {
    let Some(state) = slot_get(&REQUESTS, limits::REQUEST_SLOTS, scalar(rq)) else {
        return;
    };
    // SAFETY: map value pointer from a successful lookup.
    let state = unsafe { &mut *state };
    if state.issued != 0 {
        add_in_flight(state.record.disk, -1);
        state.issued = 0;
    }
    state.record.ts[event::D] = 0;
    state.record.flags |= flag::REQUEUED;
}

pub(crate) fn on_rq_complete<M: Mem>(rq: u64, error: u32, nr_bytes: u32) {
    let l = layout();
    // A partial completion leaves bytes behind: the request is done when none remain.
    let remaining: u32 = M::read(rq, l.rq_data_len);
    if nr_bytes < remaining {
        return;
    }
    let key = M::key(rq);
    let Some(state) = slot_get(&REQUESTS, limits::REQUEST_SLOTS, key) else {
        // Request-based dm ends an original request whose bytes its clone already completed
        // with a zero-byte completion and no bio left: nothing of it is open here.
        let bio: u64 = M::read(rq, l.rq_bio);
        if nr_bytes == 0 && bio == 0 {
            return;
        }
        // An untraced request: wakeups inside its completion are still an IO's, not a task's.
        note_completing(key, 0, 0);
        on_rq_complete_unissued::<M>(l, rq, key, error);
        return;
    };
    // SAFETY: our slot's value until freed below.
    let s = unsafe { &mut *state };
    if s.record.flags & flag::CLONED != 0 && error == 0 && nr_bytes != 0 {
        // The clone's data completed this request's bytes; dm ends it later (zero bytes).
        return;
    }
    let disk = DEVICES.get_ptr_mut(&s.record.disk);
    if s.issued != 0 {
        if let Some(disk) = disk {
            add_in_flight_at(disk, -1);
        }
    }
    s.record.ts[event::C] = unsafe { bpf_ktime_get_ns() };
    s.record.error = error;
    let mode = settings().aggregate;
    let counted = mode != agg::mode::RECORDS && aggregate(&s.record, disk);
    // A path request's head bios go after it (see on_path_done). A probe read: the verifier
    // refuses a typed pointer as the argument of a function it checks on its own. After the
    // aggregation: values live across it multiply the states the verifier walks through its
    // bucket searches (on 6.1, past its million instructions).
    let path = s.record.flags & flag::PATH != 0;
    let path_bios: u64 = if path { Probe::read(rq, l.rq_bio) } else { 0 };
    if path && path_bios == 0 {
        s.record.flags |= flag::FAILOVER;
    }
    if counted {
        if mode == agg::mode::KERNEL && !streaming() && !slow(&s.record, disk) {
            // After the aggregation, not before: on 6.1 its branches ahead of the histogram's
            // bucket search took the verifier past its million instructions.
            note_completing(key, s.record.disk, s.record.ts[event::C]);
            slot_free(state);
            if path {
                let _ = on_path_done(path_bios);
            }
            return;
        }
        s.record.flags |= flag::IN_KERNEL;
    }
    match EVENTS.reserve::<IoRecord>(0) {
        Some(mut entry) => {
            // Copied straight into the ring buffer: no second copy on the small BPF stack.
            let rec = entry.as_mut_ptr();
            // SAFETY: the reserved entry is ours until submit.
            unsafe {
                copy_words(rec, &raw const s.record);
                kernel_stamps::<M>(l, rq, &mut *rec);
            }
            entry.submit(commit_flags());
        }
        None => count_lost(lost::RINGBUF_FULL),
    }
    note_completing(key, s.record.disk, s.record.ts[event::C]);
    slot_free(state);
    if path {
        let _ = on_path_done(path_bios);
    }
}

/// A request completed that was never inserted or issued itself (the flush machinery finishes
/// the original request of an empty flush): its first bio's Q and G are still in their slot.
/// With no start at all, the completion is counted as lost.
pub(crate) fn on_rq_complete_unissued<M: Mem>(l: &KernelLayout, rq: u64, key: u64, error: u32) {
    let disk = rq_disk::<M>(l, rq);
    if !is_traced(disk) {
        return;
    }
    let Some(mut entry) = EVENTS.reserve::<IoRecord>(0) else {
        count_lost(lost::RINGBUF_FULL);
        return;
    };
    init_request_record::<M>(rq, key, disk, entry.as_mut_ptr());
    // SAFETY: the reserved entry is ours until submit/discard.
    let rec = unsafe { &mut *entry.as_mut_ptr() };
    if rec.ts[event::Q] == 0 {
        entry.discard(0);
        count_lost(lost::COMPLETE_WITHOUT_START);
        return;
    }
    fill_issue::<M>(l, rq, rec);
    rec.ts[event::C] = unsafe { bpf_ktime_get_ns() };
    note_completing(key, disk, rec.ts[event::C]);
    rec.error = error;
    kernel_stamps::<M>(l, rq, rec);
    entry.submit(commit_flags());
}

/// The request's own timestamps, where BTF has them: the record carries them beside the
/// probes' so that userspace can compare the two, IO by IO.
fn kernel_stamps<M: Mem>(l: &KernelLayout, rq: u64, rec: &mut IoRecord) {
    if l.rq_start_time_ns != 0 {
        rec.kernel_ns[kernel_ts::START] = M::read(rq, l.rq_start_time_ns);
    }
    if l.rq_io_start_time_ns != 0 {
        rec.kernel_ns[kernel_ts::IO_START] = M::read(rq, l.rq_io_start_time_ns);
    }
}
