//! `tracerd snoop`: one line per IO (completed request or merged bio), as text or JSON lines.

use std::{collections::BTreeMap, io::Write, path::Path, time::Duration};

use anyhow::Result;

use crate::{
    kernel::cgroupfs::CgroupNames,
    kernel::session::{Io, Session, shutdown_signal},
    kernel::tracer::LoadOptions,
    model::op::OpDecoder,
    model::selection::Selection,
    model::topology::Topology,
    serve::api::{self, StreamFilter},
    view::io_line::{TextLine, TextWriter, cgroup_text, line, write_header},
    view::style::Style,
};

/// Writes snoop lines, remembering the first write error (a closed pipe ends snoop).
struct Printer<W: Write> {
    out: W,
    json: bool,
    style: Style,
    ops: OpDecoder,
    /// Per device and per `cmd_flags`: a few keys each, found by compares, not hashed.
    names: BTreeMap<u32, String>,
    cgroups: CgroupNames,
    /// RWBS text per `cmd_flags` (a handful of distinct values).
    rwbs: BTreeMap<u32, String>,
    /// `--min-latency`, `--pid`, `--comm` (devices are chosen by what is traced).
    filter: StreamFilter,
    text: TextWriter,
    error: Option<std::io::Error>,
}

impl<W: Write> Printer<W> {
    fn emit(&mut self, io: &Io, topo: &Topology) {
        let name: &String = self.names.entry(io.target).or_insert_with(|| topo.name_of(io.target));
        if !self.filter.passes(name, io.rec) {
            return;
        }
        let named = self.cgroups.of(io.rec);
        let cgroup = cgroup_text(&named);
        let r = if self.json {
            let line = line(name, io, &self.ops, topo, cgroup);
            serde_json::to_writer(&mut self.out, &line)
                .map_err(std::io::Error::from)
                .and_then(|_| writeln!(self.out))
        } else {
            // Text is what an engineer watches live at full IO rate: built from the record with
            // no allocation per IO (snoop's own CPU per IO is its cost to the host).
            let ops = &self.ops;
            let rwbs = self.rwbs.entry(io.rec.cmd_flags).or_insert_with(|| ops.rwbs(io.rec.cmd_flags));
            self.text.write(&mut self.out, &TextLine::of(name, rwbs, io, ops, cgroup), self.style)
        };
        if let Err(e) = r {
            self.error.get_or_insert(e);
        }
    }

    fn flush(&mut self) {
        if let Err(e) = self.out.flush() {
            self.error.get_or_insert(e);
        }
    }
}

/// Prints every IO (that passes `filter`) until SIGINT/SIGTERM, `duration`, or a closed
/// stdout. With `attach`, a running agent on that socket streams them, and nothing is loaded.
pub async fn snoop(
    json: bool,
    duration: Option<f64>,
    style: Style,
    selection: Selection,
    opts: LoadOptions,
    filter: StreamFilter,
    attach: Option<&Path>,
) -> Result<()> {
    if let Some(socket) = attach {
        match api::call::<api::Status>(socket, &api::Request::Status {}, "status") {
            Ok(status) => {
                return snoop_from_agent(json, duration, style, &selection, filter, socket, status).await;
            }
            Err(api::AttachError::NoAgent(_)) => {}
            Err(e) => tracing::warn!("{e}; tracing with tracerd's own programs instead"),
        }
    }
    let mut session = Session::start(selection, &opts)?;
    let mut p = Printer {
        out: std::io::BufWriter::new(std::io::stdout().lock()),
        json,
        style,
        ops: session.tracer.ops,
        names: BTreeMap::new(),
        cgroups: CgroupNames::detect(),
        rwbs: BTreeMap::new(),
        filter,
        text: TextWriter::new(session.tracer.causes_on()),
        error: None,
    };
    if !json {
        write_header(&mut p.out, style, p.text.causes)?;
        p.flush();
    }
    let deadline = tokio::time::sleep(Duration::from_secs_f64(duration.unwrap_or(f64::from(u32::MAX))));
    tokio::pin!(deadline);
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while p.error.is_none() {
        tokio::select! {
            r = session.read(|io, topo| p.emit(io, topo)) => r?,
            _ = tick.tick() => session.refresh_devices()?,
            _ = &mut deadline => break,
            _ = &mut shutdown => break,
        }
        p.flush();
    }
    session.drain_now(|io, topo| p.emit(io, topo));
    p.flush();
    let lost = session.lost()?;
    let lost: Vec<_> = lost.reasons().into_iter().filter(|(_, n)| *n > 0).collect();
    if !lost.is_empty() {
        tracing::warn!("lost events: {lost:?}");
    }
    match p.error {
        // A closed pipe (snoop | head) is a normal way to stop.
        Some(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// `snoop` beside a running agent: it streams the IOs that pass the filter (and are on the
/// devices asked for, with the devices below them), one `snoop --json` line each.
async fn snoop_from_agent(
    json: bool,
    duration: Option<f64>,
    style: Style,
    selection: &Selection,
    mut filter: StreamFilter,
    socket: &Path,
    status: api::Status,
) -> Result<()> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let host = Topology::scan()?;
    for name in &selection.names {
        let Some(d) = host.find(name) else {
            anyhow::bail!("unknown block device '{name}'. Known devices: {}.", host.accepted_names());
        };
        filter.devices.extend(host.with_lowers(&d.name).into_iter().map(|d| d.name.clone()));
    }
    let stream = tokio::net::UnixStream::connect(socket).await?;
    let (read, mut write) = stream.into_split();
    let mut request = serde_json::to_value(api::Request::Stream { filter })?;
    request["version"] = api::VERSION.into();
    write.write_all(format!("{request}\n").as_bytes()).await?;
    let mut lines = tokio::io::BufReader::new(read).lines();
    let header: serde_json::Value = serde_json::from_str(&lines.next_line().await?.unwrap_or_default())
        .map_err(|e| anyhow::anyhow!("the agent on {} did not start a stream: {e}", socket.display()))?;
    if let Some(e) = header["error"].as_str() {
        anyhow::bail!("the agent on {} refused the stream: {e}", socket.display());
    }
    tracing::info!(
        "reading from the running agent (pid {}) on {}: streaming, no programs loaded (--standalone loads them)",
        status.pid,
        socket.display()
    );
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    if !json {
        write_header(&mut out, style, status.causes)?;
        out.flush()?;
    }
    let deadline = tokio::time::sleep(Duration::from_secs_f64(duration.unwrap_or(f64::from(u32::MAX))));
    tokio::pin!(deadline);
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let mut dropped = 0u64;
    let mut text = TextWriter::new(status.causes);
    let result: std::io::Result<()> = loop {
        let line = tokio::select! {
            l = lines.next_line() => l?,
            _ = &mut deadline => break Ok(()),
            _ = &mut shutdown => break Ok(()),
        };
        let Some(line) = line else {
            tracing::warn!("the agent closed the stream (it stopped?)");
            break Ok(());
        };
        let written = if let Some(n) = crate::serve::api::dropped_in(&line) {
            dropped += n;
            Ok(())
        } else if json {
            writeln!(out, "{line}")
        } else {
            let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            match TextLine::from_json(&v) {
                Some(line) => text.write(&mut out, &line, style),
                None => Ok(()),
            }
        };
        if let Err(e) = written.and_then(|_| out.flush()) {
            break Err(e);
        }
    };
    if dropped > 0 {
        tracing::warn!("lost events: the agent dropped {dropped} lines this view did not read in time");
    }
    match result {
        // A closed pipe (snoop | head) is a normal way to stop.
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}
