//! Command line (clap). Every subcommand's help ends with an example.

use std::{net::SocketAddr, path::PathBuf};

use crate::kernel::tracer::{Aggregation, Attach};
use clap::{Args, Parser, Subcommand, ValueEnum, builder::PossibleValue};

use crate::model::stage::Stage;
pub use crate::view::style::ColorWhen;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:9560";

#[derive(Debug, Parser)]
#[command(
    name = "tracerd",
    version = crate::build_info::VERSION_LINE,
    about = "eBPF block-layer latency tracer: times every IO through Q, G, I, D, C per device",
    long_about = None,
    after_help = "Examples:\n  sudo tracerd run                      # agent: /metrics on 127.0.0.1:9560\n  sudo tracerd report --duration 10     # btt-style tables for every device\n  sudo tracerd report --hist d2c        # ... with a log2 histogram of D2C\n  sudo tracerd snoop --device nvme0n1   # one line per IO\n  tracerd diff before.json after.json   # compare two saved captures\n  sudo tracerd doctor                   # what works on this kernel, and why"
)]
pub struct Cli {
    /// Log level (error, warn, info, debug, trace) [default: info; error for doctor, which
    /// reports everything itself]; RUST_LOG overrides.
    #[arg(long, global = true, value_name = "LEVEL")]
    pub log_level: Option<String>,
    /// Colour in text output: auto colours only a terminal, and not when NO_COLOR is set
    /// (non-empty) or TERM is dumb.
    #[arg(long, global = true, value_enum, default_value_t = ColorWhen::Auto, value_name = "WHEN")]
    pub color: ColorWhen,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args, Clone)]
pub struct TraceArgs {
    /// Trace only this block device; repeatable. A kernel name (loop0, nvme0n1, sda1), a
    /// device-mapper name (vg-lv, /dev/mapper/vg-lv) or any path to the device node
    /// (/dev/md/NAME, /dev/disk/by-id/...). Without it, every block device is traced.
    #[arg(long = "device", short = 'd', value_name = "NAME")]
    pub devices: Vec<String>,
    /// Never trace this device ("*" matches any run of characters: 'loop*'); repeatable.
    #[arg(long = "exclude", value_name = "NAME")]
    pub exclude: Vec<String>,
    /// Kernel ring buffer size in bytes (a power of two, at least one page).
    #[arg(long, value_name = "BYTES", value_parser = parse_ring_size)]
    pub ring_buffer_bytes: Option<u32>,
    /// How the tracepoint hooks attach: `auto` (tp_btf, falling back to raw_tp per hook) or
    /// `raw_tp` (only raw_tp: for a kernel whose tp_btf misbehaves) [default: auto, or the
    /// config's `attach`].
    #[arg(long, value_enum, value_name = "HOW")]
    pub attach: Option<Attach>,
    /// Load no kprobes, only tracepoints (as on a kernel without kprobes): no md/dm submit-path
    /// time, and no links but those the kernel's structs state [default: the config's `kprobes`].
    #[arg(long)]
    pub no_kprobes: bool,
    /// Record why IOs waited: each sleep inside an IO's phase, its kernel stack and its waker
    /// (scheduler hooks; see docs/guide/causes.md) [default: the config's `causes`].
    #[arg(long)]
    pub causes: bool,
    /// Settings file (TOML; every key in tracerd.example.toml). Flags win over it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    /// The agent's API socket: where `run` serves it, where the views look for a running agent
    /// [default: /run/tracerd/tracerd.sock, or the config's api.socket].
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run as an agent: trace until SIGINT/SIGTERM, serve Prometheus metrics.
    #[command(
        after_help = "Examples:\n  sudo tracerd run --listen 127.0.0.1:9560\n  curl -s 127.0.0.1:9560/metrics | grep tracerd_io_stage_seconds_count\n  sudo tracerd run --config /etc/tracerd/tracerd.toml --exclude 'loop*'"
    )]
    Run {
        /// Address for /metrics and /healthz [default: 127.0.0.1:9560, or the config's `listen`].
        #[arg(long, value_name = "ADDR:PORT")]
        listen: Option<SocketAddr>,
        /// Where reads and writes are counted: `kernel` (per CPU in the kernel, folded every
        /// second: no record per IO), `records` (every IO crosses the ring buffer), or `check`
        /// (both, compared series by series on exit; exit status 1 if they differ).
        #[arg(long, value_enum, default_value_t = Aggregation::Kernel)]
        aggregation: Aggregation,
        /// The recorder's store: keep its frames in this directory across restarts [default:
        /// /var/lib/tracerd/recorder, or the config's store.path].
        #[arg(long, value_name = "DIR", conflicts_with = "no_store")]
        store: Option<PathBuf>,
        /// Keep the recorder's history in memory only (it ends with the agent).
        #[arg(long)]
        no_store: bool,
        #[command(flatten)]
        trace: TraceArgs,
    },
    /// Capture for a while, then print per-device, per-operation stage tables.
    #[command(
        after_help = "Examples:\n  sudo tracerd report --duration 10\n  sudo tracerd report --since 10m          # the last 10 minutes, from the running agent\n  sudo tracerd report --from 2026-11-30T14:00:00Z --to 2026-11-30T14:05:00Z\n  sudo tracerd report --interval 1 --count 10   # a table a second, like iostat -x 1\n  sudo tracerd report --device nvme0n1 --by qd\n  sudo tracerd report --duration 10 --by cgroup   # per service or pod\n  sudo tracerd report --device nvme0n1 --hist d2c   # biolatency-style histogram of D2C\n  sudo tracerd report --duration 5 --json > capture.json\n  sudo tracerd report --device nvme0n1 --save before.json   # for tracerd diff"
    )]
    Report {
        /// Capture length in seconds (SIGINT ends it early and still reports).
        #[arg(long, default_value_t = 10.0, value_name = "SECS", value_parser = parse_duration)]
        duration: f64,
        /// Report the past instead: this long up to now, from the running agent's recorder
        /// (30s, 10m, 1h30m).
        #[arg(long, value_name = "SPAN", value_parser = crate::units::parse_span, conflicts_with_all = ["from", "to"])]
        since: Option<f64>,
        /// Report the agent's recorder from this time: RFC 3339 (2026-11-30T15:04:05Z) or a time
        /// ago (10m, 1h ago).
        #[arg(long, value_name = "TIME")]
        from: Option<String>,
        /// ... up to this time (same forms; default: now).
        #[arg(long, value_name = "TIME", requires = "from")]
        to: Option<String>,
        /// A report every SECS seconds until SIGINT or --count: a compact table per interval
        /// (with --json, one line each), as `iostat -x 1` and biolatency's interval mode print.
        #[arg(long, value_name = "SECS", value_parser = parse_duration, conflicts_with_all = ["since", "from", "save", "by", "hist"])]
        interval: Option<f64>,
        /// With --interval: stop after N reports.
        #[arg(long, value_name = "N", requires = "interval", value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
        /// Load tracerd's own programs even when an agent runs (by default, a running agent
        /// is asked instead, so that the kernel runs one copy of them).
        #[arg(long, conflicts_with_all = ["since", "from"])]
        standalone: bool,
        /// Read a recorder store instead of an agent: the directory the agent keeps it in
        /// (store.path), or a copy of it from another host; no root and no agent needed. The
        /// window is --since/--from/--to, or all the store holds.
        #[arg(long, value_name = "DIR", conflicts_with_all = ["standalone", "interval"])]
        store: Option<PathBuf>,
        /// Print JSON (schema: docs/reference/json.md) instead of tables.
        #[arg(long)]
        json: bool,
        /// Split each table by this dimension.
        #[arg(long, value_enum)]
        by: Option<By>,
        /// After each table, a log2 histogram of this stage (in --json: its `log2_buckets`).
        #[arg(long, value_enum, ignore_case = true, value_name = "STAGE")]
        hist: Option<Stage>,
        /// Also save the capture (every histogram, kernel, host, devices, duration) to FILE,
        /// for `tracerd diff`.
        #[arg(long, value_name = "FILE")]
        save: Option<PathBuf>,
        #[command(flatten)]
        trace: TraceArgs,
    },
    /// Print one line per IO as it completes.
    #[command(
        after_help = "Examples:\n  sudo tracerd snoop --device loop0\n  sudo tracerd snoop --min-latency 5ms --comm postgres   # the slow IOs of one program\n  sudo tracerd snoop --json --duration 5 > ios.jsonl"
    )]
    Snoop {
        /// JSON lines instead of columns.
        #[arg(long)]
        json: bool,
        /// Stop after this many seconds (default: until SIGINT).
        #[arg(long, value_name = "SECS", value_parser = parse_duration)]
        duration: Option<f64>,
        /// Only IOs at least this slow end to end (Q2C, else D2C): 5ms, 250us, 1s.
        #[arg(long, value_name = "TIME", value_parser = crate::units::parse_latency)]
        min_latency: Option<u64>,
        /// Only IOs submitted by this process.
        #[arg(long, value_name = "PID")]
        pid: Option<u32>,
        /// Only IOs submitted by tasks of this name (as `comm` shows it, at most 15 characters).
        #[arg(long, value_name = "NAME")]
        comm: Option<String>,
        /// Load tracerd's own programs even when an agent runs (by default, a running agent
        /// streams the IOs, so that the kernel runs one copy of the programs).
        #[arg(long)]
        standalone: bool,
        #[command(flatten)]
        trace: TraceArgs,
    },
    /// A live full-screen view, refreshed every second: a row per device and op with rates,
    /// queue depth and stage percentiles, stacks as trees; keys sort, filter, switch the stage,
    /// pause (h for help, q to quit).
    #[command(
        after_help = "Examples:\n  sudo tracerd top                      # beside a running agent: its frames, nothing loaded\n  sudo tracerd top --device nvme0n1 --standalone"
    )]
    Top {
        /// Load tracerd's own programs even when an agent runs.
        #[arg(long)]
        standalone: bool,
        #[command(flatten)]
        trace: TraceArgs,
    },
    /// Compare two captures saved by `report --save`: per device, op and stage, counts and
    /// p50/p99/p99.9 side by side, with `*` where a change is larger than sampling noise.
    #[command(
        after_help = "Examples:\n  sudo tracerd report --device nvme0n1 --duration 30 --save before.json\n  sudo tracerd report --device nvme0n1 --duration 30 --save after.json\n  tracerd diff before.json after.json\n  tracerd diff before.json after.json --json | jq '.devices[].ops[].stages[]'\n  sudo tracerd diff --since 5m --ago 1h   # the agent's last 5 minutes against the same 5 an hour ago\n  sudo tracerd diff @2026-11-30T14:00:00Z..2026-11-30T14:05:00Z @10m..now"
    )]
    Diff {
        /// The baseline: a capture file, or a window of the running agent as @FROM..TO
        /// (@1h5m..1h, @2026-11-30T14:00:00Z..2026-11-30T14:05:00Z).
        #[arg(value_name = "A", required_unless_present = "since")]
        a: Option<String>,
        /// What to compare with it: a capture file or @FROM..TO.
        #[arg(value_name = "B", required_unless_present = "since")]
        b: Option<String>,
        /// Compare the agent's last SPAN (B) with the same span AGO earlier (A): --since 5m
        /// --ago 1h.
        #[arg(long, value_name = "SPAN", value_parser = crate::units::parse_span, requires = "ago", conflicts_with_all = ["a", "b"])]
        since: Option<f64>,
        /// With --since: how much earlier the baseline is.
        #[arg(long, value_name = "SPAN", value_parser = crate::units::parse_span, requires = "since")]
        ago: Option<f64>,
        /// The agent's API socket, for windows [default: /run/tracerd/tracerd.sock, or the
        /// config's api.socket].
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// The agent's config file, read for its api.socket.
        #[arg(long, value_name = "PATH")]
        config: Option<PathBuf>,
        /// Print JSON (schema: docs/reference/json.md) instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Check this kernel and these privileges: BTF, struct layout, every hook, kprobes, the ring
    /// buffer, and a real load and attach; prints what will and will not work, and why. Needs no
    /// running tracerd, and runs without root too (then says what root would change). Exit
    /// status 1 if a check FAILed, else 0 (also with warnings).
    #[command(
        after_help = "Examples:\n  sudo tracerd doctor                # every check, including a real load and attach\n  tracerd doctor                     # unprivileged: what works, what root would change\n  sudo tracerd doctor --no-load      # only what the kernel describes (no programs loaded)\n  sudo tracerd doctor --json | jq '.[] | select(.status != \"ok\")'"
    )]
    Doctor {
        /// Print a JSON array of checks ({name, status, detail, advice}) instead of lines.
        #[arg(long)]
        json: bool,
        /// Skip the load test (loading and attaching every program, then detaching them).
        #[arg(long)]
        no_load: bool,
        /// Where to look for a running agent [default: /run/tracerd/tracerd.sock, or the
        /// config's api.socket].
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// The agent's config file, read for its api.socket.
        #[arg(long, value_name = "PATH")]
        config: Option<PathBuf>,
    },
    /// Print a shell completion script for bash, zsh or fish (also elvish and powershell).
    #[command(
        after_help = "Examples:\n  tracerd completions bash > /usr/share/bash-completion/completions/tracerd\n  tracerd completions zsh > /usr/local/share/zsh/site-functions/_tracerd\n  tracerd completions fish > ~/.config/fish/completions/tracerd.fish"
    )]
    Completions {
        /// The shell to complete tracerd's subcommands and flags in.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write man pages into DIR: tracerd.1, and tracerd-SUBCOMMAND.1 for each subcommand.
    #[command(after_help = "Example:\n  tracerd manpages /usr/local/share/man/man1 && man tracerd-report")]
    Manpages {
        /// The directory to write them into (created if missing).
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum By {
    /// Queue depth of the device when the request was issued.
    Qd,
    /// The cgroup each IO is charged to (named as config cgroups.label says; path by default).
    Cgroup,
}

/// Stages by the names stage.rs gives them (`d2c`; any case on the command line).
impl ValueEnum for Stage {
    fn value_variants<'a>() -> &'a [Self] {
        &Stage::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.as_str()))
    }
}

fn parse_duration(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("'{s}' is not a positive number of seconds")),
    }
}

fn parse_ring_size(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(v) if v >= 4096 && v.is_power_of_two() => Ok(v),
        _ => Err(format!("'{s}' must be a power of two of at least 4096 bytes")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use std::path::Path;

    #[test]
    fn cli_is_consistent_and_validates() {
        Cli::command().debug_assert();
        assert!(Cli::try_parse_from(["tracerd", "report", "--duration", "0"]).is_err());
        assert!(Cli::try_parse_from(["tracerd", "run", "--ring-buffer-bytes", "5000"]).is_err());
        let cli =
            Cli::try_parse_from(["tracerd", "report", "-d", "loop0", "--device", "loop1", "--by", "qd"])
                .unwrap();
        match cli.command {
            Command::Report { trace, by, .. } => {
                assert_eq!(trace.devices, vec!["loop0", "loop1"]);
                assert_eq!(by, Some(By::Qd));
            }
            _ => panic!("wrong subcommand"),
        }
        let cli = Cli::try_parse_from(["tracerd", "report", "--save", "a.json"]).unwrap();
        assert!(matches!(cli.command, Command::Report { save: Some(p), .. } if p == Path::new("a.json")));
        let cli = Cli::try_parse_from(["tracerd", "diff", "a.json", "b.json", "--json"]).unwrap();
        assert!(matches!(cli.command, Command::Diff { json: true, .. }));
        assert!(Cli::try_parse_from(["tracerd", "diff", "a.json"]).is_err(), "diff takes two captures");
        let cli = Cli::try_parse_from(["tracerd", "doctor", "--json", "--no-load"]).unwrap();
        assert!(matches!(cli.command, Command::Doctor { json: true, no_load: true, .. }));
        assert_eq!(cli.log_level, None, "each subcommand picks its default level");
    }

    #[test]
    fn hist_takes_any_stage_in_any_case_and_color_is_global() {
        for stage in Stage::ALL {
            for name in [stage.as_str().to_owned(), stage.as_str().to_uppercase()] {
                let cli = Cli::try_parse_from(["tracerd", "report", "--hist", &name]).unwrap();
                assert!(matches!(cli.command, Command::Report { hist: Some(s), .. } if s == stage), "{name}");
            }
        }
        let e = Cli::try_parse_from(["tracerd", "report", "--hist", "x2y"]).unwrap_err().to_string();
        assert!(e.contains("x2y") && e.contains("q2g, g2i, i2d, g2d, q2d, d2c, q2c, q2m"), "{e}");
        let cli = Cli::try_parse_from(["tracerd", "report"]).unwrap();
        assert!(matches!(cli.command, Command::Report { hist: None, .. }));
        assert_eq!(cli.color, ColorWhen::Auto);
        // Before or after the subcommand.
        for args in [["tracerd", "--color", "never", "diff"], ["tracerd", "diff", "--color", "never"]] {
            let cli = Cli::try_parse_from(args.into_iter().chain(["a", "b"])).unwrap();
            assert_eq!(cli.color, ColorWhen::Never);
        }
        assert_eq!(
            Cli::try_parse_from(["tracerd", "snoop", "--color", "always"]).unwrap().color,
            ColorWhen::Always
        );
        assert!(Cli::try_parse_from(["tracerd", "report", "--color", "sometimes"]).is_err());
    }

    /// Every subcommand's --help ends with an example, so a new subcommand without one fails here.
    #[test]
    fn every_subcommand_help_ends_with_an_example() {
        let cli = Cli::command();
        let subcommands: Vec<&clap::Command> =
            cli.get_subcommands().filter(|c| c.get_name() != "help").collect();
        assert!(subcommands.len() >= 4, "run, report, snoop, diff at least");
        for sub in subcommands {
            let name = sub.get_name();
            let example = sub.get_after_help().map(|h| h.to_string()).unwrap_or_default();
            assert!(example.contains("tracerd "), "`tracerd {name} --help` has no example (after_help)");
            // Compared word by word: clap wraps long lines to the terminal's width.
            let words = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
            let help = sub.clone().render_long_help().to_string();
            assert!(words(&help).ends_with(&words(&example)), "{name}: the example is not last:\n{help}");
        }
    }
}
