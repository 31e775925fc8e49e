//! The soak: `tracerd run` at saturation for `--soak-seconds`, scraped every second, for what
//! must stay flat over time (RSS, open fds, in-flight tables) and the events it loses.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    process::Command,
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use super::{
    machine::output,
    measure::{Workload, fio},
    probes::status_kib,
    tracer::Tracer,
    variants::Variant,
};

/// What the soak found.
pub(super) struct Soak {
    pub(super) seconds: u64,
    /// One per second.
    samples: Vec<SoakSample>,
    /// tracerd's RSS of each second it was read, in KiB.
    pub(super) rss: Vec<u64>,
    /// Lost events at the last scrape.
    pub(super) lost: u64,
    /// Non-zero lost-event counters by reason, at the end.
    pub(super) reasons: BTreeMap<String, u64>,
}

/// One second of the soak, from tracerd's own /metrics and /proc.
#[derive(Clone, Copy, Debug, Default)]
struct SoakSample {
    t_s: u64,
    rss_kib: u64,
    open_fds: u64,
    in_flight_bios: u64,
    in_flight_requests: u64,
    records: u64,
    lost: u64,
}

/// One series' value in a /metrics body.
fn metric(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// `tracerd run` at saturation for `seconds`, scraped every second (as Prometheus would):
/// RSS, open fds, in-flight table occupancy, records and lost events over time.
pub(super) fn soak(dev: &str, seconds: u64) -> Result<Soak> {
    eprintln!("xtask: bench: soak: tracerd run at saturation for {seconds} s");
    let mut tracer = Tracer::start(Variant::TracerdRun, 9598)?;
    let pid = tracer.pid().context("tracerd pid")?;
    let addr = tracer.metrics.clone().context("tracerd run serves metrics")?;
    let w = Workload::new("soak", 32, 1);
    let dev = dev.to_owned();
    let fio_thread = std::thread::spawn(move || fio(&dev, &w, seconds));
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(seconds) {
        sleep(Duration::from_secs(1));
        let body =
            output(Command::new("curl").args(["-s", "--max-time", "2", &format!("http://{addr}/metrics")]))
                .unwrap_or_default();
        let lost = body
            .lines()
            .filter(|l| l.starts_with("tracerd_events_lost_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64;
        samples.push(SoakSample {
            t_s: start.elapsed().as_secs(),
            rss_kib: status_kib(pid, "VmRSS:").unwrap_or(0),
            open_fds: metric(&body, "process_open_fds").unwrap_or(0.0) as u64,
            in_flight_bios: metric(&body, "tracerd_in_flight_entries{table=\"bios\"}").unwrap_or(0.0) as u64,
            in_flight_requests: metric(&body, "tracerd_in_flight_entries{table=\"requests\"}").unwrap_or(0.0)
                as u64,
            records: metric(&body, "tracerd_records_total").unwrap_or(0.0) as u64,
            lost,
        });
    }
    fio_thread.join().map_err(|_| anyhow::anyhow!("fio thread panicked"))??;
    let reasons = tracer.lost_reasons();
    tracer.stop()?;
    if !reasons.is_empty() {
        eprintln!("xtask: bench: soak lost events by reason: {}", reasons_text(&reasons));
    }
    let rss = samples.iter().map(|s| s.rss_kib).filter(|&k| k > 0).collect();
    let lost = samples.last().map_or(0, |s| s.lost);
    Ok(Soak { seconds, samples, rss, lost, reasons })
}

impl Soak {
    /// The soak over time: its table, lost events by reason and open fds.
    pub(super) fn over_time(&self) -> String {
        let fds: Vec<u64> = self.samples.iter().map(|s| s.open_fds).filter(|&n| n > 0).collect();
        format!(
            "\nsoak over time (scraped every second; lost events by reason: {}):\n{}open fds: first {}, last {}, max {}\n",
            reasons_text(&self.reasons),
            soak_table(&self.samples),
            fds.first().unwrap_or(&0),
            fds.last().unwrap_or(&0),
            fds.iter().max().unwrap_or(&0)
        )
    }
}

/// About ten evenly spaced rows of the soak, and the last.
fn soak_table(samples: &[SoakSample]) -> String {
    let mut out = String::from("    t   RSS MiB   fds   in-flight bios/requests   records/s        lost\n");
    let step = (samples.len() / 10).max(1);
    let mut prev: Option<&SoakSample> = None;
    for (i, s) in samples.iter().enumerate() {
        if i % step != 0 && i + 1 != samples.len() {
            continue;
        }
        let rate = prev
            .map_or(0.0, |p| (s.records - p.records.min(s.records)) as f64 / (s.t_s - p.t_s).max(1) as f64);
        let _ = writeln!(
            out,
            "{:>5}s {:>9.1} {:>5} {:>12}/{:<12} {:>10.0} {:>11}",
            s.t_s,
            s.rss_kib as f64 / 1024.0,
            s.open_fds,
            s.in_flight_bios,
            s.in_flight_requests,
            rate,
            s.lost
        );
        prev = Some(s);
    }
    out
}

pub(super) fn reasons_text(reasons: &BTreeMap<String, u64>) -> String {
    if reasons.is_empty() {
        return "none".into();
    }
    reasons.iter().map(|(r, n)| format!("{r} {n}")).collect::<Vec<_>>().join(", ")
}
