//! Who went ahead (config `causes`): each disk numbers its G's and its D's in the order they
//! happen. An IO keeps the disk's count at its Q and its own G's number, and the count at its
//! I and its own D's number; the requests numbered in between went ahead of it while it
//! waited (for a tag, in the scheduler). The daemon names them from their records.

use core::{
    intrinsics::{AtomicOrdering, atomic_xadd},
    ptr::read_volatile,
};

use tracer_common::{DeviceState, agg};

use crate::maps::{DEVICES, settings};

/// Whether IOs are numbered: config `causes`, where every IO is sent as a record (tracerd's
/// own programs in a view). The agent keeps no per-IO numbers, so it pays for none.
#[inline(always)]
pub(crate) fn counting() -> bool {
    let s = settings();
    s.causes != 0 && s.aggregate == agg::mode::RECORDS
}

/// The state of `dev`'s disk: its own for a disk, the disk's for a partition (where traced).
#[inline(always)]
fn disk_of(dev: u32) -> Option<*mut DeviceState> {
    let own = DEVICES.get_ptr_mut(&dev)?;
    // SAFETY: a live map value; `disk` is written once, at insert.
    let disk = unsafe { (*own).disk };
    if disk == dev || disk == 0 {
        return Some(own);
    }
    DEVICES.get_ptr_mut(&disk).or(Some(own))
}

/// The G's numbered so far on the disk of `dev` (a bio's Q).
#[inline(always)]
pub(crate) fn getrqs_so_far(dev: u32) -> u32 {
    // SAFETY: a live map value, written atomically by other CPUs.
    disk_of(dev).map_or(0, |d| unsafe { read_volatile(&raw const (*d).getrqs) })
}

/// Numbers a G on the disk of `dev`: from 1; 0 where the device is not traced.
#[inline(always)]
pub(crate) fn number_getrq(dev: u32) -> u32 {
    // SAFETY: a live map value; CPUs number concurrently, hence the atomic add (SeqCst: a
    // Relaxed one is lowered to a non-fetching add).
    disk_of(dev).map_or(0, |d| unsafe {
        atomic_xadd::<u32, u32, { AtomicOrdering::SeqCst }>(&raw mut (*d).getrqs, 1).wrapping_add(1)
    })
}

/// The D's numbered so far on a disk (a request's I).
#[inline(always)]
pub(crate) fn issues_so_far(disk: *mut DeviceState) -> u32 {
    // SAFETY: as in `getrqs_so_far`.
    unsafe { read_volatile(&raw const (*disk).issues) }
}

/// Numbers a D on a disk, from 1.
#[inline(always)]
pub(crate) fn number_issue(disk: *mut DeviceState) -> u32 {
    // SAFETY: as in `number_getrq`.
    unsafe { atomic_xadd::<u32, u32, { AtomicOrdering::SeqCst }>(&raw mut (*disk).issues, 1).wrapping_add(1) }
}
