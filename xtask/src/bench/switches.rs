//! The context-switch row: what a tracer costs on a context switch that is no IO's. Two threads
//! bounce a byte through two pipes (each bounce blocks one and wakes the other), with no
//! tracer, the agent, the agent with its wait hooks (`--causes`) and offcputime, interleaved
//! over rounds. Cost is machine CPU per context switch (/proc/stat busy ticks over its `ctxt`
//! count), and each tracer's extra over the untraced runs of its own round.

use std::{
    fmt::Write as _,
    fs,
    io::{Read, Write},
    os::unix::net::UnixStream,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use super::{
    probes::machine_busy_ticks,
    stats::median,
    tracer::Tracer,
    variants::{SWITCH_VARIANTS, Variant},
};

/// Per variant, each round's machine CPU per context switch (ns), in round order.
pub(super) type Switches = Vec<(Variant, Vec<f64>)>;

/// Context switches of the whole machine since boot (`ctxt` in /proc/stat).
fn context_switches() -> u64 {
    let stat = fs::read_to_string("/proc/stat").unwrap_or_default();
    stat.lines().find_map(|l| l.strip_prefix("ctxt ")).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// Two threads bounce a byte for `seconds`; returns the round trips.
fn ping_pong(seconds: u64) -> Result<u64> {
    let (mut a, mut b) = UnixStream::pair().context("socket pair")?;
    let echo = std::thread::spawn(move || {
        let mut byte = [0u8];
        while b.read_exact(&mut byte).is_ok() {
            if b.write_all(&byte).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut trips = 0u64;
    let mut byte = [1u8];
    while Instant::now() < deadline {
        for _ in 0..1000 {
            a.write_all(&byte)?;
            a.read_exact(&mut byte)?;
        }
        trips += 1000;
    }
    drop(a);
    let _ = echo.join();
    Ok(trips)
}

/// Machine CPU per context switch (ns) while the ping-pong runs under `variant`.
fn measure(variant: Variant, seconds: u64, tck: f64) -> Result<f64> {
    let mut tracer = Tracer::start(variant, 9598)?;
    let (busy0, switches0) = (machine_busy_ticks(), context_switches());
    let trips = ping_pong(seconds)?;
    let (busy1, switches1) = (machine_busy_ticks(), context_switches());
    tracer.stop()?;
    let switches = switches1.saturating_sub(switches0).max(1);
    eprintln!("xtask: bench: {} round trips, {switches} context switches", trips);
    Ok((busy1 - busy0) as f64 * 1e9 / tck / switches as f64)
}

/// The row, `rounds` times over every variant, interleaved.
pub(super) fn switch_row(seconds: u64, rounds: usize, tck: f64) -> Result<Switches> {
    let mut out: Switches = SWITCH_VARIANTS.iter().map(|&v| (v, Vec::new())).collect();
    for round in 1..=rounds {
        for (v, samples) in out.iter_mut() {
            eprintln!("xtask: bench: context switches: round {round}/{rounds}: {}", v.name());
            samples.push(measure(*v, seconds, tck).with_context(|| format!("ping-pong with {}", v.name()))?);
        }
    }
    Ok(out)
}

/// The row as text: each variant's median CPU per switch, and each tracer's extra over the mean
/// of its round's two untraced runs (median, and min..max over rounds).
pub(super) fn switch_table(rows: &Switches) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\ncontext switches (two threads bouncing a byte; machine CPU per switch, kernel.bpf_stats_enabled off)"
    );
    let _ = writeln!(out, "{:<16} {:>10} {:>12} {:>17}", "variant", "CPU/switch", "extra", "extra range");
    let of = |v: Variant| rows.iter().find(|(x, _)| *x == v).map(|(_, s)| s.as_slice()).unwrap_or(&[]);
    let (first, last) = (of(Variant::None), of(Variant::NoneAgain));
    let base: Vec<f64> = first.iter().zip(last).map(|(a, b)| (a + b) / 2.0).collect();
    for (v, samples) in rows {
        let extra: Vec<f64> = samples.iter().zip(&base).map(|(s, b)| s - b).collect();
        let (lo, hi) =
            extra.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
        let untraced = v.is_untraced();
        let _ = writeln!(
            out,
            "{:<16} {:>8.0}ns {:>12} {:>17}",
            v.name(),
            median(samples.clone()),
            if untraced { "-".into() } else { format!("{:+.0}ns", median(extra.clone())) },
            if untraced { "-".into() } else { format!("{lo:+.0}..{hi:+.0}ns") },
        );
    }
    let noise: Vec<f64> = first.iter().zip(last).map(|(a, b)| (a - b).abs()).collect();
    let _ = writeln!(
        out,
        "{:<16} noise (the two untraced runs of a round apart, median): {:.0}ns",
        "",
        median(noise)
    );
    out
}
