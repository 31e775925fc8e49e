//! Stacked devices (md, dm): a lower bio or clone request is linked to the upper IO it serves,
//! from what the kernel states (dm's clone points back to its original through dm's own
//! structs, whichever task submits it), else from the task inside the stacked driver's submit
//! call (the submit-path kprobes, which also time the layer's own work).

use aya_ebpf::helpers::bpf_ktime_get_ns;
use tracer_common::{
    BioState, IoRecord, KernelLayout, RAID5_STRIPE_SECTORS, StackLayout, SubmitState, dm, flag, head_key,
    kind, limits, lost, own,
};

use crate::{
    kernel::{Mem, Probe, bio_dev, rq_disk, scalar, thread_id},
    maps::{
        BIOS, EVENTS, LINKS, REQUESTS, SUBMITTING, commit_flags, count_lost, is_path, layout, paths_traced,
        stacking,
    },
    record::fill_bio_record,
    sched::note_remap,
    slots::{copy_words, slot_claim, slot_claim_free, slot_free, slot_get, zero_words},
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

/// The bio md got, for `bio` as md holds it: md's accounting clone (`bi_end_io` is
/// `md_clone_end`) names, in `bi_private`, its struct, whose `orig_bio` is the bio md got.
#[inline(always)]
fn md_unclone(l: &KernelLayout, s: &StackLayout, bio: u64) -> u64 {
    if bio != 0 && s.md_clone_end != 0 && Probe::read::<u64>(bio, s.bio_bi_end_io) == s.md_clone_end {
        let clone_of: u64 = Probe::read(bio, l.bio_bi_private);
        return Probe::read(clone_of, s.md_clone_orig_bio);
    }
    bio
}

/// What md states of a member bio, whichever task sends it (raid1d's retries, writes flushed
/// from the plug, raid5d's stripes): its upper bio, or for md's own IO its [`own`] kind (a
/// value below `own::LIMIT`). Its `bi_end_io` names the personality: raid1/raid10 member
/// bios name their r1bio/r10bio in `bi_private`, whose `master_bio` is the upper bio.
#[inline(always)]
fn md_upper(l: &KernelLayout, s: &StackLayout, bio: u64, upper_dev: u32) -> Option<u64> {
    if s.bio_bi_end_io == 0 {
        return None;
    }
    let end: u64 = Probe::read(bio, s.bio_bi_end_io);
    let master = if end == 0 {
        return None;
    } else if end == s.md_clone_end {
        // raid0 (and md-linear) send md's accounting clone itself: of the bio md got, or of a
        // front piece it split off, chained to that bio.
        return queued_on(
            l,
            s,
            Probe::read(Probe::read::<u64>(bio, l.bio_bi_private), s.md_clone_orig_bio),
            upper_dev,
        );
    } else if end == s.chain_end {
        // A front piece raid0 split off and sends uncloned.
        return queued_on(l, s, bio, upper_dev);
    } else if end == s.raid1_read_end || end == s.raid1_write_end {
        s.r1bio_master_bio
    } else if end == s.raid10_read_end || end == s.raid10_write_end {
        s.r10bio_master_bio
    } else if s.raid5_read_end != 0 {
        return raid5_upper(l, s, bio, end);
    } else {
        return None;
    };
    let r: u64 = Probe::read(bio, l.bio_bi_private);
    let upper = md_unclone(l, s, Probe::read(r, master));
    (upper != 0).then_some(upper)
}

/// Pieces of a bio that a chain from a member bio may pass through (md splits a bio at most
/// once per chunk boundary it reaches, each piece chained to the rest).
const CHAIN_STEPS: usize = 4;

/// `bio`, or the bio its `bio_chain` pieces lead to, if tracerd queued it on `dev`: the bio the
/// stacked device `dev` got (or a piece a split tracepoint named), so never an unrelated bio.
#[inline(always)]
fn queued_on(l: &KernelLayout, s: &StackLayout, bio: u64, dev: u32) -> Option<u64> {
    let mut b = bio;
    for _ in 0..CHAIN_STEPS {
        if b == 0 {
            return None;
        }
        if let Some(state) = slot_get(&BIOS, limits::BIO_SLOTS, b) {
            // SAFETY: map value pointer from a successful lookup.
            return (unsafe { (*state).dev } == dev).then_some(b);
        }
        if s.chain_end == 0 || Probe::read::<u64>(b, s.bio_bi_end_io) != s.chain_end {
            return None;
        }
        b = Probe::read(b, l.bio_bi_private);
    }
    None
}

/// Upper bios past the first that one raid5 stripe page may hold, each sent as a
/// [`kind::LINK`] record.
const RAID5_MORE_UPPERS: usize = 7;

/// md raid4/5/6: an aligned read (sent straight from the submitter) names its upper bio in
/// `bi_private`. A stripe's member bio is `dev[i].req` (or `.rreq`) of the stripe in its
/// `bi_private`: a data write or read carries the data of the upper bios on that device's
/// `written` or `toread` list (stable from the remap to the Q: md keeps the device locked), the
/// first of which is returned and the others sent as links; with the list empty it is md's own
/// IO: a parity write, a pre-read, or resync.
#[inline(always)]
fn raid5_upper(l: &KernelLayout, s: &StackLayout, bio: u64, end: u64) -> Option<u64> {
    let private: u64 = Probe::read(bio, l.bio_bi_private);
    if end == s.raid5_align_end {
        let upper = if s.r5_align_acct != 0 {
            Probe::read(private, s.md_clone_orig_bio)
        } else {
            md_unclone(l, s, private)
        };
        return (upper != 0).then_some(upper);
    }
    let write = end == s.raid5_write_end;
    if !write && end != s.raid5_read_end || s.r5dev_size == 0 {
        return None;
    }
    let size = s.r5dev_size as u64;
    let off = bio.wrapping_sub(private + s.sh_dev as u64);
    let i = off / size;
    let within = off - i * size;
    let disks: i32 = Probe::read(private, s.sh_disks);
    if within != s.r5dev_req as u64 && within != s.r5dev_rreq as u64 || i >= disks as u64 {
        return None;
    }
    let dev = bio - within;
    let first: u64 = Probe::read(dev, if write { s.r5dev_written } else { s.r5dev_toread });
    if first == 0 {
        let state: u64 = Probe::read(private, s.sh_state);
        let kind = match () {
            _ if state & s.r5_own_state as u64 != 0 => own::RESYNC,
            _ if write => own::PARITY,
            _ => own::PREREAD,
        };
        return Some(kind as u64);
    }
    let upper = md_unclone(l, s, first);
    // The list is sorted by sector and shared with the stripe's next pages through bi_next;
    // md's r5_next_bio stops at the first bio that ends at or past this page's end.
    let page_end = Probe::read::<u64>(dev, s.r5dev_sector) + RAID5_STRIPE_SECTORS;
    let mut b = first;
    let mut at: Option<(u32, u64)> = None;
    for _ in 0..RAID5_MORE_UPPERS {
        let sector: u64 = Probe::read(b, l.bio_bi_sector);
        let bytes: u32 = Probe::read(b, l.bio_bi_size);
        if sector + (bytes as u64 >> 9) >= page_end {
            break;
        }
        b = Probe::read(b, l.bio_bi_next);
        if b == 0 {
            break;
        }
        let (lower_dev, lower_sector) =
            *at.get_or_insert_with(|| (bio_dev::<Probe>(l, bio), Probe::read(bio, l.bio_bi_sector)));
        send_link(md_unclone(l, s, b), upper, lower_dev, lower_sector);
    }
    Some(upper)
}

/// A [`kind::LINK`] record: `upper` also has data in the lower IO of `first` on `dev` at `sector`.
fn send_link(upper: u64, first: u64, dev: u32, sector: u64) {
    let Some(mut entry) = EVENTS.reserve::<IoRecord>(0) else {
        count_lost(lost::RINGBUF_FULL);
        return;
    };
    // SAFETY: the reserved entry is ours until submit.
    unsafe {
        let rec = entry.as_mut_ptr();
        zero_words(rec);
        let rec = &mut *rec;
        rec.kind = kind::LINK;
        rec.id = upper;
        rec.parent = first;
        rec.dev = dev;
        rec.sector = sector;
    }
    entry.submit(commit_flags());
}

/// At Q, the [`own`] kind of a bio md or dm sends for itself without a remap: md's superblock
/// and bitmap writes, raid1's and raid10's resync, dm-io's and dm-bufio's bios; 0 for any other.
/// One read of the bio's end function, where any of them is resolved.
#[inline(always)]
pub(crate) fn queued_own_kind(s: &StackLayout, bio: u64) -> u64 {
    if s.md_super_end == 0 && s.dm_io_end == 0 && s.dm_bufio_end == 0 {
        return 0;
    }
    let end: u64 = Probe::read(bio, s.bio_bi_end_io);
    if end == 0 {
        0
    } else if end == s.md_super_end {
        own::SUPERBLOCK as u64
    } else if end == s.raid1_sync_read_end
        || end == s.raid1_sync_write_end
        || end == s.raid10_sync_read_end
        || end == s.raid10_sync_write_end
    {
        own::RESYNC as u64
    } else if end == s.dm_io_end {
        own::DM_IO as u64
    } else if end == s.dm_bufio_end {
        own::DM_BUFIO as u64
    } else {
        0
    }
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

/// A bio already queued moved to another traced disk, as NVMe multipath sends a head's bio to
/// one of its paths (no second Q follows, the bio is the same): from here the bio's own slot
/// tracks it on the path, as a lower IO queued at this remap whose parent is the bio, and its
/// state on the head moves to the slot of [`head_key`]. A failover resubmits the bio to another
/// path: the head's slot is there already. False for any other remap (a partition's comes
/// before Q; dm and md remap clones, which are queued after their remap).
#[inline(always)]
fn on_path_remap(bio: u64) -> bool {
    if !paths_traced() {
        return false;
    }
    let lower = slot_get(&BIOS, limits::BIO_SLOTS, bio);
    let head = slot_get(&BIOS, limits::BIO_SLOTS, head_key(bio));
    if lower.is_none() && head.is_none() {
        return false;
    }
    let dev = bio_dev::<Probe>(layout(), bio);
    let head = match (head, lower) {
        (Some(head), _) => head,
        (None, Some(lower)) => {
            // SAFETY: our slot's value.
            if unsafe { (*lower).dev } == dev || !is_path(dev) {
                return false;
            }
            let Some(head) = slot_claim_free(&BIOS, limits::BIO_SLOTS, head_key(bio)) else {
                count_lost(lost::BIO_MAP_FULL);
                return true;
            };
            // SAFETY: two slot values (distinct keys, so distinct slots).
            unsafe {
                copy_words(head, lower);
                (*head).getrq_ns = 0;
            }
            head
        }
        (None, None) => return false,
    };
    let Some(lower) = lower.or_else(|| slot_claim(&BIOS, limits::BIO_SLOTS, bio)) else {
        count_lost(lost::BIO_MAP_FULL);
        return true;
    };
    // SAFETY: two slot values (distinct keys, so distinct slots).
    unsafe {
        copy_words(lower, head);
        let l = &mut *lower;
        l.queued_ns = bpf_ktime_get_ns();
        l.getrq_ns = 0;
        l.submit_ns = 0;
        l.personality_ns = 0;
        l.dev = dev;
        l.parent = bio;
        l.flags |= flag::PATH;
    }
    true
}

/// Bios of one path request followed to their heads: its first and those merged into it.
/// A head bio past them is left to the stale sweep, which counts it.
const PATH_BIOS_FOLLOWED: u32 = 128;

/// A path request (flag::PATH) completed; its record is in the ring buffer. `first` is its
/// first bio, 0 where a failover took its bios back to the head, to be sent down another path
/// (they stay in flight). The record on the head of each of its bios follows it, so that the
/// daemon sees the lower IO before its upper IO: the bio that allocated the request and those
/// merged into it (the request ends them all). A head's C is its own if NVMe traced it (just
/// before, and only for the request's first bio), else now: a batch of completions ends the
/// bios without `block_bio_complete` on the head.
///
/// A global function (exported, not inlined, scalar argument, returns 0): the verifier checks
/// it once, on its own, for any `first`. Inlined, 6.1's verifier walked its 128 rounds again
/// for every path into it (947,738 of its million instructions for the completion program,
/// about 9 s per load under qemu); on its own the program takes about 100,000.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn on_path_done(first: u64) -> u32 {
    let now = unsafe { bpf_ktime_get_ns() };
    let next = layout().bio_bi_next;
    let mut bio = first;
    for _ in 0..PATH_BIOS_FOLLOWED {
        if bio == 0 {
            return 0;
        }
        if let Some(head) = slot_get(&BIOS, limits::BIO_SLOTS, head_key(bio)) {
            // SAFETY: our slot's value.
            let completed = match unsafe { (*head).getrq_ns } {
                0 => now,
                c => c,
            };
            emit_head(bio, head, completed);
        }
        bio = Probe::read(bio, next);
    }
    0
}

/// The bio completed on the head (`block_bio_complete` on the head's queue, which NVMe
/// traces just before it ends the path request); `lower` is the bio's path slot if still there.
/// The head's record waits for the path request's ([`on_path_done`]), but where no request
/// took the bio on (its slot is still here) there is nothing to wait for. `lower` is a pointer,
/// null for none: an `Option` of one passes an undefined register for `None`, which the
/// verifier refuses to read.
pub(crate) fn on_head_complete(bio: u64, lower: *mut BioState) {
    let lower = (!lower.is_null()).then_some(lower);
    let Some(head) = slot_get(&BIOS, limits::BIO_SLOTS, head_key(bio)) else {
        if let Some(lower) = lower {
            slot_free(lower);
        }
        return;
    };
    let now = unsafe { bpf_ktime_get_ns() };
    match lower {
        Some(lower) => {
            slot_free(lower);
            emit_head(bio, head, now);
        }
        // SAFETY: our slot's value.
        None => unsafe { (*head).getrq_ns = now },
    }
}

/// The record of a bio on its head device, from its head slot, which it frees.
fn emit_head(bio: u64, head: *mut BioState, completed: u64) {
    let Some(mut entry) = EVENTS.reserve::<IoRecord>(0) else {
        slot_free(head);
        count_lost(lost::RINGBUF_FULL);
        return;
    };
    // SAFETY: the reserved entry is ours until submit; `head` is our slot until freed.
    fill_bio_record(entry.as_mut_ptr(), unsafe { &*head }, bio, completed);
    slot_free(head);
    entry.submit(commit_flags());
}

/// The upper IO this task is submitting on `upper_dev` (the submit kprobes' `SUBMITTING`). A
/// partition remap of the same bio, or a remap by another layer, is not on `upper_dev`.
#[inline(always)]
fn submitting_on(upper_dev: u32) -> Option<u64> {
    // SAFETY: copy out of a map value.
    let sub = (unsafe { SUBMITTING.get(&thread_id()) }).copied()?;
    (sub.dev == upper_dev).then_some(sub.bio)
}

/// A stacked device (dm, md) sent `lower` down; `upper_dev` is its own device. The upper bio
/// is the one dm's structs name, else the one this task is submitting (the submit kprobes).
pub(crate) fn on_bio_remap(lower: u64, upper_dev: u32) {
    let lower = scalar(lower);
    if on_path_remap(lower) {
        return;
    }
    let Some(s) = stacking() else { return };
    let l = layout();
    let Some(upper) = dm_upper(l, s, lower)
        .or_else(|| md_upper(l, s, lower, upper_dev))
        .or_else(|| submitting_on(upper_dev))
    else {
        return;
    };
    // A partition remap of the bio being submitted: not a lower IO of its own.
    if upper == lower {
        return;
    }
    if LINKS.insert(&lower, &upper, 0).is_err() {
        count_lost(lost::LINK_MAP_FULL);
    }
    note_remap(lower, upper);
}

/// The request a request-based dm clone was made from, as dm states it: a clone ending in
/// `end_clone_request` names its `dm_rq_target_io` in `end_io_data`, whose `orig` is it.
#[inline(always)]
fn dm_rq_original(clone: u64, upper_dev: u32) -> Option<u64> {
    let s = stacking()?;
    if s.dm_rq_end == 0 || Probe::read::<u64>(clone, s.rq_end_io) != s.dm_rq_end {
        return None;
    }
    let tio: u64 = Probe::read(clone, s.rq_end_io_data);
    let orig: u64 = if tio == 0 { 0 } else { Probe::read(tio, s.rq_tio_orig) };
    (orig != 0 && rq_disk::<Probe>(layout(), orig) == upper_dev).then_some(orig)
}

/// Request-based dm sent the clone request `lower` down: linked to the request dm got, from
/// dm's structs where its BTF gave them, else to the request this task is dispatching (known
/// from the kprobe on `dm_mq_queue_rq`).
pub(crate) fn on_rq_remap(lower: u64, upper_dev: u32) {
    let lower = scalar(lower);
    let Some(upper) = dm_rq_original(lower, upper_dev).or_else(|| submitting_on(upper_dev)) else {
        return;
    };
    if LINKS.insert(&lower, &upper, 0).is_err() {
        count_lost(lost::LINK_MAP_FULL);
    }
    if let Some(upper) = slot_get(&REQUESTS, limits::REQUEST_SLOTS, upper) {
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
