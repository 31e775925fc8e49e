//! What is measured besides fio's IOPS: the machine's busy CPU time (/proc/stat), a process's
//! CPU time and memory (/proc/<pid>), and each BPF program's run time and runs (bpftool).

use std::{collections::BTreeMap, fs, process::Command};

use anyhow::Result;

use super::machine::output;

/// Busy CPU time of the whole machine, in clock ticks: user, nice, system, irq and softirq.
/// Steal is left out: it is time the hypervisor gave another guest, which varies with the
/// neighbours' load and is no work of this machine's.
pub(super) fn machine_busy_ticks() -> u64 {
    let stat = fs::read_to_string("/proc/stat").unwrap_or_default();
    let cpu = stat.lines().next().unwrap_or_default();
    // user nice system idle iowait irq softirq steal
    let f: Vec<u64> = cpu.split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
    [0, 1, 2, 5, 6].iter().filter_map(|&i| f.get(i)).sum()
}

/// utime + stime of a process, in clock ticks.
pub(super) fn process_ticks(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

pub(super) fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix(field)).and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// (id, name, run_time_ns, run_cnt) of every loaded BPF program.
pub(super) fn bpf_programs() -> Result<Vec<(u64, String, u64, u64)>> {
    let json = output(Command::new("bpftool").args(["prog", "show", "--json"]))?;
    let mut out = Vec::new();
    // Small hand parse of bpftool's JSON array of flat objects, to keep xtask light.
    for obj in json.split("},{") {
        let field = |key: &str| -> Option<&str> {
            let at = obj.find(&format!("\"{key}\""))? + key.len() + 2;
            let rest = obj[at..].trim_start().strip_prefix(':')?.trim_start();
            let end = rest.find([',', '}']).unwrap_or(rest.len());
            Some(rest[..end].trim_matches('"'))
        };
        let id = field("id").and_then(|v| v.parse().ok());
        let name = field("name").unwrap_or("").to_owned();
        let rt = field("run_time_ns").and_then(|v| v.parse().ok()).unwrap_or(0);
        let rc = field("run_cnt").and_then(|v| v.parse().ok()).unwrap_or(0);
        if let Some(id) = id {
            out.push((id, name, rt, rc));
        }
    }
    Ok(out)
}

/// (name, run_time_ns, run_cnt) of each of these programs.
pub(super) fn bpf_runtimes(ids: &[u64]) -> Result<Vec<(String, u64, u64)>> {
    Ok(bpf_programs()?.into_iter().filter(|p| ids.contains(&p.0)).map(|p| (p.1, p.2, p.3)).collect())
}

/// Each program's (run time, runs) per IO between two readings, by program name.
pub(super) fn per_program(
    before: &[(String, u64, u64)],
    after: &[(String, u64, u64)],
    ios: u64,
) -> BTreeMap<String, (f64, f64)> {
    let mut out = BTreeMap::new();
    for (name, rt, rc) in after {
        let (rt0, rc0) = before.iter().find(|b| &b.0 == name).map_or((0, 0), |b| (b.1, b.2));
        let e: &mut (f64, f64) = out.entry(name.clone()).or_default();
        e.0 += rt.saturating_sub(rt0) as f64 / ios.max(1) as f64;
        e.1 += rc.saturating_sub(rc0) as f64 / ios.max(1) as f64;
    }
    out
}

pub(super) fn clock_ticks_per_second() -> f64 {
    output(Command::new("getconf").arg("CLK_TCK")).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(100.0)
}
