//! The agent's local API: a Unix socket, root-only (mode 0600), where views ask the running
//! agent instead of loading a second copy of the kernel programs. One JSON request per
//! connection, one line; one JSON answer, one line. Versioned: every message carries
//! `"version": 1`; the schema is in docs/reference/json.md (The API).

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, ErrorKind, Write},
    os::unix::{
        fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt},
        net::UnixStream,
    },
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

use crate::{
    model::capture::{Capture, Meta},
    model::recorder::{Recorder, Window},
};

/// The version of every request and answer.
pub const VERSION: u64 = 1;
/// Where the agent serves the API unless the config says otherwise (`[api] socket`).
pub const DEFAULT_SOCKET: &str = "/run/tracerd/tracerd.sock";
/// The longest request read; a longer one is refused.
pub const MAX_REQUEST: usize = 64 * 1024;
/// A client that sends no full request within this long is answered with an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// What a view asks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "request", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// The agent: version, kernel, what it traces, the recorder's span.
    Status {},
    /// The recorder's frames that overlap `[from_unix_s, to_unix_s)`, added up into a capture;
    /// with `by_cgroup`, a capture per cgroup label too (an agent with `[cgroups] label`).
    Window {
        from_unix_s: f64,
        to_unix_s: f64,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        by_cgroup: bool,
    },
    /// Each device's slowest IOs of every minute that overlaps `[from_unix_s, to_unix_s)`.
    Slowest { from_unix_s: f64, to_unix_s: f64 },
    /// Every IO from now on, one `snoop --json` line each, that passes the filters.
    Stream {
        #[serde(flatten)]
        filter: StreamFilter,
    },
}

/// Which IOs a stream carries: all of them, unless a filter says otherwise.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamFilter {
    /// Kernel names of the devices (the IO's traced device); empty: every device.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<String>,
    /// Only IOs at least this slow, end to end (Q2C, else D2C, else Q2M).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_latency_ns: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm: Option<String>,
}

impl StreamFilter {
    pub fn passes(&self, device: &str, rec: &tracer_common::IoRecord) -> bool {
        use crate::model::stage::Stage;
        (self.devices.is_empty() || self.devices.iter().any(|d| d == device))
            && self.pid.is_none_or(|p| p == rec.pid)
            && self.comm.as_deref().is_none_or(|c| c == crate::kernel::record::comm(rec))
            && self.min_latency_ns.is_none_or(|min| {
                let took = Stage::Q2c.of(rec).or_else(|| Stage::D2c.of(rec)).or_else(|| Stage::Q2m.of(rec));
                took.is_some_and(|ns| ns >= min)
            })
    }
}

/// A view streaming from the agent: its filter, where its lines go, and how many did not fit.
#[derive(Debug)]
pub struct Subscriber {
    id: u64,
    pub filter: StreamFilter,
    lines: tokio::sync::mpsc::Sender<String>,
    dropped: Arc<std::sync::atomic::AtomicU64>,
}

/// Lines a slow view may fall behind by before the agent drops (and counts) its lines.
const STREAM_BACKLOG: usize = 16_384;

impl Subscriber {
    /// Queues a line; a full queue drops it, counted, and the view is told.
    pub fn send(&self, line: &str) {
        if self.lines.try_send(line.to_owned()).is_err() {
            self.dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The agent, as `status` answers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Status {
    pub tracerd_version: String,
    pub pid: u32,
    pub kernel: String,
    pub host: String,
    pub started_unix_s: f64,
    /// `run --aggregation`.
    pub aggregation: String,
    pub traced_devices: usize,
    /// Hooks that are not attached, and why.
    pub skipped_hooks: Vec<SkippedHook>,
    pub recorder: RecorderStatus,
    /// Whether it records waits by cause (config `causes`): its streamed lines carry them.
    #[serde(default)]
    pub causes: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SkippedHook {
    pub hook: String,
    pub reason: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RecorderStatus {
    pub resolution_s: f64,
    pub retention_s: f64,
    pub max_bytes: u64,
    pub bytes: u64,
    pub frames: u64,
    /// The span the kept frames cover (absent before the first frame).
    pub from_unix_s: Option<f64>,
    pub to_unix_s: Option<f64>,
    pub frames_dropped_for_memory: u64,
    /// The store on disk (absent when history is kept in memory only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<StoreStatus>,
}

/// The recorder's store, as `status` reports it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StoreStatus {
    pub path: PathBuf,
    pub retention_s: f64,
    pub max_bytes: u64,
    pub bytes: u64,
    pub segments: u64,
    pub frames: u64,
    /// Frames up to this time are synced to the disk (power loss loses what is after it).
    pub durable_to_unix_s: Option<f64>,
    pub health: crate::store::StoreHealth,
}

/// A stretch of a window with no frame because no agent ran.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GapAnswer {
    pub from_unix_s: f64,
    pub to_unix_s: f64,
}

/// A window's answer: the span its frames really cover, and their sum as a capture.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WindowAnswer {
    pub from_unix_s: f64,
    pub to_unix_s: f64,
    pub frames: u64,
    pub capture: Capture,
    /// Asked `by_cgroup`: the window per cgroup label (empty if the agent keeps none).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub by_cgroup: BTreeMap<String, Capture>,
    /// Where the window has no frames because no agent ran (a restart, a reboot).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gaps: Vec<GapAnswer>,
    /// Frames of the window the store could not read back (damaged on disk), left out.
    #[serde(default, skip_serializing_if = "crate::model::capture::is_zero")]
    pub damaged_frames: u64,
}

/// A window bound in seconds since the epoch, as the recorder's ms. Rounded: a window that
/// starts at the last one's end (`to_unix_s`) takes no frame twice.
pub fn window_ms(unix_s: f64) -> u64 {
    (unix_s.max(0.0) * 1e3).round() as u64
}

/// A window's frames added up: the agent's answer, and `report --store`'s.
pub fn window_answer(
    window: &Window,
    asked_from_unix_s: f64,
    by_cgroup: bool,
    kernel: String,
    host: String,
) -> Result<WindowAnswer, String> {
    let (agg, lost) = window.aggregate().map_err(|e| e.to_string())?;
    let (from, to) = window
        .span()
        .map_or((asked_from_unix_s, asked_from_unix_s), |(a, b)| (a as f64 / 1e3, b as f64 / 1e3));
    let meta = Meta { kernel, host, started_unix_s: from, duration_s: to - from };
    let cgroups =
        if by_cgroup { window.aggregate_cgroups().map_err(|e| e.to_string())? } else { BTreeMap::new() };
    let none = crate::model::aggregate::Lost::default();
    Ok(WindowAnswer {
        from_unix_s: from,
        to_unix_s: to,
        frames: window.frames.len() as u64,
        by_cgroup: cgroups
            .iter()
            .map(|(label, agg)| {
                (label.clone(), Capture::from_aggregate(agg, &window.topology, &none, meta.clone()))
            })
            .collect(),
        capture: Capture::from_aggregate(&agg, &window.topology, &lost, meta),
        gaps: window
            .gaps
            .iter()
            .map(|g| GapAnswer { from_unix_s: g.from_ms as f64 / 1e3, to_unix_s: g.to_ms as f64 / 1e3 })
            .collect(),
        damaged_frames: window.damaged_frames,
    })
}

/// What the API serves from: the recorder, what `status` says of the agent, and the views
/// streaming IOs.
#[derive(Debug, Default)]
pub struct Shared {
    pub recorder: Mutex<Recorder>,
    pub status: Mutex<Status>,
    pub slowest: Mutex<crate::model::slowest::Slowest>,
    pub streams: Mutex<Vec<Subscriber>>,
    /// The number of streams, read per IO without the lock.
    pub stream_count: std::sync::atomic::AtomicUsize,
    /// Woken when a stream starts or ends (the agent switches the kernel's records on or off).
    pub streams_changed: tokio::sync::Notify,
    next_id: std::sync::atomic::AtomicU64,
}

impl Shared {
    pub fn new(recorder: Recorder, status: Status) -> Shared {
        let minutes = recorder.limits.retention.as_secs().div_ceil(60);
        Shared {
            recorder: Mutex::new(recorder),
            status: Mutex::new(status),
            slowest: Mutex::new(crate::model::slowest::Slowest::new(minutes)),
            ..Default::default()
        }
    }

    fn status(&self) -> Status {
        let mut s = self.status.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let r = self.recorder.lock().unwrap_or_else(|e| e.into_inner());
        let span = r.span();
        s.recorder = RecorderStatus {
            resolution_s: r.limits.resolution.as_secs_f64(),
            retention_s: r.limits.retention.as_secs_f64(),
            max_bytes: r.limits.max_bytes as u64,
            bytes: r.bytes() as u64,
            frames: r.len() as u64,
            from_unix_s: span.map(|s| s.0 as f64 / 1e3),
            to_unix_s: span.map(|s| s.1 as f64 / 1e3),
            frames_dropped_for_memory: r.dropped_for_memory,
            store: r.store().map(store_status),
        };
        s
    }

    /// The window's frames are taken under the lock, and read from the store and added up
    /// outside it: a long window read from disk does not hold up the agent's tick.
    fn window(&self, from_unix_s: f64, to_unix_s: f64, by_cgroup: bool) -> Result<WindowAnswer, String> {
        if !(from_unix_s.is_finite() && to_unix_s.is_finite() && from_unix_s < to_unix_s) {
            return Err(format!(
                "window from {from_unix_s} to {to_unix_s}: give from_unix_s before to_unix_s (seconds since the Unix epoch)"
            ));
        }
        let planned = self
            .recorder
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .plan_window(window_ms(from_unix_s), window_ms(to_unix_s));
        let (window, bad) = planned.read();
        self.count_unreadable(bad);
        let status = self.status.lock().unwrap_or_else(|e| e.into_inner()).clone();
        window_answer(&window, from_unix_s, by_cgroup, status.kernel, status.host)
    }

    /// Each device's slowest IOs of the minutes that overlap the window: the store's (from
    /// before this agent's start too) joined with the memory's (this minute, and any the store
    /// could not take). The store is read outside the recorder's lock.
    fn slowest(&self, from_unix_s: f64, to_unix_s: f64) -> Vec<crate::model::slowest::SlowMinute> {
        let reads = {
            let recorder = self.recorder.lock().unwrap_or_else(|e| e.into_inner());
            recorder.store().map(|st| st.plan_slow(from_unix_s, to_unix_s))
        };
        let mut minutes =
            self.slowest.lock().unwrap_or_else(|e| e.into_inner()).window(from_unix_s, to_unix_s);
        if let Some(reads) = reads {
            let (stored, bad) = reads.slow_minutes();
            self.count_unreadable(bad);
            minutes.extend(stored);
        }
        crate::model::slowest::merge(minutes)
    }

    fn count_unreadable(&self, bad: crate::store::Unreadable) {
        if bad != crate::store::Unreadable::default()
            && let Some(store) = self.recorder.lock().unwrap_or_else(|e| e.into_inner()).store_mut()
        {
            store.count_unreadable(bad);
        }
    }

    fn subscribe(
        &self,
        filter: StreamFilter,
    ) -> (u64, tokio::sync::mpsc::Receiver<String>, Arc<std::sync::atomic::AtomicU64>) {
        use std::sync::atomic::Ordering::Relaxed;
        let (tx, rx) = tokio::sync::mpsc::channel(STREAM_BACKLOG);
        let id = self.next_id.fetch_add(1, Relaxed);
        let dropped = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        streams.push(Subscriber { id, filter, lines: tx, dropped: dropped.clone() });
        self.stream_count.store(streams.len(), Relaxed);
        self.streams_changed.notify_one();
        (id, rx, dropped)
    }

    fn unsubscribe(&self, id: u64) {
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        streams.retain(|s| s.id != id);
        self.stream_count.store(streams.len(), std::sync::atomic::Ordering::Relaxed);
        self.streams_changed.notify_one();
    }

    /// The answer line to one request line.
    pub fn answer(&self, line: &[u8]) -> String {
        let reply = match parse_request(line) {
            Err(e) => Err(e),
            // Streams are served by `stream`, before an answer is asked for.
            Ok(Request::Stream { .. }) => Err("a stream is answered line by line".into()),
            Ok(Request::Status {}) => Ok(("status", serde_json::to_value(self.status()))),
            Ok(Request::Window { from_unix_s, to_unix_s, by_cgroup }) => {
                self.window(from_unix_s, to_unix_s, by_cgroup).map(|w| ("window", serde_json::to_value(w)))
            }
            Ok(Request::Slowest { from_unix_s, to_unix_s }) => {
                Ok(("slowest", serde_json::to_value(self.slowest(from_unix_s, to_unix_s))))
            }
        };
        let body = match reply {
            Ok((key, Ok(value))) => serde_json::json!({ "version": VERSION, key: value }),
            Ok((_, Err(e))) => error_body(&format!("cannot encode the answer: {e}")),
            Err(e) => error_body(&e),
        };
        body.to_string()
    }
}

fn error_body(e: &str) -> Value {
    serde_json::json!({ "version": VERSION, "error": e })
}

fn store_status(st: &crate::store::Store) -> StoreStatus {
    StoreStatus {
        path: st.limits.dir.clone(),
        retention_s: st.limits.retention.as_secs_f64(),
        max_bytes: st.limits.max_bytes,
        bytes: st.bytes(),
        segments: st.segment_count() as u64,
        frames: st.frame_count() as u64,
        durable_to_unix_s: st.durable_to_ms().filter(|&ms| ms != 0).map(|ms| ms as f64 / 1e3),
        health: st.health.clone(),
    }
}

/// Checks a request line: JSON, the version, then the request itself.
fn parse_request(line: &[u8]) -> Result<Request, String> {
    let value: Value = serde_json::from_slice(line).map_err(|e| {
        format!(
            "the request is not JSON ({e}); send one line such as {{\"version\":1,\"request\":\"status\"}}"
        )
    })?;
    let Value::Object(mut fields) = value else {
        return Err("the request must be a JSON object such as {\"version\":1,\"request\":\"status\"}".into());
    };
    match fields.remove("version") {
        Some(Value::Number(n)) if n.as_u64() == Some(VERSION) => {}
        Some(v) => {
            return Err(format!(
                "API version {v} is not served: this agent (tracerd {}) speaks version {VERSION}",
                env!("CARGO_PKG_VERSION")
            ));
        }
        None => return Err(format!("the request has no \"version\" (this agent speaks version {VERSION})")),
    }
    serde_json::from_value(Value::Object(fields)).map_err(|e| {
        format!(
            "not a valid request ({e}); requests: status, window and slowest (from_unix_s, to_unix_s), \
                 stream (devices, min_latency_ns, pid, comm)"
        )
    })
}

/// The bound socket's path: removed when dropped, unless another agent's socket has replaced
/// it since.
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    inode: (u64, u64),
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Ok(m) = std::fs::symlink_metadata(&self.path)
            && (m.dev(), m.ino()) == self.inode
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds the API socket, root-only. A socket left by an agent that died is replaced; one that
/// answers belongs to a running agent, and is an error.
pub fn bind(path: &Path) -> Result<(tokio::net::UnixListener, SocketFile)> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        std::fs::DirBuilder::new().recursive(true).mode(0o755).create(dir).with_context(|| {
            format!(
                "cannot create {} for the API socket; set [api] socket to a writable place",
                dir.display()
            )
        })?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_socket() => bail!(
            "{} exists and is not a socket: remove it, or set [api] socket (or --socket) to another path",
            path.display()
        ),
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => bail!(
                "another tracerd agent is already serving {}: stop it first (systemctl stop tracerd), or give \
                 this one another --socket",
                path.display()
            ),
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                tracing::warn!("removing the stale API socket {} (its agent is gone)", path.display());
                std::fs::remove_file(path)
                    .with_context(|| format!("cannot remove the stale socket {}", path.display()))?;
            }
            Err(e) => bail!("cannot check the existing socket {}: {e}", path.display()),
        },
        Err(_) => {}
    }
    // The socket is created root-only: no moment exists where others could connect.
    let old = unsafe { libc::umask(0o177) };
    let bound = tokio::net::UnixListener::bind(path);
    unsafe { libc::umask(old) };
    let listener = bound.with_context(|| format!("cannot serve the API on {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    let m = std::fs::symlink_metadata(path)?;
    Ok((listener, SocketFile { path: path.to_owned(), inode: (m.dev(), m.ino()) }))
}

/// Answers requests until the agent stops.
pub async fn serve(listener: tokio::net::UnixListener, shared: Arc<Shared>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(handle(stream, shared.clone()));
            }
            Err(e) => {
                tracing::warn!("API socket: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn handle(stream: tokio::net::UnixStream, shared: Arc<Shared>) {
    let (read, mut write) = stream.into_split();
    let mut line = Vec::new();
    let mut limited = tokio::io::BufReader::new(read).take(MAX_REQUEST as u64 + 1);
    let read = tokio::time::timeout(REQUEST_TIMEOUT, limited.read_until(b'\n', &mut line)).await;
    if let (Ok(Ok(_)), Ok(Request::Stream { filter })) = (&read, parse_request(&line)) {
        return stream_to(limited, write, filter, &shared).await;
    }
    let reply = match read {
        Err(_) => error_body("no request within 5 s: send one JSON line ending in a newline").to_string(),
        Ok(Err(_)) => return,
        Ok(Ok(_)) if line.len() > MAX_REQUEST => error_body(&format!(
            "the request is longer than {MAX_REQUEST} bytes: requests are one short line"
        ))
        .to_string(),
        // Adding up a long window takes a while: off the thread that reads the ring buffer.
        Ok(Ok(_)) => match tokio::task::spawn_blocking(move || shared.answer(&line)).await {
            Ok(reply) => reply,
            Err(e) => error_body(&format!("the agent failed to answer: {e}")).to_string(),
        },
    };
    let _ = write.write_all(format!("{reply}\n").as_bytes()).await;
    let _ = write.shutdown().await;
}

/// Sends a view every IO that passes its filter, until it hangs up: a header line, then one
/// `snoop --json` line per IO, and `{"version":1,"dropped":N}` when lines did not fit its
/// backlog (never silently).
async fn stream_to(
    mut read: impl tokio::io::AsyncRead + Unpin,
    mut write: tokio::net::unix::OwnedWriteHalf,
    filter: StreamFilter,
    shared: &Shared,
) {
    let (id, mut lines, dropped) = shared.subscribe(filter);
    let header = serde_json::json!({ "version": VERSION, "stream": { "started_unix_s": crate::model::capture::unix_now() } });
    let mut ok = write.write_all(format!("{header}\n").as_bytes()).await.is_ok();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut scratch = [0u8; 64];
    while ok {
        tokio::select! {
            line = lines.recv() => match line {
                Some(line) => ok = write.write_all(line.as_bytes()).await.is_ok(),
                None => break,
            },
            // The view hung up (or sent more than its request).
            n = read.read(&mut scratch) => if !matches!(n, Ok(n) if n > 0) { break },
            _ = tick.tick() => {}
        }
        let n = dropped.swap(0, std::sync::atomic::Ordering::Relaxed);
        if ok && n > 0 {
            ok = write.write_all(dropped_notice(n).as_bytes()).await.is_ok();
        }
    }
    shared.unsubscribe(id);
}

/// The stream's line saying that `n` lines did not fit a view's backlog.
pub fn dropped_notice(n: u64) -> String {
    format!("{}\n", serde_json::json!({ "version": VERSION, "dropped": n }))
}

/// How many lines a stream line says were dropped, or None for an IO's line (`snoop --json`'s,
/// which starts with its `kind`).
pub fn dropped_in(line: &str) -> Option<u64> {
    if line.starts_with("{\"kind\"") {
        return None;
    }
    serde_json::from_str::<serde_json::Value>(line).ok()?.get("dropped")?.as_u64()
}

/// Why a view could not use the agent.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("no tracerd agent serves {0} (start one with `sudo tracerd run`, or give --socket)")]
    NoAgent(PathBuf),
    #[error("cannot reach the agent on {path}: {error}; its socket is root-only: run this as root")]
    Denied { path: PathBuf, error: std::io::Error },
    #[error("the agent on {path} {what}")]
    Failed { path: PathBuf, what: String },
}

/// Sends one request to the agent on `path` and returns its answer's `key` field.
pub fn call<T: for<'de> Deserialize<'de>>(
    path: &Path,
    request: &Request,
    key: &str,
) -> Result<T, AttachError> {
    let failed = |what: String| AttachError::Failed { path: path.to_owned(), what };
    let mut stream = match UnixStream::connect(path) {
        Ok(s) => s,
        Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::ConnectionRefused) => {
            return Err(AttachError::NoAgent(path.to_owned()));
        }
        Err(error) if error.kind() == ErrorKind::PermissionDenied => {
            return Err(AttachError::Denied { path: path.to_owned(), error });
        }
        Err(e) => return Err(failed(format!("cannot be reached: {e}"))),
    };
    let mut body = serde_json::to_value(request).map_err(|e| failed(e.to_string()))?;
    body["version"] = VERSION.into();
    let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
    stream
        .write_all(format!("{body}\n").as_bytes())
        .map_err(|e| failed(format!("did not take the request: {e}")))?;
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer).map_err(|e| failed(format!("did not answer: {e}")))?;
    let mut value: Value = serde_json::from_str(&answer)
        .map_err(|e| failed(format!("answered something that is not JSON ({e}): is it a tracerd agent?")))?;
    if value["version"] != VERSION {
        return Err(failed(format!(
            "speaks API version {}, this tracerd {VERSION}: use the same tracerd release for both",
            value["version"]
        )));
    }
    if let Some(e) = value["error"].as_str() {
        return Err(failed(format!("refused the request: {e}")));
    }
    serde_json::from_value(value[key].take()).map_err(|e| failed(format!("answered a malformed {key}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_tells_the_dropped_notice_from_an_io_line() {
        assert_eq!(dropped_in(dropped_notice(7).trim_end()), Some(7));
        assert_eq!(dropped_in(r#"{"kind":"request","device":"loop0","dropped":3}"#), None);
        assert_eq!(dropped_in(r#"{"version":1}"#), None);
    }

    #[test]
    fn requests_are_checked_before_they_are_answered() {
        let shared = Shared::default();
        let answer = |line: &str| serde_json::from_str::<Value>(&shared.answer(line.as_bytes())).unwrap();
        let ok = answer(r#"{"version":1,"request":"status"}"#);
        assert_eq!(ok["version"], 1);
        assert_eq!(ok["status"]["recorder"]["frames"], 0);
        for (line, says) in [
            ("{", "not JSON"),
            ("[1]", "JSON object"),
            (r#"{"request":"status"}"#, "no \"version\""),
            (r#"{"version":2,"request":"status"}"#, "version 2 is not served"),
            (r#"{"version":1,"request":"reboot"}"#, "requests: status, window"),
            (r#"{"version":1,"request":"status","x":1}"#, "unknown field"),
            (r#"{"version":1,"request":"window","from_unix_s":5,"to_unix_s":1}"#, "before to_unix_s"),
        ] {
            let e = answer(line);
            assert!(e["error"].as_str().is_some_and(|e| e.contains(says)), "{line}: {e}");
            assert_eq!(e["version"], 1);
        }
        let w = answer(r#"{"version":1,"request":"window","from_unix_s":0,"to_unix_s":10}"#);
        assert_eq!(w["window"]["frames"], 0);
        assert_eq!(w["window"]["capture"]["format"], "tracerd-capture");
    }
}
