//! tracerd: an eBPF block-layer latency tracer. See README.md.

use anyhow::Result;
use clap::Parser;

use tracerd::{
    cli::{By, Cli, Command, TraceArgs},
    diff, report, run,
    selection::Selection,
    snoop,
    tracer::LoadOptions,
};

fn main() {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cli.log_level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    if let Err(e) = runtime.block_on(dispatch(cli.command)) {
        eprintln!("tracerd: error: {e:#}");
        std::process::exit(1);
    }
}

fn split(trace: TraceArgs) -> (Selection, LoadOptions) {
    let all_devices = trace.devices.is_empty();
    (
        Selection { names: trace.devices },
        LoadOptions { ring_buffer_bytes: trace.ring_buffer_bytes, all_devices },
    )
}

async fn dispatch(command: Command) -> Result<()> {
    match command {
        Command::Run { listen, trace } => {
            let (selection, opts) = split(trace);
            run::run(listen, selection, opts).await
        }
        Command::Report { duration, json, by, save, trace } => {
            let (selection, opts) = split(trace);
            report::report(duration, json, by == Some(By::Qd), save.as_deref(), selection, opts).await
        }
        Command::Snoop { json, duration, trace } => {
            let (selection, opts) = split(trace);
            snoop::snoop(json, duration, selection, opts).await
        }
        Command::Diff { a, b, json } => diff::diff(&a, &b, json),
    }
}
