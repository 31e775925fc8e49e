//! Slot tables: fixed-size, set-associative arrays keyed by a kernel pointer (see
//! `tracer_common::Slot`), and word-wise copies that keep LLVM from calling a byte loop.

use core::{
    intrinsics::{AtomicOrdering, atomic_cxchg},
    ptr::{read_volatile, write_volatile},
};

use aya_ebpf::maps::Array;
use tracer_common::{SLOT_WAYS, Slot, slot_set};

/// The slot of `key` in a slot table (see `tracer_common::Slot`).
#[inline(always)]
pub(crate) fn slot_find<V>(table: &Array<Slot<V>>, size: u32, key: u64) -> Option<*mut Slot<V>> {
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
pub(crate) fn slot_get<V>(table: &Array<Slot<V>>, size: u32, key: u64) -> Option<*mut V> {
    // SAFETY: array value pointer.
    slot_find(table, size, key).map(|slot| unsafe { &raw mut (*slot).value })
}

/// The slot for `key`: its own if present (a pointer reused before its old entry was freed,
/// after a missed completion, takes it over), else a free way of its set claimed atomically
/// (CPUs insert concurrently). None when all ways are busy. The caller writes the value in
/// place: a struct copy here compiles to a call of a byte-loop memcpy.
#[inline(always)]
pub(crate) fn slot_claim<V>(table: &Array<Slot<V>>, size: u32, key: u64) -> Option<*mut V> {
    slot_get(table, size, key).or_else(|| slot_claim_free(table, size, key))
}

/// Claims a free way of `key`'s set, for a caller that has just looked `key` up and missed.
#[inline(always)]
pub(crate) fn slot_claim_free<V>(table: &Array<Slot<V>>, size: u32, key: u64) -> Option<*mut V> {
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
pub(crate) fn slot_free<V>(value: *mut V) {
    // SAFETY: `value` is the `value` field of a `Slot<V>` in an array map; `key` precedes it.
    unsafe { *value.cast::<u64>().sub(1) = 0 };
}

/// Copies a `T` word by word. Volatile accesses keep LLVM from folding the loop back into a
/// memcpy call, which on the BPF target is a byte loop.
#[inline(always)]
pub(crate) unsafe fn copy_words<T>(dst: *mut T, src: *const T) {
    const { assert!(size_of::<T>() % 8 == 0 && align_of::<T>() == 8) };
    let (d, s) = (dst.cast::<u64>(), src.cast::<u64>());
    for i in 0..size_of::<T>() / 8 {
        // SAFETY: both point at a whole, 8-aligned `T`.
        unsafe { write_volatile(d.add(i), read_volatile(s.add(i))) };
    }
}

/// Zeroes a `T` word by word (see [`copy_words`]).
#[inline(always)]
pub(crate) unsafe fn zero_words<T>(dst: *mut T) {
    const { assert!(size_of::<T>() % 8 == 0 && align_of::<T>() == 8) };
    let d = dst.cast::<u64>();
    for i in 0..size_of::<T>() / 8 {
        // SAFETY: `dst` points at a whole, 8-aligned `T`.
        unsafe { write_volatile(d.add(i), 0) };
    }
}

/// Copies a task name (16 bytes at 8-aligned offsets of our structs) as two words: a plain
/// `[u8; 16]` assignment compiles to a call of the byte-loop memmove.
#[inline(always)]
pub(crate) fn copy_comm(dst: &mut [u8; 16], src: &[u8; 16]) {
    // SAFETY: both are `comm` fields of tracer_common structs, 8-aligned (checked there).
    unsafe {
        write_volatile(
            (dst as *mut [u8; 16]).cast::<[u64; 2]>(),
            read_volatile((src as *const [u8; 16]).cast::<[u64; 2]>()),
        )
    };
}
