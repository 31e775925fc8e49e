//! tracerd: an eBPF block-layer latency tracer. See README.md.

use anyhow::Result;
use clap::Parser;

use tracerd::{
    cli::{By, Cli, ColorWhen, Command, TraceArgs},
    commands::diff,
    commands::doctor,
    commands::generate,
    commands::report,
    commands::run,
    commands::snoop,
    commands::top,
    config::{Config, Flags},
    kernel::tracer::{Aggregation, LoadOptions},
    model::aggregate,
    model::selection::Selection,
    source, view,
    view::style::Style,
};

fn main() {
    let cli = Cli::parse();
    // doctor reports every finding itself; its load test's attach logs would repeat them.
    let default_level = if matches!(cli.command, Command::Doctor { .. }) { "error" } else { "info" };
    let level = cli.log_level.as_deref().unwrap_or(default_level);
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // The log follows the same colour rule as the output (--color, NO_COLOR, TERM).
        .with_ansi(Style::detect(cli.color, std::io::IsTerminal::is_terminal(&std::io::stderr())).is_on())
        .init();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    if let Err(e) = runtime.block_on(dispatch(cli.command, cli.color)) {
        eprintln!("tracerd: error: {e:#}");
        std::process::exit(1);
    }
}

/// The settings of a tracing subcommand: flags (the subcommand's own in `own`) over the
/// config file over the defaults.
fn settings(trace: TraceArgs, own: Flags) -> Result<(Config, Selection, LoadOptions)> {
    let flags = Flags {
        ring_buffer_bytes: trace.ring_buffer_bytes,
        attach: trace.attach,
        no_kprobes: trace.no_kprobes,
        causes: trace.causes,
        devices: trace.devices,
        exclude: trace.exclude,
        socket: trace.socket,
        ..own
    };
    let config = Config::load(trace.config.as_deref(), flags)?;
    aggregate::set_histogram_range(config.histogram);
    let selection = Selection { names: config.include.clone(), exclude: config.exclude.clone() };
    let opts = load_options(&config);
    Ok((config, selection, opts))
}

/// What the config asks of the kernel side, for any command that loads programs.
fn load_options(config: &Config) -> LoadOptions {
    LoadOptions {
        ring_buffer_bytes: config.ring_buffer_bytes,
        // The kernel skips its device filter only when every device is traced.
        all_devices: config.include.is_empty() && config.exclude.is_empty(),
        attach: config.attach,
        no_kprobes: !config.kprobes,
        rq_qos: config.rq_qos,
        causes: config.causes,
        skip_hooks: config.skip_hooks.clone(),
        ..Default::default()
    }
}

/// The running agent's API socket, as a view finds it: the flag, else the config's
/// `api.socket`, else the default.
fn agent_socket(
    socket: Option<std::path::PathBuf>,
    config: Option<&std::path::Path>,
) -> Result<std::path::PathBuf> {
    Ok(Config::load(config, Flags { socket, ..Flags::default() })?.socket)
}

async fn dispatch(command: Command, color: ColorWhen) -> Result<()> {
    // Text output is coloured only by the rule in `style` (for stdout).
    let style = Style::stdout(color);
    match command {
        Command::Run { listen, aggregation, store, no_store, trace } => {
            let (config, selection, mut opts) =
                settings(trace, Flags { listen, store, no_store, ..Flags::default() })?;
            opts.aggregation = aggregation;
            run::run(&config, selection, opts).await
        }
        Command::Report {
            duration,
            since,
            from,
            to,
            interval,
            count,
            standalone,
            store,
            json,
            by,
            hist,
            save,
            trace,
        } => {
            let (config, selection, opts) = settings(trace, Flags::default())?;
            let interval = interval.map(|secs| view::report::Interval { secs, count });
            // Named as the agent's metrics name them, by path where they carry no cgroup label.
            let by_cgroup = (by == Some(By::Cgroup)).then_some(match config.cgroups.label {
                tracerd::model::cgroups::LabelForm::None => tracerd::model::cgroups::LabelForm::Path,
                form => form,
            });
            let view =
                view::report::View { json, by_qd: by == Some(By::Qd), by_cgroup, hist, style, interval };
            let source = source::Source::from_args(since, from.as_deref(), to.as_deref(), standalone)?;
            let attach = source::Attach { source, socket: config.socket, store };
            report::report(duration, view, save.as_deref(), selection, opts, attach).await
        }
        Command::Snoop { json, duration, min_latency, pid, comm, standalone, trace } => {
            let (config, selection, opts) = settings(trace, Flags::default())?;
            let filter =
                tracerd::serve::api::StreamFilter { devices: vec![], min_latency_ns: min_latency, pid, comm };
            let attach = (!standalone).then_some(config.socket.as_path());
            snoop::snoop(json, duration, style, selection, opts, filter, attach).await
        }
        Command::Top { standalone, trace } => {
            let (config, selection, opts) = settings(trace, Flags::default())?;
            let attach = (!standalone).then_some(config.socket.as_path());
            top::top(style.is_on(), selection, opts, attach).await
        }
        Command::Diff { a, b, since, ago, socket, config, json } => {
            let now = tracerd::model::capture::unix_now();
            let (a, b) = match (a, b, since, ago) {
                (_, _, Some(span), Some(ago)) => (
                    diff::Source::Window { from_unix_s: now - ago - span, to_unix_s: now - ago },
                    diff::Source::Window { from_unix_s: now - span, to_unix_s: now },
                ),
                (Some(a), Some(b), _, _) => (diff::Source::parse(&a, now)?, diff::Source::parse(&b, now)?),
                _ => anyhow::bail!("diff takes two captures (A B), or --since SPAN --ago SPAN"),
            };
            diff::diff(&a, &b, &agent_socket(socket, config.as_deref())?, json, style)
        }
        Command::Completions { shell } => generate::completions(shell, &mut std::io::stdout().lock()),
        Command::Manpages { dir } => {
            for file in generate::manpages(&dir)? {
                println!("{}", dir.join(file).display());
            }
            Ok(())
        }
        Command::Doctor { json, no_load, socket, config } => {
            let config = Config::load(config.as_deref(), Flags { socket, ..Flags::default() })?;
            // The load test loads what `tracerd run` would with this config: the most code the
            // verifier has to accept.
            let mut opts = load_options(&config);
            opts.aggregation = Aggregation::Kernel;
            opts.cgroups = config.cgroups.enabled();
            // A FAIL is a finding, already printed: exit 1 without an error line.
            if !doctor::doctor(json, (!no_load).then_some(&opts), &config.socket, style)? {
                std::process::exit(1);
            }
            Ok(())
        }
    }
}
