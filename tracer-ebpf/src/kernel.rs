//! Reading the kernel: program arguments, struct fields through BTF-typed pointers (tp_btf)
//! or bpf_probe_read_kernel (raw_tp, kprobe), device numbers of bios and requests, and the
//! current task.

use core::ffi::c_void;

use aya_ebpf::helpers::{
    bpf_get_current_pid_tgid, bpf_probe_read_kernel, bpf_probe_read_kernel_buf,
    generated::{bpf_get_current_cgroup_id, bpf_get_current_task},
};
use tracer_common::{KernelLayout, bio_dev_path, flag, rq_disk_path};

/// A kernel pointer as a plain number, for hashing and map keys. tp_btf programs hold typed
/// pointers, on which the verifier allows no arithmetic but adding offsets; copying the value
/// through bpf_probe_read_kernel yields a scalar. (Reading a spilled pointer back in halves is
/// refused: "invalid size of register fill".) Each costs a helper call: compute a key once.
#[inline(always)]
pub(crate) fn scalar(ptr: u64) -> u64 {
    let spilled = ptr;
    // SAFETY: reads our own stack slot.
    unsafe { bpf_probe_read_kernel(&raw const spilled) }.unwrap_or(0)
}

/// The current task's name, read straight into `dst`: one read at `task_struct.comm`
/// (bpf_get_current_comm copies it string-wise, at several times the cost, on every bio). The
/// kernel zeroes `dst` if the read fails; no zeroed copy on the stack (a byte-loop memset).
#[inline(always)]
pub(crate) fn read_current_comm(l: &KernelLayout, dst: &mut [u8; 16]) {
    // SAFETY: bpf_probe_read_kernel_buf checks the address; the current task is live.
    unsafe {
        let task = bpf_get_current_task();
        let _ = bpf_probe_read_kernel_buf((task + l.task_comm as u64) as *const u8, dst);
    }
}

#[inline(always)]
pub(crate) fn thread_id() -> u32 {
    bpf_get_current_pid_tgid() as u32
}

/// How a program reads kernel memory. tp_btf programs get typed pointers and load fields
/// directly (the verifier checks each access against BTF; a fault reads zero); raw_tp and
/// kprobe programs get plain numbers and must use bpf_probe_read_kernel.
pub(crate) trait Mem {
    fn read<T: Default + Copy>(base: u64, offset: u32) -> T;
    /// The pointer as a number usable as a key.
    fn key(ptr: u64) -> u64;
}

/// Direct loads through BTF-typed pointers (tp_btf).
pub(crate) struct Direct;

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
pub(crate) struct Probe;

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
pub(crate) fn arg<const N: usize>(ctx: *mut c_void) -> u64 {
    // SAFETY: the loader only attaches a variant whose N is within the hook's arguments.
    unsafe { *(ctx as *const u64).add(N) }
}

#[inline(always)]
pub(crate) fn mkdev(major: u32, minor: u32) -> u32 {
    (major << 20) | minor
}

pub(crate) fn bio_dev<M: Mem>(l: &KernelLayout, bio: u64) -> u32 {
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

pub(crate) fn rq_disk<M: Mem>(l: &KernelLayout, rq: u64) -> u32 {
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

/// The cgroup a bio is charged to, and how it was found (0 or [`flag::CGROUP_TASK`]): its own
/// blkcg association (`bi_blkg`, which writeback and kernel threads set for the cgroup they
/// work for), else, where it has none or only the root's, the submitting task's v2 cgroup.
#[inline(always)]
pub(crate) fn bio_cgroup<M: Mem>(l: &KernelLayout, bio: u64) -> (u64, u8) {
    if l.bio_cgroup != 0 {
        let blkg: u64 = M::read(bio, l.bio_bi_blkg);
        if blkg != 0 {
            let blkcg: u64 = M::read(blkg, l.blkg_blkcg);
            let cgroup: u64 = M::read(blkcg, l.blkcg_css_cgroup);
            let kn: u64 = M::read(cgroup, l.cgroup_kn);
            let id: u64 = M::read(kn, l.kernfs_node_id);
            // Ids start at 1, the hierarchy's root.
            if id > 1 {
                return (id, 0);
            }
        }
    }
    // SAFETY: a helper without arguments.
    (unsafe { bpf_get_current_cgroup_id() }, flag::CGROUP_TASK)
}
