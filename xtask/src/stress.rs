//! `cargo xtask test --stress`: every core kept busy by stress-ng while the tests run, so a
//! test that depends on how fast the machine is fails here rather than at random in CI.

use std::{
    os::unix::process::CommandExt,
    process::{Child, Command, Stdio},
    time::Instant,
};

use anyhow::{Context, Result, bail};

use crate::setup;

/// stress-ng's CPU workers, one per online core, in a process group of their own; stopped
/// (the whole group) on [`CpuLoad::stop`] or on drop, also when a test fails.
pub struct CpuLoad {
    child: Child,
    started: Instant,
    cores: usize,
}

impl CpuLoad {
    pub fn start() -> Result<CpuLoad> {
        setup::apt_install(&["stress-ng"], "cargo xtask test --stress")?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let child = Command::new("stress-ng")
            // --cpu 0: one worker per online CPU. The timeout only ends workers that outlive
            // a killed xtask.
            .args(["--cpu", "0", "--timeout", "4h", "--quiet"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()
            .context("cannot start stress-ng")?;
        eprintln!("xtask: --stress: stress-ng keeps all {cores} cores busy while the tests run");
        let mut load = CpuLoad { child, started: Instant::now(), cores };
        // A worker that failed to start is a load that is not there: say so rather than pass.
        std::thread::sleep(std::time::Duration::from_millis(500));
        if let Some(status) = load.child.try_wait()? {
            bail!("stress-ng exited at once ({status}): the tests would run without load");
        }
        load.check_busy()?;
        Ok(load)
    }

    /// The workers use the CPU. They share it with the tests (and anything else running), so
    /// the bar is low: below a fifth of the machine, they are not running as they should.
    fn check_busy(&self) -> Result<()> {
        let before = group_cpu_ticks(self.child.id());
        let t0 = Instant::now();
        std::thread::sleep(std::time::Duration::from_secs(1));
        let used = (group_cpu_ticks(self.child.id()) - before) as f64 / clock_ticks() as f64;
        let share = used / t0.elapsed().as_secs_f64() / self.cores as f64;
        eprintln!("xtask: --stress: the workers use {:.0}% of the machine's CPU", share * 100.0);
        if share < 0.2 {
            bail!("stress-ng's workers use only {:.0}% of the CPU: the load is not there", share * 100.0);
        }
        Ok(())
    }

    /// Stops the workers and prints how long they ran.
    pub fn stop(mut self) -> Result<()> {
        self.check_busy()?;
        self.kill();
        eprintln!(
            "xtask: --stress: the tests ran with all {} cores busy for {:.0} s",
            self.cores,
            self.started.elapsed().as_secs_f64()
        );
        Ok(())
    }

    fn kill(&mut self) {
        // SAFETY: signalling the process group we created for stress-ng.
        unsafe { libc_kill(-(self.child.id() as i32), 15) };
        let _ = self.child.wait();
    }
}

impl Drop for CpuLoad {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill();
        }
    }
}

/// utime + stime, in clock ticks, of every process in the process group `pgid`.
fn group_cpu_ticks(pgid: u32) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    dir.flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|stat| {
            // The fields after the command name, which sits in parentheses and may hold spaces.
            let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            // state ppid pgrp ...: pgrp is the 3rd; utime, stime the 12th and 13th.
            (fields.get(2)?.parse::<u32>().ok()? == pgid)
                .then(|| Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?))
                .flatten()
        })
        .sum()
}

fn clock_ticks() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc_sysconf(2) }; // _SC_CLK_TCK
    if t > 0 { t as u64 } else { 100 }
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
    #[link_name = "sysconf"]
    fn libc_sysconf(name: i32) -> i64;
}
