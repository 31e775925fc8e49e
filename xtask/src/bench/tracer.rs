//! The tracer under test as a process: started and waited for until it is ready, asked for
//! its lost events, and stopped the way each tracer expects, or killed when left behind.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::{Child, Command},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};

use super::{
    machine::{out_dir, output},
    probes::bpf_programs,
    variants::{Ready, Variant},
};

/// A running tracer: its process and the BPF programs it loaded.
pub(super) struct Tracer {
    child: Option<Child>,
    pub(super) programs: Vec<u64>,
    pub(super) metrics: Option<String>,
    stderr: PathBuf,
}

/// Waits until the tracer prints `needle` into `path`.
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
    pub(super) fn start(variant: Variant, port: u16) -> Result<Tracer> {
        let before: Vec<u64> = bpf_programs()?.iter().map(|p| p.0).collect();
        let dir = out_dir();
        let (out, err) = (dir.join("tracer.out"), dir.join("tracer.err"));
        let Some((mut child, ready)) = variant.spawn(port, &dir, &out, &err)? else {
            return Ok(Tracer { child: None, programs: vec![], metrics: None, stderr: err });
        };
        let waited = match ready {
            // Their stdout is block-buffered into a file: ready once their programs are loaded.
            Ready::Programs => wait_for_programs(&before, &mut child),
            Ready::Prints(needle) => wait_for(&err, needle, &mut child),
        };
        if let Err(e) = waited {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        sleep(Duration::from_millis(500));
        let programs = bpf_programs()?.iter().map(|p| p.0).filter(|id| !before.contains(id)).collect();
        let metrics = variant.serves_metrics().then(|| format!("127.0.0.1:{port}"));
        Ok(Tracer { child: Some(child), programs, metrics, stderr: err })
    }

    /// Non-zero lost-event counters by reason, from /metrics (`tracerd run` only).
    pub(super) fn lost_reasons(&self) -> BTreeMap<String, u64> {
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

    pub(super) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub(super) fn stop(&mut self) -> Result<Option<u64>> {
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
