//! Running guests: the binaries every guest carries, one guest booted with chosen scenarios,
//! the checks that its run worked, and the schedule that runs kernels two at a time.

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use xtask::vm::console::{
    DONE, HANG, Outcome, SETUP_DONE, SETUP_FAILED, has_line, line_starting, outcome, result_section,
    scenario_seconds, tail,
};

use super::{
    GUEST_HANG, VM_HANG, ensure_vm_packages,
    guest::guest_script,
    initramfs::{build_initramfs, shared_libraries, which},
    kernel::{KernelSeries, VmKernel, kernel},
    modules::GUEST_MODULES,
    out_dir,
    qemu::boot,
};
use crate::{musl, setup};

/// Runs `f` as a named step, logging its duration and naming it in the error.
fn step<T>(name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let start = Instant::now();
    eprintln!("xtask: vm-test: {name}");
    let result = f().with_context(|| format!("vm-test step \"{name}\" failed"));
    eprintln!("xtask: vm-test: {name}: {:.1} s", start.elapsed().as_secs_f64());
    result
}

/// A finished guest run: its console log and what it ran on.
pub struct VmRun {
    pub kernel: VmKernel,
    pub log: PathBuf,
    /// Modules of [`GUEST_MODULES`] the kernel lacks (their scenarios skipped).
    pub absent: Vec<&'static str>,
    /// Boot to power-off.
    pub guest_seconds: f64,
}

/// Static binaries and tests every kernel's initramfs carries, built once per xtask run.
pub struct GuestBinaries {
    tracerd: PathBuf,
    iogen: PathBuf,
    host_tests: PathBuf,
    cgroup_tests: PathBuf,
    causes_tests: PathBuf,
}

/// Builds the eBPF object and the static binaries and tests the guest runs.
pub fn build_guest_binaries() -> Result<GuestBinaries> {
    step("install VM packages", ensure_vm_packages)?;
    // Only the eBPF object: the static build below compiles tracerd itself.
    step("build the eBPF object", || {
        setup::ensure(false)?;
        crate::build_ebpf()
    })?;
    // The guest runs the binary `cargo xtask dist` ships.
    let tracerd = step("build the static binary (dist)", musl::static_binary)?;
    let iogen = step("build iogen", || musl::build_static(&["tracerd-tests"], &["iogen"]))?.remove(0);
    Ok(GuestBinaries {
        tracerd,
        iogen,
        host_tests: step("build the host-kernel tests", || {
            musl::build_static_test("tracerd-tests", "host_kernel")
        })?,
        cgroup_tests: step("build the cgroup tests", || musl::build_static_test("tracerd-tests", "cgroups"))?,
        causes_tests: step("build the causes tests", || musl::build_static_test("tracerd-tests", "causes"))?,
    })
}

/// Builds `target/vm/STEM.cpio` for `kernel`: the modules of [`GUEST_MODULES`] it has, the guest
/// binaries, `tools` (guest path, host command) with their shared libraries, and an /init that
/// runs `scenarios_text`; boots it running the scenarios `names` and returns the console
/// (also in `target/vm/STEM.log`) and the modules the kernel lacks.
pub fn boot_guest(
    kernel: &VmKernel,
    bins: &GuestBinaries,
    tools: &[(&str, &str)],
    stem: &str,
    scenarios_text: &str,
    names: &[&str],
    timeout: Duration,
) -> Result<(String, Vec<&'static str>)> {
    let absent = kernel.absent_modules(GUEST_MODULES)?;
    if !absent.is_empty() {
        eprintln!(
            "xtask: vm-test: kernel {} has no module {}: the scenarios that need them will say SKIPPED",
            kernel.version,
            absent.join(", ")
        );
    }
    let builtin = kernel.builtin_modules(GUEST_MODULES);
    let present: Vec<&str> =
        GUEST_MODULES.iter().copied().filter(|m| !absent.contains(m) && !builtin.contains(m)).collect();
    let initramfs = out_dir().join(format!("{stem}.cpio"));
    step("build the initramfs", || {
        let mut files = kernel.module_files(&present, &out_dir().join(stem))?;
        files.push(("/bin/tracerd".into(), bins.tracerd.clone()));
        files.push(("/bin/iogen".into(), bins.iogen.clone()));
        // The host-kernel tests, run on this second kernel: the harness finds iogen at
        // <test dir>/../iogen.
        files.push(("/t/deps/host_kernel".into(), bins.host_tests.clone()));
        files.push(("/t/deps/cgroups".into(), bins.cgroup_tests.clone()));
        files.push(("/t/deps/causes".into(), bins.causes_tests.clone()));
        files.push(("/t/iogen".into(), bins.iogen.clone()));
        for (guest, tool) in tools {
            let host = which(tool).with_context(|| format!("{tool} is missing on this machine"))?;
            for lib in shared_libraries(&host)? {
                files.push((lib.to_string_lossy().into_owned(), lib));
            }
            files.push((guest.to_string(), host));
        }
        build_initramfs(&initramfs, &files, &guest_script(scenarios_text))
    })?;
    let cmdline =
        format!("scenarios={} absent={} builtin={}", names.join(","), absent.join(","), builtin.join(","));
    let console = step(&format!("boot kernel {} ({})", kernel.version, names.join(", ")), || {
        boot(kernel, &initramfs, &cmdline, timeout)
    })?;
    Ok((console, absent))
}

/// [`run_scenarios`] on each of `kernels`, two guests at a time: under TCG with
/// `thread=single` a guest keeps one host core busy, and these machines have two. The longest
/// (the last: the PREEMPT_RT build) starts first. Kernels are fetched one by one before (apt is
/// not run twice at once). Results come back in the order of `kernels`.
pub fn run_kernels(
    kernels: &[KernelSeries],
    bins: &GuestBinaries,
    scenarios: &[&str],
    assert_results: bool,
) -> Vec<Result<VmRun>> {
    let fetched: Vec<Result<()>> = kernels
        .iter()
        .map(|k| step(&format!("fetch kernel {}", k.name), || kernel(*k)).map(|_| ()))
        .collect();
    let queue = std::sync::Mutex::new((0..kernels.len()).collect::<Vec<_>>());
    let results: Vec<std::sync::Mutex<Option<Result<VmRun>>>> =
        kernels.iter().map(|_| std::sync::Mutex::new(None)).collect();
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 2);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    // Its own statement: the guard must not live through the guest's run.
                    let next = queue.lock().unwrap_or_else(|e| e.into_inner()).pop();
                    let Some(i) = next else { break };
                    let result = match &fetched[i] {
                        Ok(()) => run_scenarios(kernels[i], bins, scenarios, assert_results),
                        Err(e) => Err(anyhow::anyhow!("{e:#}")),
                    };
                    *results[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
                }
            });
        }
    });
    results
        .into_iter()
        .map(|r| {
            r.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or_else(|| Err(anyhow::anyhow!("the guest's thread ended without a result")))
        })
        .collect()
}

/// Boots `series` with `scenarios` (names from [`SCENARIOS`](super::scenarios::SCENARIOS)), checks the chain
/// worked, and returns the run for the assertions in tests/tests/vm. With `assert_results`
/// off (one scenario, for development) only the guest's own failures fail it.
pub fn run_scenarios(
    series: KernelSeries,
    bins: &GuestBinaries,
    scenarios: &[&str],
    assert_results: bool,
) -> Result<VmRun> {
    let total = Instant::now();
    let kernel = step(&format!("fetch kernel {}", series.name), || kernel(series))?;
    let guest = Instant::now();
    let (console, absent) = boot_guest(
        &kernel,
        bins,
        &[],
        &format!("tracerd-vm-{}", series.name),
        &super::scenarios::script(),
        scenarios,
        VM_HANG,
    )?;
    let guest_seconds = guest.elapsed().as_secs_f64();
    let log = out_dir().join(format!("tracerd-vm-{}.log", series.name));
    eprintln!("xtask: vm-test: console log: {}", log.display());

    let report = |problem: &str| {
        anyhow::anyhow!(
            "kernel {}: {problem}\nLast console lines:\n{}\nconsole log: {}",
            kernel.version,
            tail(&console, 60),
            log.display()
        )
    };
    if let Some(line) = line_starting(&console, SETUP_FAILED) {
        return Err(report(&format!("the guest set-up failed: {line}")));
    }
    if let Some(line) = line_starting(&console, HANG) {
        return Err(report(&format!(
            "a guest step hung ({} s without progress): {line}",
            GUEST_HANG.as_secs()
        )));
    }
    for marker in [SETUP_DONE, DONE] {
        if !has_line(&console, marker) {
            return Err(report(&format!("the guest never printed {marker}")));
        }
    }
    // Where the guest's time went, so that the slowest scenarios are known.
    let times: Vec<String> =
        scenario_seconds(&console).iter().map(|(n, s)| format!("{n} {s:.0} s")).collect();
    if !times.is_empty() {
        eprintln!("xtask: vm-test: kernel {}: scenario times: {}", kernel.version, times.join(", "));
    }
    // What tracerd chose on this kernel, for the test log (tests/tests/vm/doctor.rs asserts it).
    if let Some(doctor) = result_section(&console, "doctor_text") {
        eprintln!("xtask: vm-test: tracerd doctor on {}:\n{doctor}", kernel.version);
    }
    let run = VmRun { kernel: kernel.clone(), log: log.clone(), absent, guest_seconds };
    if !assert_results
        || !scenarios.contains(&"smoke")
        || matches!(outcome(&console, "smoke"), Outcome::Skipped(_))
    {
        return Ok(run);
    }
    let json = result_section(&console, "smoke").ok_or_else(|| report("no smoke result markers"))?;
    let status = console.lines().find_map(|l| l.strip_prefix("tracerd report exit status: ")).unwrap_or("?");
    if status != "0" || json.trim().is_empty() {
        let stderr: Vec<&str> = console
            .lines()
            .skip_while(|l| *l != "--- tracerd report stderr:")
            .skip(1)
            .take_while(|l| *l != "--- end of tracerd report stderr")
            .collect();
        bail!(
            "kernel {}: the VM chain works (modules, md0, dm-0, nullb0, iogen), but `tracerd report` in \
             the guest failed (exit status {status}).\ntracerd's stderr:\n{}\nconsole log: {}",
            kernel.version,
            stderr.join("\n"),
            run.log.display()
        );
    }
    eprintln!(
        "xtask: vm-test: kernel {}: guest run complete in {:.1} s ({:.1} s with building)",
        kernel.version,
        guest_seconds,
        total.elapsed().as_secs_f64()
    );
    Ok(run)
}
