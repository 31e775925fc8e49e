//! The machine under the benchmark: the commands run on it, and what the bench changes there
//! (loop devices, tracefs, kernel.bpf_stats_enabled) and undoes.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{root_dir, run};

/// Where the bench writes: the tracers' output, the agent's store, the tables and raw figures.
pub(super) fn out_dir() -> PathBuf {
    root_dir().join("target/bench")
}

/// What the benchmark changed on the machine, undone on drop, also on error.
pub(super) struct Machine {
    loop_dev: Option<String>,
    backing: PathBuf,
    /// The many-disks workload's loop devices and their backing files.
    many: Vec<(String, PathBuf)>,
    bpf_stats_before: Option<String>,
    unmount_tracefs: bool,
}

impl Drop for Machine {
    fn drop(&mut self) {
        if let Some(dev) = &self.loop_dev {
            let _ = Command::new("losetup").args(["-d", dev]).status();
        }
        let _ = fs::remove_file(&self.backing);
        for (dev, backing) in &self.many {
            let _ = Command::new("losetup").args(["-d", dev]).status();
            let _ = fs::remove_file(backing);
        }
        if let Some(v) = &self.bpf_stats_before {
            let _ = fs::write("/proc/sys/kernel/bpf_stats_enabled", v);
        }
        if self.unmount_tracefs {
            let _ = Command::new("umount").arg("/sys/kernel/tracing").status();
        }
    }
}

impl Machine {
    /// Nothing changed yet but the backing file's name, and kernel.bpf_stats_enabled as found.
    pub(super) fn new() -> Machine {
        Machine {
            loop_dev: None,
            backing: PathBuf::from(format!("/dev/shm/tracerd-bench-{}.img", std::process::id())),
            many: Vec::new(),
            bpf_stats_before: fs::read_to_string("/proc/sys/kernel/bpf_stats_enabled").ok(),
            unmount_tracefs: false,
        }
    }

    /// bpftrace's tracepoints need tracefs; tp_btf (tracerd, biolatency) does not.
    pub(super) fn mount_tracefs(&mut self) -> Result<()> {
        if !Path::new("/sys/kernel/tracing/events").exists() {
            run(
                Command::new("mount").args(["-t", "tracefs", "nodev", "/sys/kernel/tracing"]),
                "mount tracefs",
            )?;
            self.unmount_tracefs = true;
        }
        Ok(())
    }

    /// The bench's disk: a loop device over 1 GiB in /dev/shm.
    pub(super) fn loop_device(&mut self) -> Result<String> {
        let dev = loop_device(&self.backing, 1 << 30)?;
        self.loop_dev = Some(dev.clone());
        Ok(dev)
    }

    /// The many-disks workload's `i`th disk: a loop device over 16 MiB in /dev/shm.
    pub(super) fn many_disk(&mut self, i: usize) -> Result<()> {
        let backing = PathBuf::from(format!("/dev/shm/tracerd-bench-{}-{i}.img", std::process::id()));
        let dev = loop_device(&backing, 16 << 20)?;
        self.many.push((dev, backing));
        Ok(())
    }

    /// The many-disks workload's devices, as fio's `--filename` takes them.
    pub(super) fn many_disks(&self) -> String {
        self.many.iter().map(|(d, _)| d.as_str()).collect::<Vec<_>>().join(":")
    }
}

/// Creates `backing` with `size` bytes and a loop device over it.
fn loop_device(backing: &Path, size: u64) -> Result<String> {
    fs::File::create(backing)?.set_len(size)?;
    Ok(output(Command::new("losetup").args(["--find", "--show"]).arg(backing))?.trim().to_owned())
}

/// A command's stdout; its stderr in the error where it fails.
pub(super) fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether a run charges BPF run time (kernel.bpf_stats_enabled).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Stats {
    Off,
    On,
}

pub(super) fn set_bpf_stats(stats: Stats) -> Result<()> {
    let v = if stats == Stats::On { "1" } else { "0" };
    fs::write("/proc/sys/kernel/bpf_stats_enabled", v).context("set kernel.bpf_stats_enabled")
}
