//! tracerd's kernel side: one small function per block-layer hook.
//!
//! Bios are tracked from Q until their request is first seen (I or D) or they merge; requests
//! from then until they are fully complete, when one record goes to the ring buffer. Every
//! failure path bumps a `LOST` counter. Struct offsets come from `LAYOUT`, which the daemon
//! fills from the running kernel's BTF before load. Each hook is compiled once per argument
//! position it has had across kernels (`*_a0`, `*_a1`, ...) and per attach type (tp_btf,
//! raw_tp); the loader attaches the one variant that matches the running kernel.
#![no_std]
#![no_main]
// The bpf target has no atomic types; the intrinsics lower to BPF atomic add (cpu v3).
#![allow(internal_features)]
#![feature(core_intrinsics)]

use core::{
    ffi::c_void,
    intrinsics::{AtomicOrdering, atomic_cxchg, atomic_xadd},
    ptr::{read_volatile, write_volatile},
};

use aya_ebpf::{
    EbpfContext,
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_kernel, generated::bpf_get_current_task,
    },
    macros::{btf_tracepoint, kprobe, kretprobe, map, raw_tracepoint},
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    programs::{BtfTracePointContext, ProbeContext, RawTracePointContext, RetProbeContext},
};
use tracer_common::{
    BioState, DeviceState, IoRecord, KernelLayout, RequestState, SLOT_WAYS, Settings, Slot, SubmitState,
    bio_dev_path, event, flag, kind, limits, lost, rq_disk_path, slot_set,
};

/// Struct offsets of the running kernel, written by the loader (read-only data).
#[unsafe(no_mangle)]
static LAYOUT: KernelLayout = KernelLayout::ZERO;

/// Bios between Q and their request (or merge, or completion). Key: `struct bio *`.
#[map]
static BIOS: Array<Slot<BioState>> = Array::with_max_entries(limits::BIO_SLOTS, 0);

/// Requests between first I/D and full completion. Key: `struct request *`.
#[map]
static REQUESTS: Array<Slot<RequestState>> = Array::with_max_entries(limits::REQUEST_SLOTS, 0);

/// Traced disks and partitions, with each disk's in-flight count. Key: kernel `dev_t`.
#[map]
static DEVICES: HashMap<u32, DeviceState> = HashMap::with_max_entries(limits::MAX_DEVICES, 0);

/// One `IoRecord` per completed request or merged bio.
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(limits::RINGBUF_BYTES, 0);

/// Start-up choices (read-only data).
#[unsafe(no_mangle)]
static SETTINGS: Settings = Settings { stacking: 0, wakeup_records: 0, all_devices: 0, _pad: 0 };

/// Lower bios remapped by a stacked device, until their Q. Key: lower `struct bio *`;
/// value: the upper `struct bio *`.
#[map]
static LINKS: HashMap<u64, u64> = HashMap::with_max_entries(limits::MAX_LINKS, 0);

/// Tasks inside a stacked device's submit function. Key: thread id.
#[map]
static SUBMITTING: HashMap<u32, SubmitState> = HashMap::with_max_entries(limits::MAX_SUBMITTERS, 0);

/// Records committed on this CPU since it last woke the reader.
#[map]
static SINCE_WAKEUP: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Lost events per reason (`tracer_common::lost`), per CPU.
#[map]
static LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(lost::KERNEL_COUNT, 0);

/// A kernel pointer as a plain number, for hashing and map keys. tp_btf programs hold typed
/// pointers, on which the verifier allows no arithmetic but adding offsets; copying the value
/// through bpf_probe_read_kernel yields a scalar. (Reading a spilled pointer back in halves is
/// refused: "invalid size of register fill".) Each costs a helper call: compute a key once.
#[inline(always)]
fn scalar(ptr: u64) -> u64 {
    let spilled = ptr;
    // SAFETY: reads our own stack slot.
    unsafe { bpf_probe_read_kernel(&raw const spilled) }.unwrap_or(0)
}

/// The slot of `key` in a slot table (see `tracer_common::Slot`).
#[inline(always)]
fn slot_find<V>(table: &Array<Slot<V>>, size: u32, key: u64) -> Option<*mut Slot<V>> {
    let set = slot_set(key, size);
    for way in 0..SLOT_WAYS {
        if let Some(slot) = table.get_ptr_mut(set + way) {
            // SAFETY: array value pointer.
            if unsafe { (*slot).key } == key {
                return Some(slot);
            }
        }
    }
    None
}

#[inline(always)]
fn slot_get<V>(table: &Array<Slot<V>>, size: u32, key: u64) -> Option<*mut V> {
    // SAFETY: array value pointer.
    slot_find(table, size, key).map(|slot| unsafe { &raw mut (*slot).value })
}

/// The slot for `key`: its own if present (a pointer reused before its old entry was freed,
/// after a missed completion, takes it over), else a free way of its set claimed atomically
/// (CPUs insert concurrently). None when all ways are busy. The caller writes the value in
/// place: a struct copy here compiles to a call of a byte-loop memcpy.
#[inline(always)]
fn slot_claim<V>(table: &Array<Slot<V>>, size: u32, key: u64) -> Option<*mut V> {
    slot_get(table, size, key).or_else(|| slot_claim_free(table, size, key))
}

/// Claims a free way of `key`'s set, for a caller that has just looked `key` up and missed.
#[inline(always)]
fn slot_claim_free<V>(table: &Array<Slot<V>>, size: u32, key: u64) -> Option<*mut V> {
    let set = slot_set(key, size);
    for way in 0..SLOT_WAYS {
        if let Some(slot) = table.get_ptr_mut(set + way) {
            // SAFETY: array value pointer; the compare-exchange makes one CPU the owner.
            let (_, won) = unsafe {
                atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                    &raw mut (*slot).key,
                    0,
                    key,
                )
            };
            if won {
                // SAFETY: the slot is ours.
                return Some(unsafe { &raw mut (*slot).value });
            }
        }
    }
    None
}

/// Frees the slot holding `value` (a pointer from `slot_get`/`slot_claim`).
#[inline(always)]
fn slot_free<V>(value: *mut V) {
    // SAFETY: `value` is the `value` field of a `Slot<V>` in an array map; `key` precedes it.
    unsafe { *value.cast::<u64>().sub(1) = 0 };
}

/// Copies a `T` word by word. Volatile accesses keep LLVM from folding the loop back into a
/// memcpy call, which on the BPF target is a byte loop.
#[inline(always)]
unsafe fn copy_words<T>(dst: *mut T, src: *const T) {
    const { assert!(size_of::<T>() % 8 == 0 && align_of::<T>() == 8) };
    let (d, s) = (dst.cast::<u64>(), src.cast::<u64>());
    for i in 0..size_of::<T>() / 8 {
        // SAFETY: both point at a whole, 8-aligned `T`.
        unsafe { write_volatile(d.add(i), read_volatile(s.add(i))) };
    }
}

/// Zeroes a `T` word by word (see [`copy_words`]).
#[inline(always)]
unsafe fn zero_words<T>(dst: *mut T) {
    const { assert!(size_of::<T>() % 8 == 0 && align_of::<T>() == 8) };
    let d = dst.cast::<u64>();
    for i in 0..size_of::<T>() / 8 {
        // SAFETY: `dst` points at a whole, 8-aligned `T`.
        unsafe { write_volatile(d.add(i), 0) };
    }
}

/// The layout the loader wrote. The pointer goes through a volatile read so the compiler
/// neither folds the fields to the compiled-in zeros nor copies the whole struct per use.
#[inline(always)]
fn layout() -> &'static KernelLayout {
    let layout = &raw const LAYOUT;
    // SAFETY: a pointer to our own global, read back from the stack.
    unsafe { &*read_volatile(&layout) }
}

#[inline(always)]
fn stacking() -> bool {
    // SAFETY: a plain read of our own global; volatile so the loader's value is used.
    unsafe { read_volatile(&SETTINGS) }.stacking != 0
}

/// Commit flags: no wakeup, but for every `wakeup_records`-th record of a CPU. Asking the ring
/// buffer how much data waits (BPF_RB_AVAIL_DATA) reads the reader's position, a cache line
/// the reader's CPU writes: about 80 ns per record. A per-CPU count costs nothing shared.
#[inline(always)]
fn commit_flags() -> u64 {
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

/// The current task's name: one read at `task_struct.comm` (bpf_get_current_comm copies it
/// string-wise, at several times the cost, on every bio).
#[inline(always)]
fn current_comm(l: &KernelLayout) -> [u8; 16] {
    // SAFETY: bpf_probe_read_kernel checks the address; the current task is live.
    unsafe {
        let task = bpf_get_current_task();
        bpf_probe_read_kernel((task + l.task_comm as u64) as *const [u8; 16]).unwrap_or_default()
    }
}

#[inline(always)]
fn thread_id() -> u32 {
    bpf_get_current_pid_tgid() as u32
}

#[inline(always)]
fn count_lost(reason: u32) {
    if let Some(counter) = LOST.get_ptr_mut(reason) {
        // SAFETY: per-CPU slot, no concurrent writer.
        unsafe { *counter += 1 };
    }
}

/// How a program reads kernel memory. tp_btf programs get typed pointers and load fields
/// directly (the verifier checks each access against BTF; a fault reads zero); raw_tp and
/// kprobe programs get plain numbers and must use bpf_probe_read_kernel.
trait Mem {
    fn read<T: Default + Copy>(base: u64, offset: u32) -> T;
    /// The pointer as a number usable as a key.
    fn key(ptr: u64) -> u64;
}

/// Direct loads through BTF-typed pointers (tp_btf).
struct Direct;

impl Mem for Direct {
    #[inline(always)]
    fn read<T: Default + Copy>(base: u64, offset: u32) -> T {
        // SAFETY: the verifier only accepts this load where `base` is a BTF-typed pointer and
        // `offset` (a read-only constant) names a member of the right size; faults read zero.
        unsafe { core::ptr::read((base + offset as u64) as *const T) }
    }

    #[inline(always)]
    fn key(ptr: u64) -> u64 {
        scalar(ptr)
    }
}

/// Helper-checked reads (raw_tp, kprobe).
struct Probe;

impl Mem for Probe {
    #[inline(always)]
    fn read<T: Default + Copy>(base: u64, offset: u32) -> T {
        // SAFETY: bpf_probe_read_kernel checks the address.
        unsafe { bpf_probe_read_kernel((base + offset as u64) as *const T) }.unwrap_or_default()
    }

    #[inline(always)]
    fn key(ptr: u64) -> u64 {
        ptr
    }
}

/// Argument `N` of a tp_btf or raw_tp context (both are arrays of u64).
#[inline(always)]
fn arg<const N: usize>(ctx: *mut c_void) -> u64 {
    // SAFETY: the loader only attaches a variant whose N is within the hook's arguments.
    unsafe { *(ctx as *const u64).add(N) }
}

#[inline(always)]
fn mkdev(major: u32, minor: u32) -> u32 {
    (major << 20) | minor
}

fn bio_dev<M: Mem>(l: &KernelLayout, bio: u64) -> u32 {
    if l.bio_dev_path == bio_dev_path::DISK_PARTNO {
        let disk: u64 = M::read(bio, l.bio_bi_disk);
        let partno: u8 = M::read(bio, l.bio_bi_partno);
        let major: u32 = M::read(disk, l.disk_major);
        let minor: u32 = M::read(disk, l.disk_first_minor);
        mkdev(major, minor + partno as u32)
    } else {
        let bdev: u64 = M::read(bio, l.bio_bi_bdev);
        M::read(bdev, l.bdev_bd_dev)
    }
}

fn rq_disk<M: Mem>(l: &KernelLayout, rq: u64) -> u32 {
    let disk: u64 = if l.rq_disk_path == rq_disk_path::RQ_DISK {
        M::read(rq, l.rq_rq_disk)
    } else {
        let q: u64 = M::read(rq, l.rq_q);
        M::read(q, l.queue_disk)
    };
    if disk == 0 {
        return 0;
    }
    mkdev(M::read(disk, l.disk_major), M::read(disk, l.disk_first_minor))
}

fn is_traced(dev: u32) -> bool {
    // SAFETY: a plain read of our own global; then a read-only presence check.
    unsafe { read_volatile(&SETTINGS).all_devices != 0 || DEVICES.get(&dev).is_some() }
}

fn on_bio_queue<M: Mem>(bio: u64) {
    let key = M::key(bio);
    let l = layout();
    let dev = bio_dev::<M>(l, bio);
    if !is_traced(dev) {
        return;
    }
    let Some(state) = slot_claim(&BIOS, limits::BIO_SLOTS, key) else {
        count_lost(lost::BIO_MAP_FULL);
        return;
    };
    // SAFETY: our slot's value; every field is written.
    let state = unsafe { &mut *state };
    state.queued_ns = unsafe { bpf_ktime_get_ns() };
    state.getrq_ns = 0;
    state.sector = M::read(bio, l.bio_bi_sector);
    state.submit_ns = 0;
    state.personality_ns = 0;
    state.dev = dev;
    state.pid = bpf_get_current_pid_tgid() as u32;
    state.opf = M::read(bio, l.bio_bi_opf);
    state.bytes = M::read(bio, l.bio_bi_size);
    state.flags = 0;
    state.comm = current_comm(l);
    state.parent = 0;
    if stacking() {
        // SAFETY: copy out of a map value.
        if let Some(parent) = unsafe { LINKS.get(&key) }.copied() {
            state.parent = parent;
            let _ = LINKS.remove(&key);
        }
    }
}

fn on_getrq<M: Mem>(bio: u64) {
    if let Some(state) = slot_get(&BIOS, limits::BIO_SLOTS, M::key(bio)) {
        // SAFETY: map value pointer from a successful lookup.
        unsafe { (*state).getrq_ns = bpf_ktime_get_ns() };
    }
}

fn on_split<M: Mem>(bio: u64) {
    // The split-off front part is chained to its parent: `bi_private` points at the parent bio.
    let l = layout();
    let Some(parent) = slot_get(&BIOS, limits::BIO_SLOTS, M::key(M::read(bio, l.bio_bi_private))) else {
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
    }
}

fn on_bio_merge<M: Mem>(bio: u64) {
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
        rec.flags = state.flags;
        rec.dev = state.dev;
        rec.cmd_flags = M::read(bio, l.bio_bi_opf);
        rec.bytes = M::read(bio, l.bio_bi_size);
        rec.sector = M::read(bio, l.bio_bi_sector);
        rec.pid = state.pid;
        rec.comm = state.comm;
        rec.ts[event::Q] = state.queued_ns;
        rec.ts[event::M] = bpf_ktime_get_ns();
    }
    slot_free(state);
    entry.submit(commit_flags());
}

/// Front merges followed from a request's first bio back to the bio that allocated it.
const FRONT_MERGES_FOLLOWED: u32 = 4;

/// A request's record on first sight (I, D, or C for one never issued itself), taking its
/// first bio's Q and G. `rec` (a slot value or a reserved ring-buffer entry) is filled in place:
/// the BPF stack is small. `id` is the request's key.
fn init_request_record<M: Mem>(l: &KernelLayout, rq: u64, id: u64, disk: u32, rec: *mut IoRecord) {
    // SAFETY: `rec` is ours to fill.
    unsafe { zero_words(rec) };
    // SAFETY: as above.
    let rec = unsafe { &mut *rec };
    rec.kind = kind::REQUEST;
    rec.disk = disk;
    rec.id = id;
    // The first bio holds Q and G; a front merge puts the merged bio before it, so walk on.
    let mut bio: u64 = M::read(rq, l.rq_bio);
    for _ in 0..FRONT_MERGES_FOLLOWED {
        if bio == 0 {
            break;
        }
        if let Some(state) = slot_get(&BIOS, limits::BIO_SLOTS, M::key(bio)) {
            // SAFETY: our slot's value until freed below.
            let b = unsafe { &*state };
            rec.ts[event::Q] = b.queued_ns;
            rec.ts[event::G] = b.getrq_ns;
            rec.dev = b.dev;
            rec.pid = b.pid;
            rec.comm = b.comm;
            rec.flags = b.flags;
            rec.parent = b.parent;
            slot_free(state);
            break;
        }
        bio = M::read(bio, l.bio_bi_next);
    }
    if stacking() {
        // A clone request of request-based dm (multipath): linked at its remap. The key is a
        // stack copy: older kernels refuse ring-buffer memory as a map key.
        let key = id;
        // SAFETY: copy out of a map value.
        if let Some(parent) = unsafe { LINKS.get(&key) }.copied() {
            rec.parent = parent;
            let _ = LINKS.remove(&key);
        }
    }
}

/// Adds `delta` to a disk's in-flight count and returns the new count.
fn add_in_flight_at(dev: *mut DeviceState, delta: i32) -> u32 {
    // SAFETY: map value pointer; CPUs issue concurrently, hence the atomic add. SeqCst, because
    // LLVM 22's BPF backend lowers a Relaxed add to a non-fetching add and the old value is lost.
    let old = unsafe {
        atomic_xadd::<u32, u32, { AtomicOrdering::SeqCst }>(&raw mut (*dev).in_flight, delta as u32)
    };
    old.wrapping_add(delta as u32)
}

/// Adds `delta` to the disk's in-flight count and returns the new count (0 if untraced).
fn add_in_flight(disk: u32, delta: i32) -> u32 {
    match DEVICES.get_ptr_mut(&disk) {
        Some(dev) => add_in_flight_at(dev, delta),
        None => 0,
    }
}

/// A request seen again at I or D with its last issue still open (no completion, no requeue):
/// that completion was missed. Counts it and releases its share of the queue depth; the
/// caller then starts the request afresh. False for a request in its normal course.
fn missed_completion(state: *mut RequestState) -> bool {
    // SAFETY: map value pointer from a successful lookup.
    let state = unsafe { &mut *state };
    if state.issued == 0 {
        return false;
    }
    add_in_flight(state.record.disk, -1);
    state.issued = 0;
    count_lost(lost::MISSED_COMPLETION);
    true
}

fn on_rq_insert<M: Mem>(rq: u64) {
    let now = unsafe { bpf_ktime_get_ns() };
    let key = M::key(rq);
    let open = slot_get(&REQUESTS, limits::REQUEST_SLOTS, key);
    if let Some(state) = open {
        if !missed_completion(state) {
            // SAFETY: map value pointer from a successful lookup.
            unsafe { (*state).record.ts[event::I] = now };
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
    unsafe {
        (*state).issued = 0;
        init_request_record::<M>(l, rq, key, disk, &raw mut (*state).record);
        (*state).record.ts[event::I] = now;
    }
}

/// The request goes to the driver: the size, position and op it is issued with.
fn fill_issue<M: Mem>(l: &KernelLayout, rq: u64, rec: &mut IoRecord) {
    rec.cmd_flags = M::read(rq, l.rq_cmd_flags);
    rec.bytes = M::read(rq, l.rq_data_len);
    rec.sector = M::read(rq, l.rq_sector);
}

fn on_rq_issue<M: Mem>(rq: u64) {
    let now = unsafe { bpf_ktime_get_ns() };
    let l = layout();
    let key = M::key(rq);
    let open = slot_get(&REQUESTS, limits::REQUEST_SLOTS, key);
    if let Some(state) = open {
        if !missed_completion(state) {
            // SAFETY: map value pointer from a successful lookup.
            let state = unsafe { &mut *state };
            state.record.ts[event::D] = now;
            fill_issue::<M>(l, rq, &mut state.record);
            state.record.queue_depth = add_in_flight(state.record.disk, 1);
            state.issued = 1;
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
    init_request_record::<M>(l, rq, key, disk, &raw mut state.record);
    state.record.ts[event::D] = now;
    fill_issue::<M>(l, rq, &mut state.record);
    state.issued = 0;
    if let Some(dev) = dev {
        state.record.queue_depth = add_in_flight_at(dev, 1);
        state.issued = 1;
    }
}

fn on_rq_requeue(rq: u64) {
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

fn on_rq_complete<M: Mem>(rq: u64, error: u32, nr_bytes: u32) {
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
        on_rq_complete_unissued::<M>(l, rq, key, error);
        return;
    };
    // SAFETY: our slot's value until freed below.
    let s = unsafe { &*state };
    if s.record.flags & flag::CLONED != 0 && error == 0 && nr_bytes != 0 {
        // The clone's data completed this request's bytes; dm ends it later (zero bytes).
        return;
    }
    if s.issued != 0 {
        add_in_flight(s.record.disk, -1);
    }
    match EVENTS.reserve::<IoRecord>(0) {
        Some(mut entry) => {
            // Copied straight into the ring buffer: no second copy on the small BPF stack.
            let rec = entry.as_mut_ptr();
            // SAFETY: the reserved entry is ours until submit.
            unsafe {
                copy_words(rec, &raw const s.record);
                (*rec).ts[event::C] = bpf_ktime_get_ns();
                (*rec).error = error;
            }
            entry.submit(commit_flags());
        }
        None => count_lost(lost::RINGBUF_FULL),
    }
    slot_free(state);
}

/// A request completed that was never inserted or issued itself (the flush machinery finishes
/// the original request of an empty flush): its first bio's Q and G are still in their slot.
/// With no start at all, the completion is counted as lost.
fn on_rq_complete_unissued<M: Mem>(l: &KernelLayout, rq: u64, key: u64, error: u32) {
    let disk = rq_disk::<M>(l, rq);
    if !is_traced(disk) {
        return;
    }
    let Some(mut entry) = EVENTS.reserve::<IoRecord>(0) else {
        count_lost(lost::RINGBUF_FULL);
        return;
    };
    init_request_record::<M>(l, rq, key, disk, entry.as_mut_ptr());
    // SAFETY: the reserved entry is ours until submit/discard.
    let rec = unsafe { &mut *entry.as_mut_ptr() };
    if rec.ts[event::Q] == 0 {
        entry.discard(0);
        count_lost(lost::COMPLETE_WITHOUT_START);
        return;
    }
    fill_issue::<M>(l, rq, rec);
    rec.ts[event::C] = unsafe { bpf_ktime_get_ns() };
    rec.error = error;
    entry.submit(commit_flags());
}

/// A stacked device (dm, md) sent `lower` down; `upper_dev` is its own device. The upper bio is
/// the one this task is submitting (known from the submit-path kprobes).
fn on_bio_remap(lower: u64, upper_dev: u32) {
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
fn on_rq_remap(lower: u64, upper_dev: u32) {
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
fn on_queue_rq_enter<M: Mem>(queue_data: u64) {
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
fn take_submitting() -> Option<SubmitState> {
    let tid = thread_id();
    // SAFETY: copy out of a map value.
    let sub = (unsafe { SUBMITTING.get(&tid) }).copied()?;
    let _ = SUBMITTING.remove(&tid);
    Some(sub)
}

/// Return of queue_rq: its time goes to the upper request.
fn on_queue_rq_exit() {
    let Some(sub) = take_submitting() else {
        return;
    };
    if let Some(state) = slot_get(&REQUESTS, limits::REQUEST_SLOTS, sub.bio) {
        // SAFETY: map value pointer from a successful lookup.
        unsafe { (*state).record.submit_ns += bpf_ktime_get_ns() - sub.entered_ns };
    }
}

/// A bio is done. Bios that became requests left `BIOS` at I/D; what is left here is IO of a
/// bio-based device (md, dm, brd) or a bio that never became a request.
fn on_bio_complete<M: Mem>(bio: u64) {
    let key = M::key(bio);
    let Some(state) = slot_get(&BIOS, limits::BIO_SLOTS, key) else {
        return;
    };
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
        zero_words(rec);
        let (rec, b) = (&mut *rec, &*state);
        rec.kind = kind::BIO;
        rec.flags = b.flags;
        rec.dev = b.dev;
        rec.cmd_flags = b.opf;
        rec.bytes = b.bytes;
        rec.sector = b.sector;
        rec.pid = b.pid;
        rec.comm = b.comm;
        rec.error = status as u32;
        rec.id = key;
        rec.parent = b.parent;
        rec.submit_ns = b.submit_ns;
        rec.personality_ns = b.personality_ns;
        rec.ts[event::Q] = b.queued_ns;
        rec.ts[event::C] = bpf_ktime_get_ns();
    }
    slot_free(state);
    entry.submit(commit_flags());
}

/// Entry of a stacked device's submit function (`md_submit_bio`, `dm_submit_bio`).
fn on_submit_enter<M: Mem>(bio: u64) {
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
fn on_submit_exit() {
    let Some(sub) = take_submitting() else {
        return;
    };
    if let Some(b) = slot_get(&BIOS, limits::BIO_SLOTS, sub.bio) {
        // SAFETY: map value pointer from a successful lookup.
        unsafe { (*b).submit_ns += bpf_ktime_get_ns() - sub.entered_ns };
    }
}

fn on_personality_enter() {
    if let Some(sub) = SUBMITTING.get_ptr_mut(&thread_id()) {
        // SAFETY: map value pointer from a successful lookup.
        unsafe { (*sub).personality_entered_ns = bpf_ktime_get_ns() };
    }
}

fn on_personality_exit() {
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

/// Defines one tp_btf and one raw_tp program for a hook with its pointer argument at `$n`.
macro_rules! hook {
    ($tp:literal, $btf_name:ident, $raw_name:ident, $n:literal, |$ctx:ident| $body:expr) => {
        #[btf_tracepoint(function = $tp)]
        pub fn $btf_name(c: BtfTracePointContext) -> i32 {
            #[allow(dead_code)]
            type M = Direct;
            let $ctx = c.as_ptr();
            $body;
            0
        }
        #[raw_tracepoint(tracepoint = $tp)]
        pub fn $raw_name(c: RawTracePointContext) -> i32 {
            #[allow(dead_code)]
            type M = Probe;
            let $ctx = c.as_ptr();
            $body;
            0
        }
    };
}

// Since 5.11 the pointer is the first argument; before, a `request_queue *` came first.
hook!("block_bio_queue", btf_bio_queue_a0, raw_bio_queue_a0, 0, |c| on_bio_queue::<M>(arg::<0>(c)));
hook!("block_bio_queue", btf_bio_queue_a1, raw_bio_queue_a1, 1, |c| on_bio_queue::<M>(arg::<1>(c)));
hook!("block_getrq", btf_getrq_a0, raw_getrq_a0, 0, |c| on_getrq::<M>(arg::<0>(c)));
hook!("block_getrq", btf_getrq_a1, raw_getrq_a1, 1, |c| on_getrq::<M>(arg::<1>(c)));
hook!("block_split", btf_split_a0, raw_split_a0, 0, |c| on_split::<M>(arg::<0>(c)));
hook!("block_split", btf_split_a1, raw_split_a1, 1, |c| on_split::<M>(arg::<1>(c)));
// Before 5.11 merges were (q, rq, bio).
hook!("block_bio_backmerge", btf_backmerge_a0, raw_backmerge_a0, 0, |c| on_bio_merge::<M>(arg::<0>(c)));
hook!("block_bio_backmerge", btf_backmerge_a2, raw_backmerge_a2, 2, |c| on_bio_merge::<M>(arg::<2>(c)));
hook!("block_bio_frontmerge", btf_frontmerge_a0, raw_frontmerge_a0, 0, |c| on_bio_merge::<M>(arg::<0>(c)));
hook!("block_bio_frontmerge", btf_frontmerge_a2, raw_frontmerge_a2, 2, |c| on_bio_merge::<M>(arg::<2>(c)));
hook!("block_rq_insert", btf_rq_insert_a0, raw_rq_insert_a0, 0, |c| on_rq_insert::<M>(arg::<0>(c)));
hook!("block_rq_insert", btf_rq_insert_a1, raw_rq_insert_a1, 1, |c| on_rq_insert::<M>(arg::<1>(c)));
hook!("block_rq_issue", btf_rq_issue_a0, raw_rq_issue_a0, 0, |c| on_rq_issue::<M>(arg::<0>(c)));
hook!("block_rq_issue", btf_rq_issue_a1, raw_rq_issue_a1, 1, |c| on_rq_issue::<M>(arg::<1>(c)));
hook!("block_rq_requeue", btf_rq_requeue_a0, raw_rq_requeue_a0, 0, |c| on_rq_requeue(arg::<0>(c)));
hook!("block_rq_requeue", btf_rq_requeue_a1, raw_rq_requeue_a1, 1, |c| on_rq_requeue(arg::<1>(c)));
// (rq, error, nr_bytes) on every kernel tracerd supports.
hook!("block_rq_complete", btf_rq_complete_a0, raw_rq_complete_a0, 0, |c| on_rq_complete::<M>(
    arg::<0>(c),
    arg::<1>(c) as u32,
    arg::<2>(c) as u32
));

hook!("block_bio_remap", btf_bio_remap_a0, raw_bio_remap_a0, 0, |c| on_bio_remap(
    arg::<0>(c),
    arg::<1>(c) as u32
));
hook!("block_bio_remap", btf_bio_remap_a1, raw_bio_remap_a1, 1, |c| on_bio_remap(
    arg::<1>(c),
    arg::<2>(c) as u32
));
hook!("block_rq_remap", btf_rq_remap_a0, raw_rq_remap_a0, 0, |c| on_rq_remap(
    arg::<0>(c),
    arg::<1>(c) as u32
));
hook!("block_rq_remap", btf_rq_remap_a1, raw_rq_remap_a1, 1, |c| on_rq_remap(
    arg::<1>(c),
    arg::<2>(c) as u32
));
// (request_queue *, bio *) on every kernel tracerd supports.
hook!("block_bio_complete", btf_bio_complete_a1, raw_bio_complete_a1, 1, |c| on_bio_complete::<M>(arg::<1>(
    c
)));

// Submit paths of stacked devices (module functions: kprobes, attached by name).
#[kprobe]
pub fn kp_submit_bio(ctx: ProbeContext) -> u32 {
    if let Some(bio) = ctx.arg::<u64>(0) {
        on_submit_enter::<Probe>(bio);
    }
    0
}

#[kretprobe]
pub fn kr_submit_bio(_ctx: RetProbeContext) -> u32 {
    on_submit_exit();
    0
}

#[kprobe]
pub fn kp_queue_rq(ctx: ProbeContext) -> u32 {
    if let Some(queue_data) = ctx.arg::<u64>(1) {
        on_queue_rq_enter::<Probe>(queue_data);
    }
    0
}

#[kretprobe]
pub fn kr_queue_rq(_ctx: RetProbeContext) -> u32 {
    on_queue_rq_exit();
    0
}

#[kprobe]
pub fn kp_personality(_ctx: ProbeContext) -> u32 {
    on_personality_enter();
    0
}

#[kretprobe]
pub fn kr_personality(_ctx: RetProbeContext) -> u32 {
    on_personality_exit();
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
