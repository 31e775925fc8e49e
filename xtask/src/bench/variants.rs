//! The tracers the bench compares (tracerd's commands and configurations, the reference tools,
//! no tracer), the rows each runs in, and the command line that starts each.

use std::{
    fs,
    path::Path,
    process::{Child, Command, Stdio},
};

use anyhow::Result;

use crate::tracerd_bin;

/// The bpftrace peer: biolatency's issue-to-complete histogram, as a script.
const BPFTRACE_SCRIPT: &str = "tracepoint:block:block_rq_issue { @start[args->dev, args->sector] = nsecs; }
tracepoint:block:block_rq_complete /@start[args->dev, args->sector]/ {
  @usecs = hist((nsecs - @start[args->dev, args->sector]) / 1000);
  delete(@start[args->dev, args->sector]);
}";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Variant {
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
    /// The agent with the wait hooks (`--causes`): sched_switch, sched_waking, sched_wakeup and
    /// the interrupt entry and exit tracepoints on every context switch, wakeup and interrupt.
    TracerdRunCauses,
    TracerdSnoop,
    TracerdReport,
    Biolatency,
    Bpftrace,
    /// libbpf-tools' offcputime: the peer that hooks sched_switch for off-CPU stacks.
    Offcputime,
    /// No tracer again, closing each fixed-rate round: every traced run of the round sits
    /// between two untraced ones, and how far those two land apart is the round's A/A noise.
    NoneAgain,
}

impl Variant {
    pub(super) fn is_untraced(self) -> bool {
        matches!(self, Variant::None | Variant::NoneAgain)
    }

    /// Whether this is one of tracerd's commands, whose own CPU, RSS and lost events are read.
    pub(super) fn is_tracerd(self) -> bool {
        !self.is_untraced() && !matches!(self, Variant::Biolatency | Variant::Bpftrace | Variant::Offcputime)
    }

    /// Whether this is the agent, which serves /metrics on the port it is started with.
    pub(super) fn serves_metrics(self) -> bool {
        matches!(
            self,
            Variant::TracerdRun
                | Variant::TracerdRunRecords
                | Variant::TracerdRunCgroups
                | Variant::TracerdRunNoQg
                | Variant::TracerdRunCauses
        )
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Variant::None => "no tracer",
            Variant::TracerdRun => "tracerd run",
            Variant::TracerdRunRecords => "run (records)",
            Variant::TracerdRunCgroups => "run (cgroups)",
            Variant::TracerdRunNoQg => "run (no Q, G)",
            Variant::TracerdRunCauses => "run (causes)",
            Variant::TracerdSnoop => "tracerd snoop",
            Variant::TracerdReport => "tracerd report",
            Variant::Biolatency => "biolatency",
            Variant::Bpftrace => "bpftrace",
            Variant::Offcputime => "offcputime",
            Variant::NoneAgain => "no tracer again",
        }
    }
}

/// The variants of the saturated rows, no tracer first.
pub(super) const ALL: [Variant; 8] = [
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
pub(super) const SHOWN: [Variant; 12] = [
    Variant::None,
    Variant::TracerdRun,
    Variant::TracerdRunRecords,
    Variant::TracerdRunCgroups,
    Variant::TracerdRunNoQg,
    Variant::TracerdRunCauses,
    Variant::Offcputime,
    Variant::TracerdSnoop,
    Variant::TracerdReport,
    Variant::Biolatency,
    Variant::Bpftrace,
    Variant::NoneAgain,
];

/// The variants of the fixed-rate rows: those the cost targets judge, between two untraced
/// runs of the same round.
pub(super) const RATED: [Variant; 9] = [
    Variant::None,
    Variant::TracerdRun,
    Variant::TracerdRunCgroups,
    Variant::TracerdRunNoQg,
    Variant::TracerdRunCauses,
    Variant::TracerdSnoop,
    Variant::TracerdReport,
    Variant::Biolatency,
    Variant::NoneAgain,
];

/// The variants of the many-disks row; the agent without Q and G shows how much of its extra
/// over many disks those two hooks are, and how much the issue and complete programs.
pub(super) const MANY_DISKS_VARIANTS: [Variant; 5] =
    [Variant::None, Variant::TracerdRun, Variant::TracerdRunNoQg, Variant::Biolatency, Variant::NoneAgain];

/// The variants of the context-switch row: what the wait hooks cost on a switch that is no IO's,
/// beside the agent without them and the off-CPU peer.
pub(super) const SWITCH_VARIANTS: [Variant; 5] =
    [Variant::None, Variant::TracerdRun, Variant::TracerdRunCauses, Variant::Offcputime, Variant::NoneAgain];

/// How a started tracer shows that it is ready to be measured.
pub(super) enum Ready {
    /// It prints this on stderr.
    Prints(&'static str),
    /// Its programs are loaded.
    Programs,
}

impl Variant {
    /// Starts this variant's tracer, its stdout in `out` and stderr in `err`, its store and
    /// configuration in `dir`, the agent listening on `port`; `None` for no tracer.
    pub(super) fn spawn(
        self,
        port: u16,
        dir: &Path,
        out: &Path,
        err: &Path,
    ) -> Result<Option<(Child, Ready)>> {
        let file = |p: &Path| fs::File::create(p).map(Stdio::from);
        Ok(Some(match self {
            Variant::None | Variant::NoneAgain => return Ok(None),
            Variant::TracerdRun
            | Variant::TracerdRunRecords
            | Variant::TracerdRunCgroups
            | Variant::TracerdRunNoQg
            | Variant::TracerdRunCauses => (
                Command::new(tracerd_bin())
                    .args(["run", "--listen", &format!("127.0.0.1:{port}")])
                    // The agent as deployed, with its store, in the bench's own directory (each
                    // round starts it afresh).
                    .args(["--store".to_owned(), {
                        let store = dir.join("store");
                        let _ = fs::remove_dir_all(&store);
                        store.display().to_string()
                    }])
                    .args(match self {
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
                        Variant::TracerdRunCauses => vec!["--causes".into()],
                        _ => vec![],
                    })
                    .stdout(file(out)?)
                    .stderr(file(err)?)
                    .spawn()?,
                Ready::Prints("metrics on"),
            ),
            Variant::TracerdSnoop => (
                Command::new(tracerd_bin()).arg("snoop").stdout(Stdio::null()).stderr(file(err)?).spawn()?,
                Ready::Prints("hooks; tracing"),
            ),
            // Ended by SIGINT like the others; the report it prints then is not read.
            Variant::TracerdReport => (
                Command::new(tracerd_bin())
                    .args(["report", "--duration", "86400"])
                    .stdout(file(out)?)
                    .stderr(file(err)?)
                    .spawn()?,
                Ready::Prints("hooks; tracing"),
            ),
            Variant::Biolatency => (
                Command::new("biolatency").arg("3600").stdout(file(out)?).stderr(file(err)?).spawn()?,
                Ready::Programs,
            ),
            // As a user runs it: every task, kernel and user stacks.
            Variant::Offcputime => (
                Command::new("offcputime").arg("3600").stdout(file(out)?).stderr(file(err)?).spawn()?,
                Ready::Programs,
            ),
            Variant::Bpftrace => (
                Command::new("bpftrace")
                    .args(["-e", BPFTRACE_SCRIPT])
                    .stdout(file(out)?)
                    .stderr(file(err)?)
                    .spawn()?,
                Ready::Programs,
            ),
        }))
    }
}
