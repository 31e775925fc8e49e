//! `cargo xtask bench`: what tracing costs, measured against no tracer and against the
//! reference tools in the same run. Variants are interleaved (A B C ... A B C ...) over several
//! rounds so that drift on a shared machine hits all of them alike; medians are reported.
//!
//! Workload: fio 4 KiB random reads (libaio, O_DIRECT) on a loop device backed by /dev/shm, at
//! saturation (queue depth 32, one submitter; and two submitters at 16 each), at queue depth 1,
//! and at 25 %, 50 % and 75 % of the untraced saturation rate. Per run: IOPS, machine CPU per IO
//! (/proc/stat), and for tracerd its own CPU, peak RSS and lost events.
//!
//! These runs keep kernel.bpf_stats_enabled off: with it on, every program run pays two clock
//! reads, so a tracer with more programs would be charged more than its own cost. The BPF run
//! time per IO comes from separate runs with it on. Raw figures go to target/bench/bench.json.
//!
//! A context-switch row (`switches`) measures what a tracer costs per context switch that is no
//! IO's: the agent with and without its wait hooks (`--causes`) beside offcputime.
//!
//! `--stacks` measures `tracerd run` on md raid5 and dm-crypt in the VM instead (`stacks`).

mod cargo_bench;
mod machine;
mod measure;
mod probes;
mod results;
mod soak;
mod stacks;
mod stats;
mod switches;
mod tracer;
mod variants;

use std::fs;

use anyhow::{Result, bail};

use self::{
    cargo_bench::{recorder_benchmark, records_benchmark},
    machine::{Machine, Stats, out_dir, set_bpf_stats},
    probes::clock_ticks_per_second,
    results::{RESULTS_PAGE, provenance, results_page, summarize, to_json},
    soak::soak,
    stats::Results,
    switches::{switch_row, switch_table},
};
use crate::{root_dir, setup};

/// `cargo xtask bench` on this machine.
pub struct Options {
    pub seconds: u64,
    pub rounds: usize,
    pub soak_seconds: u64,
    pub soak_only: bool,
    /// Only what the cost targets judge: the untraced saturation rate, the fixed-rate rows,
    /// the many-disks row and the BPF run time of `tracerd run` and biolatency.
    pub fixed_rate_only: bool,
}

/// `cargo xtask bench --stacks`, in the VM.
pub struct StacksOptions {
    pub kernel: String,
    pub seconds: u64,
    pub rounds: usize,
}

pub fn bench(opts: Options) -> Result<()> {
    if !setup::is_root() {
        bail!(
            "the benchmark loads tracers and creates a loop device: run it as root (sudo cargo xtask bench)"
        );
    }
    // What is measured is what the build below compiles: the commit and any change to it now.
    let measured = provenance()?;
    crate::build(false)?;
    setup::apt_install(&["fio", "libbpf-tools", "bpftrace", "bpftool", "curl"], "the benchmark")?;
    let dir = out_dir();
    fs::create_dir_all(&dir)?;
    let mut machine = Machine::new();
    machine.mount_tracefs()?;
    let dev = machine.loop_device()?;
    let tck = clock_ticks_per_second();

    let (results, costs) = if opts.soak_only {
        (Results::new(), Results::new())
    } else {
        measure::rows(&mut machine, &dev, (opts.seconds, opts.rounds), opts.fixed_rate_only, tck)?
    };
    set_bpf_stats(Stats::Off)?;
    // What the wait hooks cost on a context switch that is no IO's (causes).
    let switches = if opts.soak_only {
        String::new()
    } else {
        switch_table(&switch_row(opts.seconds, opts.rounds.max(measure::FIXED_RATE_ROUNDS), tck)?)
    };
    if opts.fixed_rate_only {
        let mut text = summarize(&results, &costs, None);
        text.push_str(&switches);
        print!("{text}");
        let page = dir.join("fixed-rate.md");
        fs::write(&page, results_page(&text, &measured, (opts.seconds, opts.rounds, opts.soak_seconds))?)?;
        fs::write(dir.join("bench.json"), to_json(&results, &costs, &[], 0, ""))?;
        eprintln!(
            "xtask: bench: the fixed-rate rows alone, in {}; {RESULTS_PAGE} keeps the last full run",
            page.display()
        );
        return Ok(());
    }
    let soak = soak(&dev, opts.soak_seconds)?;
    let records = records_benchmark()?;
    let recorder = recorder_benchmark()?;

    let mut text = summarize(&results, &costs, Some((&soak, &records, &recorder)));
    text.push_str(&switches);
    text.push_str(&soak.over_time());
    print!("{text}");
    fs::write(dir.join("bench.txt"), &text)?;
    if opts.soak_only {
        eprintln!("xtask: bench: a soak alone; {RESULTS_PAGE} keeps the last full run");
    } else {
        let page = results_page(&text, &measured, (opts.seconds, opts.rounds, opts.soak_seconds))?;
        fs::write(root_dir().join(RESULTS_PAGE), page)?;
        eprintln!("xtask: bench: wrote {RESULTS_PAGE}: commit it with the code it measured");
    }
    fs::write(dir.join("bench.json"), to_json(&results, &costs, &soak.rss, soak.lost, &records))?;
    eprintln!("xtask: bench: raw figures in {}", dir.join("bench.json").display());
    Ok(())
}

pub fn bench_stacks(opts: StacksOptions) -> Result<()> {
    stacks::bench_stacks(&opts.kernel, opts.seconds, opts.rounds)
}
