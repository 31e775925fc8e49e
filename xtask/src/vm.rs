//! `cargo xtask vm-test`: tracerd inside Debian kernels under qemu.
//!
//! The host kernel has no md, dm, brd, null_blk or kprobes; Debian's kernels have them all as
//! modules. The VM is a kernel plus an initramfs (busybox, mdadm, dmsetup, static musl builds of the
//! project's binaries, the modules) whose `/init` is a shell script; its serial console is the
//! result. There is no KVM here, so qemu emulates (TCG), single-threaded: multi-threaded TCG crashed
//! the guest under kprobes on md/dm/brd in 3 of 7 runs, single-threaded in none of 36.
//!
//! From the top down: [`run`] schedules guests and checks their runs; [`scenarios`] is the table
//! of what a guest runs; [`guest`] writes its `/init`; [`initramfs`], [`modules`] and
//! [`kernel`](mod@kernel) build what qemu boots, and [`qemu`] boots it.
//! [`console`](xtask::vm::console) reads what the guest printed.
//!
//! Adding a scenario: a row in [`scenarios::SCENARIOS`] whose body prints its results between
//! `VM-RESULT-BEGIN NAME_...` and `VM-RESULT-END NAME_...`, a module it needs in
//! [`modules::GUEST_MODULES`] and the prologue (`vm/guest/init.sh`), and a test module
//! tests/tests/vm/NAME.rs behind `ran("NAME")`. The prologue gives every scenario /dev/md0 (raid1
//! over ram0+ram1), /dev/dm-0 (`lin0`, linear over ram2) and /dev/nullb0.

mod guest;
mod initramfs;
mod kernel;
mod modules;
mod qemu;
mod run;
pub mod scenarios;

use std::{path::PathBuf, time::Duration};

use anyhow::Result;

pub use guest::scenario;
pub use kernel::{KernelSeries, kernel};
pub use run::{VmRun, boot_guest, build_guest_binaries, run_kernels};
pub use xtask::vm::console::result_section;

use crate::{musl, root_dir, setup};

/// musl-tools: the static build compiles C (ring, for TLS) with x86_64-linux-musl-gcc.
const VM_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "mdadm",
    "dmsetup",
    "xz-utils",
    "util-linux",
    "fdisk",
    "musl-tools",
    "zstd",
];
/// Bounds on a hang, not on speed: a TCG guest on a loaded host is many times slower than one on
/// an idle host, and no step may fail for that. One guest step (a tracer attaching, a count
/// reached) gets GUEST_HANG; the whole guest run, VM_HANG. The PREEMPT_RT guest runs every
/// scenario in about 2400 s here, while the other core runs 6.12 and then 6.1 (about 3500 s).
const GUEST_HANG: Duration = Duration::from_secs(300);
const VM_HANG: Duration = Duration::from_secs(3300);

/// Where downloads and the unpacked kernels live (ignored by git); delete a kernel's directory
/// to fetch its newest build again.
pub fn cache_dir() -> PathBuf {
    root_dir().join(".vm-cache")
}

/// Where initramfs images and console logs go.
pub fn out_dir() -> PathBuf {
    root_dir().join("target/vm")
}

/// Installs qemu, busybox-static, mdadm, dmsetup, xz, zstd and the musl Rust target where missing.
pub fn ensure_vm_packages() -> Result<()> {
    setup::apt_install(VM_PACKAGES, "the VM tests (cargo xtask vm-test)")?;
    musl::ensure_musl_target()
}
