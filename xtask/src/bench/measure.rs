//! The measure loop: fio on the bench's disk under each variant, with the machine's and the
//! tracer's readings around it; the rows (saturated, fixed-rate, many disks) and their rounds,
//! interleaved so that drift on a shared machine hits every variant alike.

use std::{collections::BTreeMap, process::Command};

use anyhow::{Context, Result};

use super::{
    machine::{Machine, Stats, output, set_bpf_stats},
    probes::{bpf_runtimes, machine_busy_ticks, per_program, process_ticks, status_kib},
    stats::{Results, Sample, median},
    tracer::Tracer,
    variants::{ALL, MANY_DISKS_VARIANTS, RATED, Variant},
};

/// A row's fio workload.
#[derive(Clone, Debug)]
pub(super) struct Workload {
    name: String,
    /// Queue depth of each submitter.
    iodepth: u32,
    /// fio jobs (threads submitting side by side).
    jobs: u32,
    rate_iops: Option<u64>,
    /// fio's `--filename` where it is not the bench's one disk: several, `:`-separated.
    filename: Option<String>,
}

impl Workload {
    pub(super) fn new(name: &str, iodepth: u32, jobs: u32) -> Workload {
        Workload { name: name.into(), iodepth, jobs, rate_iops: None, filename: None }
    }
}

/// Rounds of the fixed-rate runs, whatever `--rounds` says below it: their CPU per IO is what
/// the cost targets judge, and fewer rounds give no spread to judge them by.
pub(super) const FIXED_RATE_ROUNDS: usize = 5;

/// Disks of the many-disks workload: past the 32 series a small host starts with, as a storage
/// server with dozens of busy drives is.
const MANY_DISKS: usize = 48;

/// The saturated rows, by the names the tables and targets give them.
pub(super) const SATURATION: &str = "qd32 saturation";
pub(super) const TWO_SUBMITTERS: &str = "2 jobs x qd16";
pub(super) const QD1: &str = "qd1";

/// fio 4 KiB random reads for `seconds`: (IOPS, IOs).
pub(super) fn fio(dev: &str, w: &Workload, seconds: u64) -> Result<(f64, u64)> {
    let mut cmd = Command::new("fio");
    cmd.args(["--name=bench", "--rw=randread", "--bs=4k", "--ioengine=libaio", "--direct=1"])
        .args(["--norandommap", "--randrepeat=0", "--time_based", "--output-format=json"])
        .arg("--group_reporting")
        .arg(format!("--filename={}", w.filename.as_deref().unwrap_or(dev)))
        .arg(format!("--iodepth={}", w.iodepth))
        .arg(format!("--numjobs={}", w.jobs))
        .arg(format!("--runtime={seconds}"));
    if let Some(rate) = w.rate_iops {
        cmd.arg(format!("--rate_iops={rate}"));
    }
    let json = output(&mut cmd)?;
    let find = |key: &str| -> Option<f64> {
        let read = &json[json.find("\"read\"")?..];
        let at = read.find(&format!("\"{key}\""))? + key.len() + 2;
        let rest = read[at..].trim_start().strip_prefix(':')?.trim_start();
        rest[..rest.find([',', '\n'])?].trim().parse().ok()
    };
    let iops = find("iops").context("fio JSON without read.iops")?;
    let ios = find("total_ios").context("fio JSON without read.total_ios")? as u64;
    Ok((iops, ios))
}

/// One fio run of `w` under `variant`, with the machine's and the tracer's readings around it.
fn measure(
    variant: Variant,
    w: &Workload,
    dev: &str,
    seconds: u64,
    tck: f64,
    stats: Stats,
) -> Result<Sample> {
    let tracer = Tracer::start(variant, 9599)?;
    let pid = tracer.pid();
    let bpf0 = bpf_runtimes(&tracer.programs)?;
    let busy0 = machine_busy_ticks();
    let own0 = pid.and_then(process_ticks);
    let (iops, ios) = fio(dev, w, seconds)?;
    let busy1 = machine_busy_ticks();
    let own1 = pid.and_then(process_ticks);
    let bpf1 = bpf_runtimes(&tracer.programs)?;
    let is_tracerd = variant.is_tracerd();
    let rss = if is_tracerd { pid.and_then(|p| status_kib(p, "VmHWM:")) } else { None };
    // One scrape: the total is the sum of the per-reason counters (`tracerd run` only).
    let lost_reasons = tracer.lost_reasons();
    let lost_run = tracer.metrics.is_some().then(|| lost_reasons.values().sum::<u64>());
    let programs = tracer.programs.len();
    let mut tracer = tracer;
    let lost_snoop = tracer.stop()?;
    let per_io = |v: f64| v / ios.max(1) as f64;
    let by_program = per_program(&bpf0, &bpf1, ios);
    let bpf_total: f64 = by_program.values().map(|p| p.0).sum();
    Ok(Sample {
        iops,
        ios,
        cpu_ns_per_io: per_io((busy1 - busy0) as f64 * 1e9 / tck),
        bpf_ns_per_io: (!variant.is_untraced() && stats == Stats::On).then_some(bpf_total),
        bpf_programs: programs,
        bpf_by_program: if stats == Stats::On { by_program } else { BTreeMap::new() },
        tracer_cpu_ns_per_io: if is_tracerd {
            own0.zip(own1).map(|(a, b)| per_io((b - a) as f64 * 1e9 / tck))
        } else {
            None
        },
        tracer_rss_kib: rss,
        lost: if is_tracerd { Some(lost_run.or(lost_snoop).unwrap_or(0)) } else { None },
        lost_reasons,
    })
}

/// Runs every workload under every variant, interleaved, `rounds` times; each key's samples
/// are in round order.
fn run_interleaved(
    results: &mut Results,
    workloads: &[Workload],
    variants: &[Variant],
    dev: &str,
    (seconds, rounds): (u64, usize),
    tck: f64,
    stats: Stats,
) -> Result<()> {
    set_bpf_stats(stats)?;
    let phase = if stats == Stats::On { "BPF run time, stats on" } else { "IOPS, stats off" };
    for round in 1..=rounds {
        for w in workloads {
            for &v in variants {
                eprintln!("xtask: bench: {phase}: round {round}/{rounds}: {} with {}", w.name, v.name());
                let s = measure(v, w, dev, seconds, tck, stats)
                    .with_context(|| format!("{} with {}", w.name, v.name()))?;
                results.entry((w.name.clone(), v)).or_default().push(s);
            }
        }
    }
    Ok(())
}

/// Every row of the tables, stats off: the saturated rows (with `fixed_rate_only`, the
/// untraced saturation rate alone), the fixed-rate rows at fractions of that rate and the
/// many-disks row; then the BPF run time per IO, stats on. Returns (results, costs).
pub(super) fn rows(
    machine: &mut Machine,
    dev: &str,
    (seconds, rounds): (u64, usize),
    fixed_rate_only: bool,
    tck: f64,
) -> Result<(Results, Results)> {
    let mut results = Results::new();
    let mut costs = Results::new();
    let qd32 = Workload::new(SATURATION, 32, 1);
    let two = Workload::new(TWO_SUBMITTERS, 16, 2);
    let qd1 = Workload::new(QD1, 1, 1);
    let saturating = [qd32.clone(), two, qd1];
    if fixed_rate_only {
        // The rates are fractions of the untraced saturation rate: that alone is needed.
        run_interleaved(&mut results, &saturating[..1], &ALL[..1], dev, (seconds, rounds), tck, Stats::Off)?;
    } else {
        run_interleaved(&mut results, &saturating, &ALL, dev, (seconds, rounds), tck, Stats::Off)?;
    }
    let untraced = median(results[&(qd32.name.clone(), Variant::None)].iter().map(|s| s.iops).collect());
    let rated: Vec<Workload> = [25u64, 50, 75]
        .iter()
        .map(|pct| Workload {
            rate_iops: Some((untraced * *pct as f64 / 100.0) as u64),
            ..Workload::new(&format!("qd32 at {pct}% rate"), 32, 1)
        })
        .collect();
    // The fixed-rate rows are the cost verdicts: at least FIXED_RATE_ROUNDS rounds, with
    // every variant a target names (the cgroup label, the per-IO stream).
    let rated_rounds = rounds.max(FIXED_RATE_ROUNDS);
    run_interleaved(&mut results, &rated, &RATED, dev, (seconds, rated_rounds), tck, Stats::Off)?;
    // The 50% rate again, spread over many disks: beside the one-disk row, what more disks cost.
    for i in 0..MANY_DISKS {
        machine.many_disk(i)?;
    }
    let many = Workload {
        rate_iops: rated[1].rate_iops,
        filename: Some(machine.many_disks()),
        ..Workload::new(&format!("{MANY_DISKS} disks, 50% rate"), 32, 1)
    };
    run_interleaved(
        &mut results,
        std::slice::from_ref(&many),
        &MANY_DISKS_VARIANTS,
        dev,
        (seconds, rated_rounds),
        tck,
        Stats::Off,
    )?;
    // BPF run time per IO: separate runs with stats on, one round; over the many disks too,
    // where the programs cost more per IO than on one.
    let compared = [Variant::TracerdRun, Variant::Biolatency];
    if fixed_rate_only {
        run_interleaved(&mut costs, &saturating[..1], &compared, dev, (seconds, 1), tck, Stats::On)?;
    } else {
        run_interleaved(&mut costs, &saturating[..2], &ALL[1..], dev, (seconds, 1), tck, Stats::On)?;
    }
    run_interleaved(&mut costs, &[many], &compared, dev, (seconds, 1), tck, Stats::On)?;
    Ok((results, costs))
}
