//! `cargo xtask`: everything between a fresh clone and a running, tested tracerd.
//!
//! - `setup`       install what is missing (apt packages, nightly rust-src, bpf-linker)
//! - `build-ebpf`  build the kernel object (nightly, bpfel-unknown-none, bpf-linker)
//! - `build`       setup + kernel object + tracerd (release)
//! - `run`         build, then `tracerd run` (extra arguments go to tracerd)
//! - `test`        build, then unit tests and the real-kernel integration tests (`--stress`: with
//!   every core kept busy)
//! - `docs`        write the generated reference pages (`docs/reference/cli.md`)
//! - `dist`        the static binary and the Debian package, in `target/dist/`
//! - `vm-test`     build static binaries, boot Debian kernels (6.1, 6.12, 6.12-rt) under qemu with
//!   md/dm/brd/null_blk

mod bench;
mod dist;
mod docs;
mod elf;
#[cfg(test)]
mod layering;
mod musl;
mod setup;
mod stress;
mod vm;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail, ensure};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Build, run and test tracerd")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what building and testing need (Debian, as root), or say what is missing.
    Setup {
        /// Also install what the tests need.
        #[arg(long)]
        test: bool,
    },
    /// Build the eBPF object.
    BuildEbpf,
    /// Set up, then build the eBPF object and tracerd (release).
    Build,
    /// Build, then run tracerd (default arguments: `run`); e.g. `cargo xtask run -- report --duration 5`.
    Run {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build, then run every test: unit tests, then integration tests against the running kernel.
    Test {
        /// Only the unit tests (no root, no kernel).
        #[arg(long)]
        unit_only: bool,
        /// Keep every core busy (stress-ng) while the tests run: proves that no test depends
        /// on how fast the machine is.
        #[arg(long, conflicts_with = "unit_only")]
        stress: bool,
    },
    /// Measure tracing overhead against no tracer, biolatency and bpftrace (root).
    Bench {
        /// Seconds per fio run.
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        /// Rounds of interleaved variants (medians are reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Seconds of the saturated soak (lost events, RSS over time).
        #[arg(long, default_value_t = 60)]
        soak_seconds: u64,
        /// Only the soak (e.g. `--soak-only --soak-seconds 600` for the 10-minute RSS check).
        #[arg(long)]
        soak_only: bool,
        /// Only what the cost targets judge (about 17 minutes): the fixed-rate rows, the
        /// many-disks row, and the BPF run time of `tracerd run` and biolatency; no soak.
        #[arg(long, conflicts_with = "soak_only")]
        fixed_rate_only: bool,
        /// Instead: `tracerd run` beside biolatency on md raid5 and dm-crypt, in the VM (their
        /// lower IO is sent from another task). `--seconds` and `--rounds` apply.
        #[arg(long, conflicts_with = "soak_only")]
        stacks: bool,
        /// The VM kernel for `--stacks`.
        #[arg(long, default_value = "6.1", requires = "stacks")]
        kernel: String,
    },
    /// Write the reference pages generated from the code (docs/reference/cli.md, from clap).
    Docs,
    /// Build what a host installs, into target/dist/: the static binary (and its .sha256) and
    /// the Debian package.
    Dist,
    /// Boot Debian kernels under qemu (md, dm, brd, null_blk, kprobes) and run tracerd there.
    VmTest {
        /// Which kernels: 6.1, 6.12, 6.12-rt, 6.12-cloud (comma-separated), or all (every one
        /// but cloud). Each runs every scenario.
        #[arg(long, default_value = "all")]
        kernel: String,
        /// Run only this scenario (smoke, doctor, dm_linear, dm_deferred, dm_copy, md, md_parity,
        /// null_blk, dm_multipath, real_drivers, nvme_failover, nvme_ana, host_kernel, cgroups,
        /// causes) and
        /// keep the console log, without the assertions: for developing a scenario.
        #[arg(long)]
        scenario: Option<String>,
    },
}

fn main() {
    if let Err(e) = real_main() {
        eprintln!("xtask: error: {e:#}");
        std::process::exit(1);
    }
}

fn real_main() -> Result<()> {
    match Cli::parse().command {
        Cmd::Setup { test } => setup::ensure(test),
        Cmd::BuildEbpf => build_ebpf(),
        Cmd::Build => build(false),
        Cmd::Run { args } => {
            build(false)?;
            let args = if args.is_empty() { vec!["run".to_string()] } else { args };
            if !setup::is_root() {
                bail!(
                    "tracerd loads kernel programs and needs root (or CAP_BPF+CAP_PERFMON): \
                     sudo {} {}",
                    tracerd_bin().display(),
                    args.join(" ")
                );
            }
            run(Command::new(tracerd_bin()).args(&args), "tracerd")
        }
        Cmd::Test { unit_only, stress } => test(unit_only, stress),
        Cmd::Bench { stacks: true, seconds, rounds, kernel, .. } => {
            bench::bench_stacks(bench::StacksOptions { kernel, seconds, rounds })
        }
        Cmd::Bench { seconds, rounds, soak_seconds, soak_only, fixed_rate_only, .. } => {
            bench::bench(bench::Options { seconds, rounds, soak_seconds, soak_only, fixed_rate_only })
        }
        Cmd::Docs => docs::write(),
        Cmd::Dist => dist::dist(),
        Cmd::VmTest { kernel, scenario: Some(name) } => {
            let names = vm::scenarios::names();
            ensure!(
                names.contains(&name.as_str()),
                "no scenario {name:?}: --scenario takes one of {}",
                names.join(", ")
            );
            let bins = vm::build_guest_binaries()?;
            for run in vm::run_kernels(&vm::KernelSeries::select(&kernel)?, &bins, &[&name], false) {
                let run = run?;
                println!(
                    "kernel {}: scenario {name} ran; console log: {}",
                    run.kernel.version,
                    run.log.display()
                );
            }
            Ok(())
        }
        Cmd::VmTest { kernel, scenario: None } => {
            let mut tally = Tally::default();
            vm_tests(&mut tally, &vm::KernelSeries::select(&kernel)?, false)?;
            println!("{} passed, {} failed", tally.passed, tally.failed);
            Ok(())
        }
    }
}

pub fn root_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

pub fn tracerd_bin() -> PathBuf {
    root_dir().join("target/release/tracerd")
}

/// Runs a command, failing with its name if it fails.
pub fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd.status().with_context(|| format!("cannot start {what}"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

/// A cargo command free of the outer cargo's environment (toolchain, target dir).
pub fn cargo(toolchain: Option<&str>) -> Command {
    let mut cmd = Command::new("cargo");
    if let Some(t) = toolchain {
        cmd.arg(format!("+{t}"));
    }
    for var in
        ["RUSTUP_TOOLCHAIN", "RUSTC", "RUSTC_WRAPPER", "RUSTFLAGS", "CARGO_TARGET_DIR", "CARGO_BUILD_TARGET"]
    {
        cmd.env_remove(var);
    }
    cmd.current_dir(root_dir());
    cmd
}

pub(crate) fn build_ebpf() -> Result<()> {
    let mut cmd = cargo(Some("nightly"));
    cmd.current_dir(root_dir().join("tracer-ebpf")).args(["build", "--release"]);
    run(&mut cmd, "building the eBPF object (cargo +nightly build in tracer-ebpf)")
}

fn build(for_tests: bool) -> Result<()> {
    setup::ensure(for_tests)?;
    build_ebpf()?;
    let mut cmd = cargo(None);
    cmd.args(["build", "--release", "-p", "tracerd"]);
    run(&mut cmd, "building tracerd")
}

/// Pass/fail counts over every `cargo test` run, for the closing line.
#[derive(Default)]
struct Tally {
    passed: u64,
    failed: u64,
}

impl Tally {
    /// Runs `cargo test ...`, echoing its output and adding up its `test result:` lines.
    fn run(&mut self, cmd: &mut Command, what: &str) -> Result<()> {
        use std::io::{BufRead, BufReader};
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {what}"))?;
        for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
            let line = line?;
            println!("{line}");
            if let Some(rest) = line.strip_prefix("test result: ") {
                let count = |word: &str| -> u64 {
                    rest.split(';')
                        .find_map(|part| {
                            part.trim().strip_suffix(word)?.trim().rsplit(' ').next()?.parse().ok()
                        })
                        .unwrap_or(0)
                };
                self.passed += count(" passed");
                self.failed += count(" failed");
            }
        }
        let status = child.wait()?;
        if !status.success() {
            println!("{} passed, {} failed", self.passed, self.failed.max(1));
            bail!("{what} failed ({status})");
        }
        Ok(())
    }
}

fn test(unit_only: bool, stress: bool) -> Result<()> {
    build(!unit_only)?;
    let load = if stress { Some(stress::CpuLoad::start()?) } else { None };
    let mut tally = Tally::default();
    run(cargo(None).args(["fmt", "--all", "--check"]), "cargo fmt --check")?;
    run(
        cargo(None).args(["clippy", "--workspace", "--all-targets", "--release", "--", "-D", "warnings"]),
        "cargo clippy",
    )?;
    tally.run(
        cargo(None).args(["test", "--release", "-p", "tracer-common", "-p", "tracerd", "-p", "xtask"]),
        "unit tests",
    )?;
    if !unit_only {
        integration_tests(&mut tally)?;
        vm_tests(&mut tally, &vm::KernelSeries::select("all")?, true)?;
    }
    if let Some(load) = load {
        load.stop()?;
    }
    println!("{} passed, {} failed", tally.passed, tally.failed);
    Ok(())
}

/// Boots every kernel of `kernels` with every scenario, two at a time (17 to 25 minutes each
/// under TCG: one after another they took 60 of CI's 90 minutes), then asserts on each console
/// log; a failing kernel does not stop the others. The dashboard test follows the first: it
/// needs the guest's stacked-device exposition and the host kernel.
fn vm_tests(tally: &mut Tally, kernels: &[vm::KernelSeries], with_dashboard: bool) -> Result<()> {
    let bins = vm::build_guest_binaries()?;
    let names = vm::scenarios::names();
    let runs = vm::run_kernels(kernels, &bins, &names, true);
    let mut lines = Vec::new();
    let mut failures = Vec::new();
    for (i, (series, run)) in kernels.iter().zip(runs).enumerate() {
        let passed = tally.passed;
        let result = run.and_then(|run| vm_kernel_tests(tally, run, with_dashboard && i == 0));
        let line = match &result {
            Ok(run) => format!(
                "kernel {} ({}): scenarios {}{}: {} tests passed; guest ran {:.0} s",
                run.kernel.version,
                run.kernel.package,
                names.join(","),
                if run.absent.is_empty() {
                    String::new()
                } else {
                    format!(" (no module {})", run.absent.join(","))
                },
                tally.passed - passed,
                run.guest_seconds
            ),
            Err(e) => format!("kernel series {}: FAILED: {e:#}", series.name),
        };
        eprintln!("xtask: vm-test: {line}");
        lines.push(line);
        if let Err(e) = result {
            failures.push(format!("{}: {e:#}", series.name));
        }
    }
    println!("VM kernels:");
    for line in &lines {
        println!("  {}", line.lines().next().unwrap_or_default());
    }
    if !failures.is_empty() {
        bail!(
            "the VM tests failed on {} of {} kernels:\n{}",
            failures.len(),
            kernels.len(),
            failures.join("\n")
        );
    }
    Ok(())
}

/// One kernel's finished guest run: tests/tests/vm against its console log.
fn vm_kernel_tests(tally: &mut Tally, run: vm::VmRun, with_dashboard: bool) -> Result<vm::VmRun> {
    let mut cmd = cargo(None);
    cmd.args(["test", "--release", "-p", "tracerd-tests", "--test", "vm"])
        .env("TRACERD_VM_CONSOLE", &run.log);
    tally.run(&mut cmd, &format!("VM tests (Debian kernel {} under qemu)", run.kernel.version))?;
    if with_dashboard {
        let mut cmd = cargo(None);
        cmd.args(["test", "--release", "-p", "tracerd-tests", "--test", "dashboard", "--", "--nocapture"])
            .env("TRACERD_VM_CONSOLE", &run.log)
            .env("TRACERD_BIN", tracerd_bin());
        tally.run(&mut cmd, "Grafana dashboard against Prometheus (host + VM expositions)")?;
    }
    Ok(run)
}

fn integration_tests(tally: &mut Tally) -> Result<()> {
    if !setup::is_root() {
        bail!(
            "the integration tests load programs into the running kernel and create loop devices: \
             run `sudo cargo xtask test` (or `cargo xtask test --unit-only` for the unit tests alone)"
        );
    }
    // What a fleet installs: the package and the image are tested as built.
    dist::dist()?;
    let mut cmd = cargo(None);
    cmd.args([
        "test",
        "--release",
        "-p",
        "tracerd-tests",
        "--lib",
        "--test",
        "dist",
        "--test",
        "host_kernel",
        "--test",
        "prometheus",
        "--test",
        "deploy",
        "--test",
        "http",
        "--test",
        "faults",
        "--test",
        "agent",
        "--test",
        "cgroups",
        "--test",
        "store",
        "--test",
        "causes",
        "--",
        "--test-threads=1",
    ])
    .env("TRACERD_BIN", tracerd_bin());
    tally.run(&mut cmd, "integration tests (host kernel)")
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn scenario_help_lists_every_scenario() {
        let mut cli = Cli::command();
        let help = cli.find_subcommand_mut("vm-test").expect("vm-test").render_long_help().to_string();
        // clap wraps help to the terminal where a crate in the build enables `wrap_help`.
        let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
        let listed = help.split_once("Run only this scenario (").and_then(|(_, r)| r.split_once(')'));
        let listed: Vec<&str> = listed.map(|(names, _)| names.split(", ").collect()).unwrap_or_default();
        assert_eq!(listed, vm::scenarios::names(), "{help}");
    }
}
