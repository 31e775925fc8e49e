//! The in-flight slot tables (`BIOS`, `REQUESTS`) read in place. They are created
//! `BPF_F_MMAPABLE`, so a scan (occupancy, the stale and gone-device sweeps) reads memory
//! instead of making a bpf() call per slot: 32768 of them a scan, which was most of what an idle
//! agent spent.

use std::{
    marker::PhantomData,
    mem::offset_of,
    os::fd::{AsFd, AsRawFd},
    ptr::NonNull,
};

use anyhow::{Context, Result, bail, ensure};
use aya::{Ebpf, maps::Map};
use tracer_common::Slot;

/// A slot table mapped read-only into this process. The kernel changes slots at any time;
/// each read is one volatile copy, as racy as a bpf() lookup of the same slot and no more.
pub struct SlotView<V> {
    base: NonNull<u8>,
    len: usize,
    entries: u32,
    _value: PhantomData<V>,
}

// SAFETY: the mapping is plain shared memory, read with volatile copies only, and unmapped once.
unsafe impl<V> Send for SlotView<V> {}
// SAFETY: as above; no method takes `&mut self` on the memory.
unsafe impl<V> Sync for SlotView<V> {}

impl<V: Copy> SlotView<V> {
    /// Maps the array map `name`, which must hold `Slot<V>` values and be mmapable.
    pub fn new(ebpf: &Ebpf, name: &str) -> Result<SlotView<V>> {
        let Some(Map::Array(data)) = ebpf.map(name) else { bail!("{name}: no such array map") };
        let info = data.info().with_context(|| format!("{name}: map info"))?;
        let elem = (info.value_size() as usize).next_multiple_of(8);
        ensure!(
            elem == size_of::<Slot<V>>(),
            "{name}: values of {} bytes, expected {}",
            info.value_size(),
            size_of::<Slot<V>>()
        );
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let len = (elem * info.max_entries() as usize).next_multiple_of(page);
        let fd = data.fd().as_fd().as_raw_fd();
        // SAFETY: a fresh shared read-only mapping of the map's fd; checked below.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, fd, 0) };
        if p == libc::MAP_FAILED {
            bail!(
                "{name}: cannot map the in-flight table into memory: {} (it needs BPF_F_MMAPABLE, Linux 5.5 or later)",
                std::io::Error::last_os_error()
            );
        }
        let base = NonNull::new(p.cast::<u8>()).context("mmap returned null")?;
        Ok(SlotView { base, len, entries: info.max_entries(), _value: PhantomData })
    }

    fn slot(&self, i: u32) -> *const Slot<V> {
        // SAFETY: i < entries, so the slot lies inside the mapping.
        unsafe { self.base.as_ptr().add(i as usize * size_of::<Slot<V>>()).cast() }
    }

    fn key(&self, i: u32) -> u64 {
        // SAFETY: an aligned u64 inside the mapping (slots are 8-aligned, the key is first).
        unsafe { std::ptr::read_volatile(self.slot(i).cast::<u64>()) }
    }

    /// Busy slots.
    pub fn busy(&self) -> u64 {
        (0..self.entries).filter(|&i| self.key(i) != 0).count() as u64
    }

    /// Indices of the busy slots whose value `matches`.
    pub fn find(&self, matches: impl Fn(&V) -> bool) -> Vec<u32> {
        (0..self.entries)
            .filter(|&i| self.key(i) != 0)
            .filter(|&i| {
                // SAFETY: the value field of a slot inside the mapping, aligned as `Slot<V>` is.
                let value = unsafe {
                    std::ptr::read_volatile(
                        self.slot(i).cast::<u8>().add(offset_of!(Slot<V>, value)).cast::<V>(),
                    )
                };
                matches(&value)
            })
            .collect()
    }
}

impl<V> Drop for SlotView<V> {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}
