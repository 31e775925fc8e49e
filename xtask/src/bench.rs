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

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{root_dir, run, setup, tracerd_bin};

const BPFTRACE_SCRIPT: &str = "tracepoint:block:block_rq_issue { @start[args->dev, args->sector] = nsecs; }
tracepoint:block:block_rq_complete /@start[args->dev, args->sector]/ {
  @usecs = hist((nsecs - @start[args->dev, args->sector]) / 1000);
  delete(@start[args->dev, args->sector]);
}";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Variant {
    None,
    TracerdRun,
    /// The agent with every IO as a record (`--aggregation records`), as before the kernel
    /// aggregated: what in-kernel aggregation saves.
    TracerdRunRecords,
    /// The agent with a cgroup label (`[cgroups] label = "path"`): the kernel counts each IO in
    /// its (cgroup, device, op) series.
    TracerdRunCgroups,
    /// The agent without its Q and G hooks (`skip_hooks`): the A/B of the account of what
    /// tracerd costs above biolatency, which has neither.
    TracerdRunNoQg,
    TracerdSnoop,
    TracerdReport,
    Biolatency,
    Bpftrace,
    /// No tracer again, closing each fixed-rate round: every traced run of the round sits
    /// between two untraced ones, and how far those two land apart is the round's A/A noise.
    NoneAgain,
}

impl Variant {
    fn is_untraced(self) -> bool {
        matches!(self, Variant::None | Variant::NoneAgain)
    }

    fn name(self) -> &'static str {
        match self {
            Variant::None => "no tracer",
            Variant::TracerdRun => "tracerd run",
            Variant::TracerdRunRecords => "run (records)",
            Variant::TracerdRunCgroups => "run (cgroups)",
            Variant::TracerdRunNoQg => "run (no Q, G)",
            Variant::TracerdSnoop => "tracerd snoop",
            Variant::TracerdReport => "tracerd report",
            Variant::Biolatency => "biolatency",
            Variant::Bpftrace => "bpftrace",
            Variant::NoneAgain => "no tracer again",
        }
    }
}

const ALL: [Variant; 8] = [
    Variant::None,
    Variant::TracerdRun,
    Variant::TracerdRunRecords,
    Variant::TracerdRunCgroups,
    Variant::TracerdSnoop,
    Variant::TracerdReport,
    Variant::Biolatency,
    Variant::Bpftrace,
];

/// Every variant, in the order the IOPS table lists those a row ran.
const SHOWN: [Variant; 10] = [
    Variant::None,
    Variant::TracerdRun,
    Variant::TracerdRunRecords,
    Variant::TracerdRunCgroups,
    Variant::TracerdRunNoQg,
    Variant::TracerdSnoop,
    Variant::TracerdReport,
    Variant::Biolatency,
    Variant::Bpftrace,
    Variant::NoneAgain,
];

#[derive(Clone, Debug)]
struct Workload {
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
    fn new(name: &str, iodepth: u32, jobs: u32) -> Workload {
        Workload { name: name.into(), iodepth, jobs, rate_iops: None, filename: None }
    }
}

/// Rounds of the fixed-rate runs, whatever `--rounds` says below it: their CPU per IO is what
/// the cost targets judge, and fewer rounds give no spread to judge them by.
const FIXED_RATE_ROUNDS: usize = 5;

/// Disks of the many-disks workload: past the 32 series a small host starts with, as a storage
/// server with dozens of busy drives is.
const MANY_DISKS: usize = 48;

/// One fio run under one variant.
#[derive(Clone, Debug, Default)]
struct Sample {
    iops: f64,
    ios: u64,
    cpu_ns_per_io: f64,
    bpf_ns_per_io: Option<f64>,
    bpf_programs: usize,
    /// With stats on: each program's (BPF ns, runs) per IO, by name: where the BPF time goes.
    bpf_by_program: BTreeMap<String, (f64, f64)>,
    tracer_cpu_ns_per_io: Option<f64>,
    tracer_rss_kib: Option<u64>,
    lost: Option<u64>,
    /// `tracerd run`'s non-zero lost-event counters by reason.
    lost_reasons: BTreeMap<String, u64>,
}

pub struct Options {
    pub seconds: u64,
    pub rounds: usize,
    pub soak_seconds: u64,
    pub soak_only: bool,
    /// Only what the cost targets judge: the untraced saturation rate, the fixed-rate rows,
    /// the many-disks row and the BPF run time of `tracerd run` and biolatency.
    pub fixed_rate_only: bool,
}

/// Undoes what the benchmark changed on the machine, also on error.
struct Cleanup {
    loop_dev: Option<String>,
    backing: PathBuf,
    /// The many-disks workload's loop devices and their backing files.
    many: Vec<(String, PathBuf)>,
    bpf_stats_before: Option<String>,
    unmount_tracefs: bool,
}

impl Drop for Cleanup {
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

pub(crate) fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Busy CPU time of the whole machine, in clock ticks: user, nice, system, irq and softirq.
/// Steal is left out: it is time the hypervisor gave another guest, which varies with the
/// neighbours' load and is no work of this machine's.
fn machine_busy_ticks() -> u64 {
    let stat = fs::read_to_string("/proc/stat").unwrap_or_default();
    let cpu = stat.lines().next().unwrap_or_default();
    // user nice system idle iowait irq softirq steal
    let f: Vec<u64> = cpu.split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
    [0, 1, 2, 5, 6].iter().filter_map(|&i| f.get(i)).sum()
}

/// utime + stime of a process, in clock ticks.
fn process_ticks(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix(field)).and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// (id, name, run_time_ns, run_cnt) of every loaded BPF program.
fn bpf_programs() -> Result<Vec<(u64, String, u64, u64)>> {
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
fn bpf_runtimes(ids: &[u64]) -> Result<Vec<(String, u64, u64)>> {
    Ok(bpf_programs()?.into_iter().filter(|p| ids.contains(&p.0)).map(|p| (p.1, p.2, p.3)).collect())
}

/// Each program's (run time, runs) per IO between two readings, by program name.
fn per_program(
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

/// A running tracer: its process and the BPF programs it loaded.
struct Tracer {
    child: Option<Child>,
    programs: Vec<u64>,
    metrics: Option<String>,
    stderr: PathBuf,
}

fn wait_for(path: &Path, needle: &str, child: &mut Child) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if fs::read_to_string(path).unwrap_or_default().contains(needle) {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!("tracer exited ({status}): {}", fs::read_to_string(path).unwrap_or_default());
        }
        sleep(Duration::from_millis(50));
    }
    bail!("tracer never printed '{needle}'")
}

/// Waits until new BPF programs appear and their number holds for half a second.
fn wait_for_programs(before: &[u64], child: &mut Child) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = (0, Instant::now());
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait()? {
            bail!("tracer exited ({status}) before loading its programs");
        }
        let n = bpf_programs()?.iter().filter(|p| !before.contains(&p.0)).count();
        if n != last.0 {
            last = (n, Instant::now());
        } else if n > 0 && last.1.elapsed() > Duration::from_millis(500) {
            return Ok(());
        }
        sleep(Duration::from_millis(100));
    }
    bail!("tracer loaded no BPF program within 30 s")
}

impl Tracer {
    fn start(variant: Variant, port: u16) -> Result<Tracer> {
        let before: Vec<u64> = bpf_programs()?.iter().map(|p| p.0).collect();
        let dir = root_dir().join("target/bench");
        let (out, err) = (dir.join("tracer.out"), dir.join("tracer.err"));
        let file = |p: &Path| fs::File::create(p).map(Stdio::from);
        let (mut child, ready_file, ready) = match variant {
            Variant::None | Variant::NoneAgain => {
                return Ok(Tracer { child: None, programs: vec![], metrics: None, stderr: err });
            }
            Variant::TracerdRun
            | Variant::TracerdRunRecords
            | Variant::TracerdRunCgroups
            | Variant::TracerdRunNoQg => (
                Command::new(tracerd_bin())
                    .args(["run", "--listen", &format!("127.0.0.1:{port}")])
                    // The agent as deployed, with its store, in the bench's own directory (each
                    // round starts it afresh).
                    .args(["--store".to_owned(), {
                        let store = dir.join("store");
                        let _ = fs::remove_dir_all(&store);
                        store.display().to_string()
                    }])
                    .args(match variant {
                        Variant::TracerdRunRecords => vec!["--aggregation".into(), "records".into()],
                        Variant::TracerdRunCgroups => {
                            let config = dir.join("cgroups.toml");
                            fs::write(&config, "[cgroups]\nlabel = \"path\"\n")?;
                            vec!["--config".to_owned(), config.display().to_string()]
                        }
                        Variant::TracerdRunNoQg => {
                            let config = dir.join("no-q-g.toml");
                            fs::write(&config, "skip_hooks = [\"block_bio_queue\", \"block_getrq\"]\n")?;
                            vec!["--config".to_owned(), config.display().to_string()]
                        }
                        _ => vec![],
                    })
                    .stdout(file(&out)?)
                    .stderr(file(&err)?)
                    .spawn()?,
                &err,
                "metrics on",
            ),
            Variant::TracerdSnoop => (
                Command::new(tracerd_bin()).arg("snoop").stdout(Stdio::null()).stderr(file(&err)?).spawn()?,
                &err,
                "hooks; tracing",
            ),
            // Ended by SIGINT like the others; the report it prints then is not read.
            Variant::TracerdReport => (
                Command::new(tracerd_bin())
                    .args(["report", "--duration", "86400"])
                    .stdout(file(&out)?)
                    .stderr(file(&err)?)
                    .spawn()?,
                &err,
                "hooks; tracing",
            ),
            Variant::Biolatency => (
                Command::new("biolatency").arg("3600").stdout(file(&out)?).stderr(file(&err)?).spawn()?,
                &out,
                "",
            ),
            Variant::Bpftrace => (
                Command::new("bpftrace")
                    .args(["-e", BPFTRACE_SCRIPT])
                    .stdout(file(&out)?)
                    .stderr(file(&err)?)
                    .spawn()?,
                &out,
                "",
            ),
        };
        let waited = if ready.is_empty() {
            // Their stdout is block-buffered into a file: ready once their programs are loaded.
            wait_for_programs(&before, &mut child)
        } else {
            wait_for(ready_file, ready, &mut child)
        };
        if let Err(e) = waited {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        sleep(Duration::from_millis(500));
        let programs = bpf_programs()?.iter().map(|p| p.0).filter(|id| !before.contains(id)).collect();
        let metrics = matches!(
            variant,
            Variant::TracerdRun
                | Variant::TracerdRunRecords
                | Variant::TracerdRunCgroups
                | Variant::TracerdRunNoQg
        )
        .then(|| format!("127.0.0.1:{port}"));
        Ok(Tracer { child: Some(child), programs, metrics, stderr: err })
    }

    /// Non-zero lost-event counters by reason, from /metrics (`tracerd run` only).
    fn lost_reasons(&self) -> BTreeMap<String, u64> {
        let Some(addr) = self.metrics.as_ref() else { return BTreeMap::new() };
        let body =
            output(Command::new("curl").args(["-s", &format!("http://{addr}/metrics")])).unwrap_or_default();
        body.lines()
            .filter_map(|l| l.strip_prefix("tracerd_events_lost_total{reason=\""))
            .filter_map(|l| l.split_once("\"} "))
            .filter_map(|(r, v)| Some((r.to_owned(), v.parse::<f64>().ok()? as u64)))
            .filter(|(_, v)| *v != 0)
            .collect()
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn stop(&mut self) -> Result<Option<u64>> {
        let Some(mut child) = self.child.take() else { return Ok(None) };
        // SIGINT: every tracer prints/cleans up on it. bpftrace once missed one (a bench run
        // waited on it for minutes): it is sent again every 5 s, and after 30 s the tracer is
        // killed and the run fails.
        let mut status = None;
        for _ in 0..6 {
            let _ = Command::new("kill").args(["-INT", &child.id().to_string()]).status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while status.is_none() && Instant::now() < deadline {
                status = child.try_wait()?;
                sleep(Duration::from_millis(50));
            }
            if status.is_some() {
                break;
            }
        }
        let Some(status) = status else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the tracer did not exit within 30 s of SIGINT (sent every 5 s)");
        };
        if !status.success() && status.code() != Some(130) {
            bail!("tracer exited with {status}: {}", fs::read_to_string(&self.stderr).unwrap_or_default());
        }
        // tracerd snoop warns "lost events: [...]" on exit when any were lost.
        let err = fs::read_to_string(&self.stderr).unwrap_or_default();
        Ok(err.lines().find(|l| l.contains("lost events")).map(|_| 1))
    }
}

impl Drop for Tracer {
    /// A tracer left behind by an error must not keep costing the next measurements.
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn clock_ticks_per_second() -> f64 {
    output(Command::new("getconf").arg("CLK_TCK")).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(100.0)
}

fn fio(dev: &str, w: &Workload, seconds: u64) -> Result<(f64, u64)> {
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

/// Whether a run charges BPF run time (kernel.bpf_stats_enabled).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stats {
    Off,
    On,
}

fn set_bpf_stats(stats: Stats) -> Result<()> {
    let v = if stats == Stats::On { "1" } else { "0" };
    fs::write("/proc/sys/kernel/bpf_stats_enabled", v).context("set kernel.bpf_stats_enabled")
}

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
    let is_tracerd = !variant.is_untraced() && !matches!(variant, Variant::Biolatency | Variant::Bpftrace);
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

type Results = BTreeMap<(String, Variant), Vec<Sample>>;

/// Runs every workload under every variant, interleaved, `rounds` times; each key's samples
/// are in round order.
fn run_interleaved(
    results: &mut Results,
    workloads: &[Workload],
    variants: &[Variant],
    dev: &str,
    (opts, rounds): (&Options, usize),
    tck: f64,
    stats: Stats,
) -> Result<()> {
    set_bpf_stats(stats)?;
    let phase = if stats == Stats::On { "BPF run time, stats on" } else { "IOPS, stats off" };
    for round in 1..=rounds {
        for w in workloads {
            for &v in variants {
                eprintln!("xtask: bench: {phase}: round {round}/{rounds}: {} with {}", w.name, v.name());
                let s = measure(v, w, dev, opts.seconds, tck, stats)
                    .with_context(|| format!("{} with {}", w.name, v.name()))?;
                results.entry((w.name.clone(), v)).or_default().push(s);
            }
        }
    }
    Ok(())
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

fn metric(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// `tracerd run` at saturation for `seconds`, scraped every second (as Prometheus would):
/// RSS, open fds, in-flight table occupancy, records and lost events over time.
fn soak(dev: &str, seconds: u64) -> Result<(Vec<SoakSample>, BTreeMap<String, u64>)> {
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
    Ok((samples, reasons))
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

fn records_benchmark() -> Result<String> {
    let out = output(
        Command::new("cargo")
            .current_dir(root_dir())
            .args(["bench", "--quiet", "-p", "tracerd", "--bench", "records"]),
    )?;
    Ok(out
        .lines()
        .find(|l| l.starts_with("decode+aggregate"))
        .unwrap_or("decode+aggregate: no result")
        .to_owned())
}

/// The flight recorder's memory for 8 busy devices over its whole window, and a window's cost.
fn recorder_benchmark() -> Result<String> {
    let out = output(
        Command::new("cargo")
            .current_dir(root_dir())
            .args(["bench", "--quiet", "-p", "tracerd", "--bench", "recorder"]),
    )?;
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("recorder")).collect();
    Ok(if lines.is_empty() { "recorder: no result".into() } else { lines.join("\n") })
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
    let dir = root_dir().join("target/bench");
    fs::create_dir_all(&dir)?;
    let mut cleanup = Cleanup {
        loop_dev: None,
        backing: PathBuf::from(format!("/dev/shm/tracerd-bench-{}.img", std::process::id())),
        many: Vec::new(),
        bpf_stats_before: fs::read_to_string("/proc/sys/kernel/bpf_stats_enabled").ok(),
        unmount_tracefs: false,
    };
    // bpftrace's tracepoints need tracefs; tp_btf (tracerd, biolatency) does not.
    if !Path::new("/sys/kernel/tracing/events").exists() {
        run(Command::new("mount").args(["-t", "tracefs", "nodev", "/sys/kernel/tracing"]), "mount tracefs")?;
        cleanup.unmount_tracefs = true;
    }
    fs::File::create(&cleanup.backing)?.set_len(1 << 30)?;
    let dev =
        output(Command::new("losetup").args(["--find", "--show"]).arg(&cleanup.backing))?.trim().to_owned();
    cleanup.loop_dev = Some(dev.clone());
    let tck = clock_ticks_per_second();

    let mut results = Results::new();
    let mut costs = Results::new();
    if !opts.soak_only {
        let qd32 = Workload::new(SATURATION, 32, 1);
        let two = Workload::new(TWO_SUBMITTERS, 16, 2);
        let qd1 = Workload::new(QD1, 1, 1);
        let saturating = [qd32.clone(), two, qd1];
        if opts.fixed_rate_only {
            // The rates are fractions of the untraced saturation rate: that alone is needed.
            run_interleaved(
                &mut results,
                &saturating[..1],
                &ALL[..1],
                &dev,
                (&opts, opts.rounds),
                tck,
                Stats::Off,
            )?;
        } else {
            run_interleaved(&mut results, &saturating, &ALL, &dev, (&opts, opts.rounds), tck, Stats::Off)?;
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
        let rated_rounds = opts.rounds.max(FIXED_RATE_ROUNDS);
        run_interleaved(&mut results, &rated, &RATED, &dev, (&opts, rated_rounds), tck, Stats::Off)?;
        // The 50% rate again, spread over many disks: beside the one-disk row, what more disks cost.
        for i in 0..MANY_DISKS {
            let backing = PathBuf::from(format!("/dev/shm/tracerd-bench-{}-{i}.img", std::process::id()));
            fs::File::create(&backing)?.set_len(16 << 20)?;
            let dev =
                output(Command::new("losetup").args(["--find", "--show"]).arg(&backing))?.trim().to_owned();
            cleanup.many.push((dev, backing));
        }
        let many = Workload {
            rate_iops: rated[1].rate_iops,
            filename: Some(cleanup.many.iter().map(|(d, _)| d.as_str()).collect::<Vec<_>>().join(":")),
            ..Workload::new(&format!("{MANY_DISKS} disks, 50% rate"), 32, 1)
        };
        run_interleaved(
            &mut results,
            std::slice::from_ref(&many),
            &MANY_DISKS_VARIANTS,
            &dev,
            (&opts, rated_rounds),
            tck,
            Stats::Off,
        )?;
        // BPF run time per IO: separate runs with stats on, one round; over the many disks too,
        // where the programs cost more per IO than on one.
        let compared = [Variant::TracerdRun, Variant::Biolatency];
        if opts.fixed_rate_only {
            run_interleaved(&mut costs, &saturating[..1], &compared, &dev, (&opts, 1), tck, Stats::On)?;
        } else {
            run_interleaved(&mut costs, &saturating[..2], &ALL[1..], &dev, (&opts, 1), tck, Stats::On)?;
        }
        run_interleaved(&mut costs, &[many], &compared, &dev, (&opts, 1), tck, Stats::On)?;
    }
    set_bpf_stats(Stats::Off)?;
    if opts.fixed_rate_only {
        let text = summarize(&results, &costs, None);
        print!("{text}");
        let page = dir.join("fixed-rate.md");
        fs::write(&page, results_page(&text, &opts, &measured)?)?;
        fs::write(dir.join("bench.json"), to_json(&results, &costs, &[], 0, ""))?;
        eprintln!(
            "xtask: bench: the fixed-rate rows alone, in {}; {RESULTS_PAGE} keeps the last full run",
            page.display()
        );
        return Ok(());
    }
    eprintln!("xtask: bench: soak: tracerd run at saturation for {} s", opts.soak_seconds);
    let (samples, soak_reasons) = soak(&dev, opts.soak_seconds)?;
    if !soak_reasons.is_empty() {
        eprintln!("xtask: bench: soak lost events by reason: {}", reasons_text(&soak_reasons));
    }
    let rss: Vec<u64> = samples.iter().map(|s| s.rss_kib).filter(|&k| k > 0).collect();
    let soak_lost = samples.last().map_or(0, |s| s.lost);
    let records = records_benchmark()?;
    let recorder = recorder_benchmark()?;

    let soak = Soak { seconds: opts.soak_seconds, rss: &rss, lost: soak_lost, reasons: &soak_reasons };
    let mut text = summarize(&results, &costs, Some((&soak, &records, &recorder)));
    let fds: Vec<u64> = samples.iter().map(|s| s.open_fds).filter(|&n| n > 0).collect();
    let _ = write!(
        text,
        "\nsoak over time (scraped every second; lost events by reason: {}):\n{}open fds: first {}, last {}, max {}\n",
        reasons_text(&soak_reasons),
        soak_table(&samples),
        fds.first().unwrap_or(&0),
        fds.last().unwrap_or(&0),
        fds.iter().max().unwrap_or(&0)
    );
    print!("{text}");
    fs::write(dir.join("bench.txt"), &text)?;
    if opts.soak_only {
        eprintln!("xtask: bench: a soak alone; {RESULTS_PAGE} keeps the last full run");
    } else {
        fs::write(root_dir().join(RESULTS_PAGE), results_page(&text, &opts, &measured)?)?;
        eprintln!("xtask: bench: wrote {RESULTS_PAGE}: commit it with the code it measured");
    }
    fs::write(dir.join("bench.json"), to_json(&results, &costs, &rss, soak_lost, &records))?;
    eprintln!("xtask: bench: raw figures in {}", dir.join("bench.json").display());
    Ok(())
}

/// The latest full run, as the docs show it (docs/internals/overhead.md says how to read it).
const RESULTS_PAGE: &str = "docs/internals/overhead-results.md";

/// The commit the benchmark builds, marked where the tree has changes other than documents.
pub(crate) fn provenance() -> Result<String> {
    let git = |args: &[&str]| output(Command::new("git").current_dir(root_dir()).args(args));
    let mut commit = git(&["rev-parse", "--short=12", "HEAD"])?.trim().to_owned();
    let changed = git(&["status", "--porcelain", "--untracked-files=no"])?;
    if changed.lines().any(|l| !l.ends_with(".md")) {
        commit.push_str(" with uncommitted changes");
    }
    Ok(commit)
}

/// The results page: the run's tables under the date, the commit and the machine they belong to.
fn results_page(text: &str, opts: &Options, commit: &str) -> Result<String> {
    let date = output(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]))?.trim().to_owned();
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
        opts.seconds,
        opts.rounds,
        opts.rounds.max(FIXED_RATE_ROUNDS),
        opts.soak_seconds,
        text.trim()
    ))
}

/// The variants of the fixed-rate rows: those the cost targets judge, between two untraced
/// runs of the same round.
const RATED: [Variant; 8] = [
    Variant::None,
    Variant::TracerdRun,
    Variant::TracerdRunCgroups,
    Variant::TracerdRunNoQg,
    Variant::TracerdSnoop,
    Variant::TracerdReport,
    Variant::Biolatency,
    Variant::NoneAgain,
];

/// The variants of the many-disks row; the agent without Q and G shows how much of its extra
/// over many disks those two hooks are, and how much the issue and complete programs.
const MANY_DISKS_VARIANTS: [Variant; 5] =
    [Variant::None, Variant::TracerdRun, Variant::TracerdRunNoQg, Variant::Biolatency, Variant::NoneAgain];

const SATURATION: &str = "qd32 saturation";
const TWO_SUBMITTERS: &str = "2 jobs x qd16";
const QD1: &str = "qd1";

/// What the soak found, for the summary.
struct Soak<'a> {
    seconds: u64,
    rss: &'a [u64],
    lost: u64,
    reasons: &'a BTreeMap<String, u64>,
}

fn reasons_text(reasons: &BTreeMap<String, u64>) -> String {
    if reasons.is_empty() {
        return "none".into();
    }
    reasons.iter().map(|(r, n)| format!("{r} {n}")).collect::<Vec<_>>().join(", ")
}

/// IOPS loss against the no-tracer run of the same round, per round (samples are in round
/// order, so round r of every variant ran side by side).
fn losses(results: &Results, w: &str, v: Variant) -> Vec<f64> {
    let (Some(base), Some(traced)) = (results.get(&(w.into(), Variant::None)), results.get(&(w.into(), v)))
    else {
        return Vec::new();
    };
    base.iter().zip(traced).map(|(b, t)| 1.0 - t.iops / b.iops).collect()
}

/// The untraced runs' round-to-round spread, (max - min) / median of their IOPS: how far
/// apart two runs of the same thing land, the noise any loss is read against.
fn noise(results: &Results, w: &str) -> f64 {
    let iops: Vec<f64> =
        results.get(&(w.into(), Variant::None)).map_or(Vec::new(), |v| v.iter().map(|s| s.iops).collect());
    let (lo, hi) = iops.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    if iops.is_empty() { f64::NAN } else { (hi - lo) / median(iops) }
}

/// The whole machine's CPU per IO of `v` in each round, in round order.
fn cpu_per_io(results: &Results, w: &str, v: Variant) -> Vec<f64> {
    results.get(&(w.into(), v)).map_or(Vec::new(), |s| s.iter().map(|s| s.cpu_ns_per_io).collect())
}

/// Per round: `v`'s CPU per IO minus that of the same round's untraced runs (the mean of the
/// one that opens the round and the one that closes it). Pairing within the round takes out
/// what a shared machine drifts by between rounds, which is larger than the costs measured.
fn paired_extra(results: &Results, w: &str, v: Variant) -> Vec<f64> {
    let (base, again) = (cpu_per_io(results, w, Variant::None), cpu_per_io(results, w, Variant::NoneAgain));
    let cpu = cpu_per_io(results, w, v);
    cpu.iter()
        .enumerate()
        .filter_map(|(r, c)| {
            let b = *base.get(r)?;
            Some(c - again.get(r).map_or(b, |a| (a + b) / 2.0))
        })
        .collect()
}

/// Per round: `a`'s paired extra minus `k` times `b`'s, the difference a cost target judges.
fn paired_diff(results: &Results, w: &str, (a, b): (Variant, Variant), k: f64) -> Vec<f64> {
    let (ea, eb) = (paired_extra(results, w, a), paired_extra(results, w, b));
    ea.iter().zip(&eb).map(|(x, y)| x - k * y).collect()
}

/// A row's A/A noise: the median over rounds of |no tracer again - no tracer|, how far apart
/// two identical untraced runs of one round land. Two variants that cost the same differ,
/// round by round, by that much.
fn aa_noise(results: &Results, w: &str) -> f64 {
    let (base, again) = (cpu_per_io(results, w, Variant::None), cpu_per_io(results, w, Variant::NoneAgain));
    median(base.iter().zip(&again).map(|(a, b)| (b - a).abs()).collect())
}

/// Median and min..max of per-round figures, in ns.
fn ns_range(v: &[f64]) -> String {
    let (lo, hi) = v.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    format!("{:+.0}ns ({lo:+.0}..{hi:+.0})", median(v.to_vec()))
}

fn fmt_ns(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.0}ns"))
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

/// The tables and the targets; `rest` (the soak, the records and recorder benchmarks) is absent
/// from a fixed-rate-only run.
fn summarize(results: &Results, costs: &Results, rest: Option<(&Soak, &str, &str)>) -> String {
    let mut out = String::new();
    let med = |v: &[Sample], f: fn(&Sample) -> Option<f64>| {
        let vals: Vec<f64> = v.iter().filter_map(f).collect();
        (!vals.is_empty()).then(|| median(vals))
    };
    let pct = |v: f64| format!("{:.1}%", v * 100.0);
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
    let mut verdicts: Vec<(String, bool)> = Vec::new();
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
            verdicts.extend(fixed_rate_lines(&mut out, results, costs, w));
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
    if !costs.is_empty() {
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
    if let Some((soak, records, recorder)) = rest {
        let rss = soak.rss;
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
            reasons_text(soak.reasons),
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
    let _ = writeln!(out, "\ntargets:");
    for (what, ok) in verdicts {
        let _ = writeln!(out, "  {:<62} {}", what, if ok { "met" } else { "NOT met" });
    }
    out
}

fn to_json(results: &Results, costs: &Results, rss: &[u64], soak_lost: u64, records: &str) -> String {
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
