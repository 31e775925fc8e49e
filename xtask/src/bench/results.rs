//! What the bench prints and writes: the tables and their targets, the raw figures
//! (bench.json) and the results page.

use std::{fmt::Write as _, fs, process::Command};

use anyhow::Result;

use super::{
    machine::output,
    measure::{FIXED_RATE_ROUNDS, QD1, SATURATION, TWO_SUBMITTERS},
    soak::{Soak, reasons_text},
    stats::{Results, Sample, aa_noise, cpu_per_io, losses, median, noise, paired_diff, paired_extra},
    variants::{ALL, RATED, SHOWN, Variant},
};
use crate::root_dir;

/// The tables and the targets; `rest` (the soak, the records and recorder benchmarks) is absent
/// from a fixed-rate-only run.
pub(super) fn summarize(results: &Results, costs: &Results, rest: Option<(&Soak, &str, &str)>) -> String {
    let mut out = String::new();
    let mut verdicts: Vec<(String, bool)> = Vec::new();
    let missed = iops_table(&mut out, &mut verdicts, results, costs);
    if !costs.is_empty() {
        bpf_table(&mut out, &mut verdicts, costs);
    }
    if let Some(rest) = rest {
        soak_lines(&mut out, &mut verdicts, rest, missed);
    }
    let _ = writeln!(out, "\ntargets:");
    for (what, ok) in verdicts {
        let _ = writeln!(out, "  {:<62} {}", what, if ok { "met" } else { "NOT met" });
    }
    out
}

/// The IOPS table, row by row with the lines under each row, and its targets; returns the
/// missed completions `tracerd run` counted.
fn iops_table(
    out: &mut String,
    verdicts: &mut Vec<(String, bool)>,
    results: &Results,
    costs: &Results,
) -> u64 {
    let _ = writeln!(
        out,
        "\nIOPS (kernel.bpf_stats_enabled off; loss against the no-tracer run of the same round: median, and min..max over rounds)"
    );
    let _ = writeln!(
        out,
        "{:<18} {:<15} {:>9} {:>7} {:>15} {:>9} {:>10} {:>8} {:>5}",
        "workload", "variant", "IOPS", "loss", "loss range", "CPU/IO", "tracer/IO", "RSS", "lost"
    );
    let mut workloads: Vec<&String> = results.keys().map(|(w, _)| w).collect();
    workloads.dedup();
    let mut missed = 0u64;
    for w in workloads {
        let noise = noise(results, w);
        for v in SHOWN {
            let Some(samples) = results.get(&(w.clone(), v)) else { continue };
            let l = losses(results, w, v);
            let (lo, hi) =
                l.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
            let rss = samples.iter().filter_map(|s| s.tracer_rss_kib).max();
            let lost = samples.iter().filter_map(|s| s.lost).max();
            missed += samples
                .iter()
                .map(|s| s.lost_reasons.get("missed_completion").copied().unwrap_or(0))
                .sum::<u64>();
            let _ = writeln!(
                out,
                "{:<18} {:<15} {:>9.0} {:>7} {:>15} {:>9} {:>10} {:>8} {:>5}",
                w,
                v.name(),
                med(samples, |s| Some(s.iops)).unwrap_or(f64::NAN),
                pct(median(l.clone())),
                if v == Variant::None { "-".into() } else { format!("{}..{}", pct(lo), pct(hi)) },
                fmt_ns(med(samples, |s| Some(s.cpu_ns_per_io))),
                fmt_ns(med(samples, |s| s.tracer_cpu_ns_per_io)),
                rss.map_or("-".into(), |k| format!("{:.1}MiB", k as f64 / 1024.0)),
                lost.map_or("-".into(), |l| l.to_string())
            );
        }
        let loss = |v| median(losses(results, w, v));
        let (run, bio) = (loss(Variant::TracerdRun), loss(Variant::Biolatency));
        // A row that ran neither (the saturation row of --fixed-rate-only) compares nothing.
        let versus = if run.is_nan() || bio.is_nan() {
            String::new()
        } else {
            format!("; tracerd run loses {} vs biolatency {}", pct(run), pct(bio))
        };
        let _ =
            writeln!(out, "{:<18} noise (untraced IOPS, max-min over median): {}{versus}", "", pct(noise));
        // A traced run faster than the untraced one means the tracer changed how the CPUs
        // were scheduled: such a row cannot rank tracers, the fixed-rate rows do.
        let faster: Vec<&str> = ALL[1..]
            .iter()
            .filter(|&&v| results.contains_key(&(w.clone(), v)) && loss(v) < 0.0)
            .map(|v| v.name())
            .collect();
        if !w.contains("% rate") && !faster.is_empty() {
            let _ = writeln!(
                out,
                "{:<18} FLAG: faster than no tracer: {}; IOPS at saturation cannot rank tracers here (judge the fixed-rate rows)",
                "",
                faster.join(", ")
            );
        }
        if w.ends_with("% rate") {
            verdicts.extend(fixed_rate_lines(out, results, costs, w));
        }
        // A fixed-rate-only run has the untraced saturated runs alone: nothing to judge there.
        let ran = |v: Variant| results.contains_key(&(w.clone(), v));
        if [SATURATION, TWO_SUBMITTERS, QD1].contains(&w.as_str()) && ran(Variant::TracerdRun) {
            verdicts.push((format!("{w}: tracerd run loss <= biolatency's + noise"), run <= bio + noise));
        }
        if w == SATURATION {
            for v in [Variant::TracerdSnoop, Variant::TracerdReport].into_iter().filter(|&v| ran(v)) {
                let l = loss(v);
                verdicts.push((
                    format!("{w}: {} loss <= 2 x biolatency's + noise", v.name()),
                    l <= 2.0 * bio.max(0.0) + noise,
                ));
            }
        }
    }
    missed
}

/// The BPF run time per IO table, with each program's share, and its targets.
fn bpf_table(out: &mut String, verdicts: &mut Vec<(String, bool)>, costs: &Results) {
    let _ = writeln!(
        out,
        "\nBPF run time per IO (separate runs, kernel.bpf_stats_enabled on, so each program run also pays two clock reads)"
    );
    let _ = writeln!(out, "{:<18} {:<15} {:>9} {:>9}", "workload", "variant", "programs", "BPF/IO");
    let mut workloads: Vec<&String> = costs.keys().map(|(w, _)| w).collect();
    workloads.dedup();
    for w in workloads {
        for v in ALL {
            let Some(samples) = costs.get(&(w.clone(), v)) else { continue };
            let programs = samples.iter().map(|s| s.bpf_programs).max().unwrap_or(0);
            let _ = writeln!(
                out,
                "{:<18} {:<15} {:>9} {:>9}",
                w,
                v.name(),
                programs,
                fmt_ns(med(samples, |s| s.bpf_ns_per_io))
            );
            // The profile behind the total: which program costs what, and how often it
            // runs per IO (a tracer with more hooks pays per hook); programs that never ran
            // are left out.
            let mut names: Vec<&String> = samples.iter().flat_map(|s| s.bpf_by_program.keys()).collect();
            names.sort();
            names.dedup();
            let parts: Vec<String> = names
                .iter()
                .filter_map(|n| {
                    let of = |i: usize| {
                        let v: Vec<f64> = samples
                            .iter()
                            .filter_map(|s| s.bpf_by_program.get(*n))
                            .map(|p| [p.0, p.1][i])
                            .collect();
                        (!v.is_empty()).then(|| median(v))
                    };
                    let (ns, runs) = (of(0), of(1));
                    (runs.unwrap_or(0.0) > 0.0)
                        .then(|| format!("{n} {} x{:.2}", fmt_ns(ns), runs.unwrap_or(0.0)))
                })
                .collect();
            if !parts.is_empty() {
                let _ = writeln!(out, "{:<18}   per program (ns/IO, runs/IO): {}", "", parts.join(", "));
            }
        }
        let bpf = |v| costs.get(&(w.clone(), v)).and_then(|s| med(s, |s| s.bpf_ns_per_io));
        if let (Some(t), Some(b)) = (bpf(Variant::TracerdRun), bpf(Variant::Biolatency)) {
            verdicts.push((format!("{w}: tracerd run BPF/IO <= biolatency's"), t <= b));
        }
    }
}

/// The soak's line, the records and recorder benchmarks' lines, and their targets; `missed` is
/// what the bench counted before the soak.
fn soak_lines(
    out: &mut String,
    verdicts: &mut Vec<(String, bool)>,
    (soak, records, recorder): (&Soak, &str, &str),
    mut missed: u64,
) {
    let rss = &soak.rss;
    let (first, last, peak) = (
        rss.first().copied().unwrap_or(0),
        rss.last().copied().unwrap_or(0),
        rss.iter().max().copied().unwrap_or(0),
    );
    let drift = if first > 0 { (last as f64 - first as f64) / first as f64 } else { f64::NAN };
    let _ = writeln!(
        out,
        "\nsoak: tracerd run at saturation for {} s: lost events {} ({}), RSS first {:.1} MiB, last {:.1} MiB, peak {:.1} MiB (drift {:+.1}%)",
        soak.seconds,
        soak.lost,
        reasons_text(&soak.reasons),
        first as f64 / 1024.0,
        last as f64 / 1024.0,
        peak as f64 / 1024.0,
        drift * 100.0
    );
    let _ = writeln!(out, "{records}");
    let _ = writeln!(out, "{recorder}");
    missed += soak.reasons.get("missed_completion").copied().unwrap_or(0);
    verdicts.push((format!("no missed_completion (tracerd run, bench and soak: {missed})"), missed == 0));
    verdicts.push(("zero lost events in the soak".into(), soak.lost == 0));
    verdicts.push(("daemon RSS under 64 MiB".into(), peak > 0 && peak < 64 * 1024));
    verdicts.push(("RSS flat within 5% over the soak".into(), drift.abs() <= 0.05));
    verdicts.push((
        "decode+aggregate >= 5 M records/s".into(),
        records.contains("met") && !records.contains("NOT met"),
    ));
    let line = |prefix: &str| recorder.lines().find(|l| l.starts_with(prefix)).unwrap_or_default();
    verdicts.push((
        "flight recorder: 8 busy devices for its whole hour within its bound".into(),
        line("recorder: ").ends_with(": met"),
    ));
    verdicts.push((
        "recorder store: a day of 8 busy devices within its default bound".into(),
        line("recorder store: an hour").ends_with(": met"),
    ));
}

/// The median of one figure over samples; `None` where no sample has it.
fn med(v: &[Sample], f: fn(&Sample) -> Option<f64>) -> Option<f64> {
    let vals: Vec<f64> = v.iter().filter_map(f).collect();
    (!vals.is_empty()).then(|| median(vals))
}

/// A fraction as a percentage, to one decimal.
fn pct(v: f64) -> String {
    format!("{:.1}%", v * 100.0)
}

/// The lines under a fixed-rate row, and its cost verdicts. Every figure is paired within a
/// round (see `paired_extra`), and every target is judged against the row's A/A noise.
fn fixed_rate_lines(out: &mut String, results: &Results, costs: &Results, w: &str) -> Vec<(String, bool)> {
    let ran = |v: Variant| results.contains_key(&(w.into(), v));
    let noise = aa_noise(results, w);
    let mut verdicts = Vec::new();
    let shown: Vec<String> = RATED
        .iter()
        .filter(|&&v| !v.is_untraced() && ran(v))
        .map(|&v| format!("{} {}", v.name(), ns_range(&paired_extra(results, w, v))))
        .collect();
    let _ = writeln!(
        out,
        "{:<18} extra CPU per IO over the round's untraced runs (median (min..max) of {} rounds): {}",
        "",
        cpu_per_io(results, w, Variant::None).len(),
        shown.join(", ")
    );
    let _ = writeln!(out, "{:<18} A/A noise (median |no tracer again - no tracer|): {noise:.0}ns", "");
    let mut judge = |what: String, (a, b): (Variant, Variant), k: f64| -> Option<f64> {
        if !ran(a) || !ran(b) {
            return None;
        }
        let d = paired_diff(results, w, (a, b), k);
        let _ = writeln!(out, "{:<18} {what}, same round: {}", "", ns_range(&d));
        let m = median(d);
        verdicts.push((format!("{w}: {what} <= A/A noise"), m <= noise));
        Some(m)
    };
    let over_bio =
        judge("tracerd run's extra - biolatency's".into(), (Variant::TracerdRun, Variant::Biolatency), 1.0);
    judge(
        "run (cgroups)'s extra - tracerd run's".into(),
        (Variant::TracerdRunCgroups, Variant::TracerdRun),
        1.0,
    );
    for v in [Variant::TracerdSnoop, Variant::TracerdReport] {
        judge(format!("{}'s extra - 2 x tracerd run's", v.name()), (v, Variant::TracerdRun), 2.0);
    }
    if let Some(d) = over_bio.filter(|&d| d > noise) {
        account(out, results, costs, w, d);
    }
    // The account's A/B, not a target: the same agent without the two hooks biolatency lacks.
    if ran(Variant::TracerdRunNoQg) && ran(Variant::Biolatency) {
        let d = paired_diff(results, w, (Variant::TracerdRunNoQg, Variant::Biolatency), 1.0);
        let _ = writeln!(
            out,
            "{:<18} A/B: run (no Q, G)'s extra - biolatency's, same round: {} (A/A noise {noise:.0}ns)",
            "",
            ns_range(&d)
        );
    }
    // What the wait hooks add per IO (config causes, off by default): not a target yet.
    if ran(Variant::TracerdRunCauses) && ran(Variant::TracerdRun) {
        let d = paired_diff(results, w, (Variant::TracerdRunCauses, Variant::TracerdRun), 1.0);
        let _ = writeln!(
            out,
            "{:<18} A/B: run (causes)'s extra - tracerd run's, same round: {} (A/A noise {noise:.0}ns)",
            "",
            ns_range(&d)
        );
    }
    verdicts
}

/// Where the agent's CPU per IO above biolatency's goes, where it is above the noise:
/// - the kernel programs' time, from the runs with stats on (which pay two clock reads per
///   program run, so they over-count a little);
/// - the hooks' dispatch: the kernel's work around each program run (the tracepoint's stub,
///   RCU, the run itself), which no run time shows. It is calibrated in the same row from
///   biolatency, whose extra CPU is its programs' time plus its hooks' dispatch:
///   per hook = (biolatency's extra - its BPF/IO) / its program runs per IO;
/// - the daemon's own CPU at this rate.
///
/// What none of them accounts for is printed as such.
fn account(out: &mut String, results: &Results, costs: &Results, w: &str, over: f64) {
    // The row's own stats-on runs where there are (the many disks), else the saturated one's.
    let at = if costs.contains_key(&(w.into(), Variant::TracerdRun)) { w } else { SATURATION };
    // BPF/IO, program runs per IO, and the per-program split.
    let bpf = |v: Variant| -> Option<(f64, f64, String)> {
        let samples = costs.get(&(at.into(), v))?;
        let total = median(samples.iter().filter_map(|s| s.bpf_ns_per_io).collect());
        let mut names: Vec<&String> = samples.iter().flat_map(|s| s.bpf_by_program.keys()).collect();
        names.sort();
        names.dedup();
        let of = |n: &String, i: usize| {
            median(samples.iter().filter_map(|s| s.bpf_by_program.get(n)).map(|p| [p.0, p.1][i]).collect())
        };
        let runs: f64 = names.iter().map(|n| of(n, 1)).sum();
        let parts: Vec<String> = names
            .iter()
            .map(|n| (n, of(n, 0)))
            .filter(|(_, ns)| *ns >= 1.0)
            .map(|(n, ns)| format!("{n} {ns:.0}"))
            .collect();
        Some((total, runs, parts.join(" + ")))
    };
    let daemon = median(
        results
            .get(&(w.into(), Variant::TracerdRun))
            .map_or(Vec::new(), |s| s.iter().filter_map(|s| s.tracer_cpu_ns_per_io).collect()),
    );
    let (Some((run, run_hooks, run_parts)), Some((bio, bio_hooks, bio_parts))) =
        (bpf(Variant::TracerdRun), bpf(Variant::Biolatency))
    else {
        let _ = writeln!(out, "{:<18} account: no BPF run-time runs to account with", "");
        return;
    };
    let bio_extra = median(paired_extra(results, w, Variant::Biolatency));
    let per_hook = if bio_hooks > 0.0 { ((bio_extra - bio) / bio_hooks).max(0.0) } else { 0.0 };
    let dispatch = (run_hooks - bio_hooks) * per_hook;
    let _ = writeln!(
        out,
        "{:<18} account of the {over:.0}ns: kernel programs {:+.0}ns (with stats on, at {at}: tracerd run {run:.0} = {run_parts}; biolatency {bio:.0} = {bio_parts}), \
         dispatch of {:.0} more hooks {dispatch:+.0}ns ({per_hook:.0}ns each: biolatency's extra {bio_extra:.0} less its BPF {bio:.0}, over its {bio_hooks:.0} hooks), daemon {daemon:.0}ns, not accounted for {:+.0}ns",
        "",
        run - bio,
        run_hooks - bio_hooks,
        over - (run - bio) - dispatch - daemon
    );
}

/// Median and min..max of per-round figures, in ns.
fn ns_range(v: &[f64]) -> String {
    let (lo, hi) = v.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    format!("{:+.0}ns ({lo:+.0}..{hi:+.0})", median(v.to_vec()))
}

fn fmt_ns(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.0}ns"))
}

pub(super) fn to_json(
    results: &Results,
    costs: &Results,
    rss: &[u64],
    soak_lost: u64,
    records: &str,
) -> String {
    let mut out = String::from("{\"runs\":[");
    let mut first = true;
    let phases = [("stats_off", results), ("stats_on", costs)];
    for ((w, v), samples, phase) in phases.iter().flat_map(|(p, r)| r.iter().map(move |(k, s)| (k, s, p))) {
        for s in samples {
            if !first {
                out.push(',');
            }
            first = false;
            let opt = |v: Option<f64>| v.map_or("null".into(), |v| format!("{v:.1}"));
            let _ = write!(
                out,
                "{{\"phase\":\"{phase}\",\"workload\":\"{w}\",\"variant\":\"{}\",\"iops\":{:.1},\"ios\":{},\"cpu_ns_per_io\":{:.1},\"bpf_ns_per_io\":{},\"bpf_programs\":{},\"tracer_cpu_ns_per_io\":{},\"tracer_peak_rss_kib\":{},\"lost\":{}}}",
                v.name(),
                s.iops,
                s.ios,
                s.cpu_ns_per_io,
                opt(s.bpf_ns_per_io),
                s.bpf_programs,
                opt(s.tracer_cpu_ns_per_io),
                s.tracer_rss_kib.map_or("null".into(), |k| k.to_string()),
                s.lost.map_or("null".into(), |l| l.to_string())
            );
        }
    }
    let rss: Vec<String> = rss.iter().map(u64::to_string).collect();
    let _ = writeln!(
        out,
        "],\"soak\":{{\"rss_kib_per_second\":[{}],\"lost\":{soak_lost}}},\"records_benchmark\":\"{}\"}}",
        rss.join(","),
        records.replace('"', "'")
    );
    out
}

/// The latest full run, as the docs show it (docs/internals/overhead.md says how to read it).
pub(super) const RESULTS_PAGE: &str = "docs/internals/overhead-results.md";

/// The commit the benchmark builds, marked where the tree has changes other than documents.
pub(super) fn provenance() -> Result<String> {
    let git = |args: &[&str]| output(Command::new("git").current_dir(root_dir()).args(args));
    let mut commit = git(&["rev-parse", "--short=12", "HEAD"])?.trim().to_owned();
    let changed = git(&["status", "--porcelain", "--untracked-files=no"])?;
    if changed.lines().any(|l| !l.ends_with(".md")) {
        commit.push_str(" with uncommitted changes");
    }
    Ok(commit)
}

/// The results page: the run's tables under the date, the commit and the machine they belong to,
/// and how long it ran: seconds per variant, rounds, and the soak's seconds.
pub(super) fn results_page(
    text: &str,
    commit: &str,
    (seconds, rounds, soak_seconds): (u64, usize, u64),
) -> Result<String> {
    let date = utc_now()?;
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|v| v.split_once(':')).map(|(_, m)| m.trim()))
        .unwrap_or("unknown CPU")
        .to_owned();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_gib = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next()?.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / (1 << 20) as f64);
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_owned();
    Ok(format!(
        "# Overhead results\n\n\
         Written by `cargo xtask bench`; do not edit by hand. What each column means and how to read \
         it: [overhead](overhead.md). Earlier results are in this file's git history.\n\n\
         | | |\n|---|---|\n\
         | date | {date} |\n\
         | commit | {commit} |\n\
         | machine | {cpus} CPUs ({cpu}), {mem_gib:.0} GiB, kernel {kernel} |\n\
         | run | {} s per variant: {} rounds at saturation, {} at fixed rates; soak {} s |\n\n\
         ```\n{}\n```\n",
        seconds,
        rounds,
        rounds.max(FIXED_RATE_ROUNDS),
        soak_seconds,
        text.trim()
    ))
}

/// The date and time now, to the minute, in UTC.
pub(super) fn utc_now() -> Result<String> {
    Ok(output(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]))?.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(results: &mut Results, v: Variant, cpu: &[f64]) {
        let samples = cpu.iter().map(|&c| Sample { cpu_ns_per_io: c, ..Sample::default() }).collect();
        results.insert(("qd32 at 50% rate".into(), v), samples);
    }

    /// A machine that gets slower round by round: the drift is far larger than the costs, and
    /// pairing within the round still finds them, and the A/A noise stays what it is.
    #[test]
    fn paired_figures_take_out_drift_between_rounds() {
        let w = "qd32 at 50% rate";
        let mut r = Results::new();
        row(&mut r, Variant::None, &[5000.0, 8000.0, 11000.0]);
        row(&mut r, Variant::NoneAgain, &[5100.0, 7900.0, 11100.0]);
        row(&mut r, Variant::TracerdRun, &[5550.0, 8450.0, 11550.0]);
        row(&mut r, Variant::Biolatency, &[5150.0, 8050.0, 11150.0]);
        assert_eq!(paired_extra(&r, w, Variant::TracerdRun), vec![500.0, 500.0, 500.0]);
        assert_eq!(aa_noise(&r, w), 100.0);
        assert_eq!(paired_diff(&r, w, (Variant::TracerdRun, Variant::Biolatency), 1.0), vec![400.0; 3]);
        assert_eq!(paired_diff(&r, w, (Variant::TracerdRun, Variant::Biolatency), 2.0), vec![300.0; 3]);
        // Unpaired medians would read the drift as noise: 6000 ns between rounds.
        let mut out = String::new();
        let verdicts = fixed_rate_lines(&mut out, &r, &Results::new(), w);
        assert_eq!(verdicts.len(), 1, "{verdicts:?}");
        assert!(!verdicts[0].1, "400 ns over biolatency with 100 ns of noise is not met:\n{out}");
        assert!(out.contains("account: no BPF run-time runs"), "{out}");
    }

    #[test]
    fn a_cost_within_the_noise_is_met() {
        let w = "qd32 at 50% rate";
        let mut r = Results::new();
        row(&mut r, Variant::None, &[5000.0, 5200.0, 4900.0]);
        row(&mut r, Variant::NoneAgain, &[5200.0, 5000.0, 5100.0]);
        row(&mut r, Variant::TracerdRun, &[5250.0, 5250.0, 5100.0]);
        row(&mut r, Variant::Biolatency, &[5200.0, 5150.0, 5050.0]);
        let mut out = String::new();
        let verdicts = fixed_rate_lines(&mut out, &r, &Results::new(), w);
        assert_eq!(verdicts, vec![(format!("{w}: tracerd run's extra - biolatency's <= A/A noise"), true)]);
    }
}
