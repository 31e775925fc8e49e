//! The recorder's store on disk: its frames kept across agent restarts and reboots, read by
//! the agent's views and, offline, by `report --store`.
//!
//! An append-only format of our own, rather than an embedded database: a frame is already a
//! self-contained byte string written once and never changed, so a log of checksummed records
//! is all the store needs, and it can be read by a reader that trusts nothing in it.
//!
//! The store is a directory of segment files, `frames-<first ms>.tdr`, one per hour of
//! frames (or less, when the size bound asks). Each file is a 16-byte header (magic
//! `TRACERD\0`, format version as u32 LE, 4 reserved bytes) and then records:
//! `len: u32 LE | crc32: u32 LE | kind: u8 | payload`, where `len` counts kind and payload and
//! the CRC-32 (IEEE) covers them. Kinds: a frame (start ms, end ms, both u64 LE, then the
//! frame's encoded bytes), the devices the following frames name (JSON), an agent's start
//! (JSON), which marks a gap in the history, and (from format 2) a device's slowest IOs of one
//! minute (the minute's start in Unix seconds, u64 LE, then JSON).
//!
//! Crash safety: every frame is written with one write(2) as it is sealed, so a killed agent
//! loses only the frame it was filling; the file is synced (fdatasync) every `sync_every`, so
//! power loss loses at most that much. A record cut short by a crash (a torn tail) is cut off
//! when the agent opens the store again; a damaged record elsewhere is skipped up to the next
//! record that checks. Both are counted, never read as data. A segment of format 1 is read
//! (it has no slowest IOs) and an agent writes on in a new segment; a segment of a format this
//! tracerd does not know is refused by name.

use std::{
    collections::{BTreeMap, HashSet},
    fs::{File, OpenOptions},
    io::{Read, Write},
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::model::{recorder::Frame, slowest::SlowMinute, topology::Device};

/// The format this tracerd writes.
pub const FORMAT_VERSION: u32 = 2;
/// The formats it reads: 1 is 2 without the slowest IOs.
const OLDEST_READABLE: u32 = 1;
const MAGIC: &[u8; 8] = b"TRACERD\0";
const HEADER_LEN: u64 = 16;
/// len + crc + kind.
const RECORD_HEAD: usize = 9;
/// No record is larger: a length beyond it is damage, not data.
const MAX_RECORD: u32 = 64 << 20;
const KIND_FRAME: u8 = 1;
const KIND_DEVICES: u8 = 2;
const KIND_START: u8 = 3;
/// From format 2.
const KIND_SLOW: u8 = 4;
const SEGMENT_SPAN_MS: u64 = 3_600_000;
/// How long a failing store must write without a failure to be called writable again. A disk
/// at the edge of full takes a small record and refuses the next: an outage is warned of once
/// and ends once, not at every record that happens to fit.
const WRITABLE_AFTER: Duration = Duration::from_secs(60);

/// Where the store is and how much it keeps (config `[store]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreLimits {
    pub dir: PathBuf,
    /// How far back frames are kept (by the newest frame's end).
    pub retention: Duration,
    /// The most bytes the segment files may take together.
    pub max_bytes: u64,
    /// How often written frames are synced to the disk.
    pub sync_every: Duration,
}

impl StoreLimits {
    pub const DEFAULT_DIR: &str = "/var/lib/tracerd/recorder";

    pub fn new(dir: PathBuf) -> StoreLimits {
        StoreLimits {
            dir,
            retention: Duration::from_secs(86_400),
            max_bytes: 512 << 20,
            sync_every: Duration::from_secs(5),
        }
    }

    /// A segment holds an hour, or less so that the oldest can go before the size bound.
    fn segment_bytes(&self) -> u64 {
        (self.max_bytes / 16).max(256 << 10)
    }
}

/// An agent's start, as the store records it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Start {
    pub started_ms: u64,
    pub pid: u32,
    pub tracerd_version: String,
    pub kernel: String,
    pub host: String,
}

/// What the store could not write or read back, counted since the agent started (writes) or
/// since the store was opened (reads).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreHealth {
    /// Frames kept in memory but not written, because a write failed (a full disk).
    pub frames_not_stored: u64,
    /// Lists of a device's slowest IOs of a minute not written, because a write failed.
    #[serde(default)]
    pub slow_lists_not_stored: u64,
    pub write_errors: u64,
    /// The last write error, from the first failure until the store has written for a minute
    /// without one.
    pub failing: Option<String>,
    /// Records that did not check (CRC, length, content) and were skipped.
    pub damaged_records: u64,
    /// Bytes skipped for damage, and the torn tails cut off at open.
    pub unreadable_bytes: u64,
    pub torn_tails: u64,
    /// Segment files removed for the retention or the size bound.
    pub segments_removed: u64,
}

/// One frame's place on disk.
#[derive(Clone, Copy, Debug)]
struct Entry {
    start_ms: u64,
    end_ms: u64,
    offset: u64,
    len: u32,
}

/// One device's minute of slowest IOs, on disk.
#[derive(Clone, Copy, Debug)]
struct SlowEntry {
    minute_unix_s: u64,
    offset: u64,
    len: u32,
}

#[derive(Debug)]
struct Segment {
    path: PathBuf,
    version: u32,
    bytes: u64,
    frames: Vec<Entry>,
    slow: Vec<SlowEntry>,
}

/// Records to read, planned from the index: each segment's file, opened while the index was
/// read (so a segment removed since is still read whole), with the records' places. The
/// agent plans under the recorder's lock and reads outside it.
#[derive(Debug, Default)]
pub struct Reads {
    kind: u8,
    files: Vec<(File, Vec<(u64, u32)>)>,
    /// Records whose segment could not be opened.
    unopened: u64,
}

/// Records a read found damaged: counted into the store's health by `Store::count_unreadable`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Unreadable {
    pub records: u64,
    pub bytes: u64,
}

impl Reads {
    /// The payloads that check, in order.
    fn payloads(self) -> (Vec<Vec<u8>>, Unreadable) {
        let mut bad = Unreadable { records: self.unopened, bytes: 0 };
        let mut out = Vec::new();
        for (file, places) in self.files {
            for (offset, len) in places {
                let mut record = vec![0; RECORD_HEAD + len as usize];
                let read = file.read_exact_at(&mut record, offset).ok().and_then(|()| record_at(&record, 0));
                match read {
                    // The length the index took: a record that changed since is damage.
                    Some((kind, payload)) if kind == self.kind && payload.len() == len as usize => {
                        out.push(payload.to_vec())
                    }
                    _ => {
                        bad.records += 1;
                        bad.bytes += record.len() as u64;
                    }
                }
            }
        }
        (out, bad)
    }

    /// The frames, in time order.
    pub fn frames(self) -> (Vec<Frame>, Unreadable) {
        let (payloads, bad) = self.payloads();
        let frames = payloads
            .into_iter()
            .map(|p| {
                let start_ms = u64::from_le_bytes(p[..8].try_into().unwrap());
                let end_ms = u64::from_le_bytes(p[8..16].try_into().unwrap());
                Frame::from_parts(start_ms, end_ms, p[16..].into())
            })
            .collect();
        (frames, bad)
    }

    /// The minutes of slowest IOs; one whose JSON does not parse counts as damaged.
    pub fn slow_minutes(self) -> (Vec<SlowMinute>, Unreadable) {
        let (payloads, mut bad) = self.payloads();
        let mut out = Vec::new();
        for p in payloads {
            match serde_json::from_slice::<SlowMinute>(&p[8..]) {
                Ok(m) => out.push(m),
                Err(_) => {
                    bad.records += 1;
                    bad.bytes += (RECORD_HEAD + p.len()) as u64;
                }
            }
        }
        (out, bad)
    }
}

/// The open segment the agent appends to.
#[derive(Debug)]
struct Writer {
    file: File,
    /// The segment's index in `segments`.
    segment: usize,
    /// Devices already written into this segment, so that each segment names its own.
    devices: HashSet<u32>,
    synced: Instant,
    dirty: bool,
    /// The end of the newest frame known synced.
    durable_to_ms: u64,
    written_to_ms: u64,
    syncer: Syncer,
    _lock: File,
}

/// Syncs what was written on a thread of its own: an fdatasync on a slow disk can take
/// long, and the agent writes from its main task.
#[derive(Debug)]
struct Syncer {
    /// A descriptor of the file to sync, and the end of the newest frame it holds.
    requests: std::sync::mpsc::Sender<(File, u64)>,
    /// The end of the newest frame synced, and the last sync's error, not yet counted.
    done: std::sync::Arc<std::sync::Mutex<(u64, Option<String>)>>,
}

impl Syncer {
    fn start(durable_to_ms: u64) -> Result<Syncer> {
        let (requests, rx) = std::sync::mpsc::channel::<(File, u64)>();
        let done = std::sync::Arc::new(std::sync::Mutex::new((durable_to_ms, None)));
        let shared = done.clone();
        // Ends when the store is dropped (its sender with it).
        std::thread::Builder::new()
            .name("tracerd-store-sync".into())
            .spawn(move || {
                for (file, to_ms) in rx {
                    let r = file.sync_data();
                    let mut d = shared.lock().unwrap_or_else(|e| e.into_inner());
                    match r {
                        Ok(()) => d.0 = d.0.max(to_ms),
                        Err(e) => d.1 = Some(e.to_string()),
                    }
                }
            })
            .context("cannot start the recorder store's sync thread")?;
        Ok(Syncer { requests, done })
    }
}

/// A store opened to read (`report --store`) or to write (the agent).
#[derive(Debug)]
pub struct Store {
    pub limits: StoreLimits,
    segments: Vec<Segment>,
    devices: BTreeMap<u32, Device>,
    starts: Vec<Start>,
    writer: Option<Writer>,
    pub health: StoreHealth,
    /// While writes fail: when the frames began to be written again.
    writing_since: Option<Instant>,
}

/// A stretch of time inside a window without frames because no agent ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gap {
    pub from_ms: u64,
    pub to_ms: u64,
}

impl Store {
    /// Opens (or creates) the store for the agent: locks it, reads its index, cuts torn tails.
    pub fn open(limits: StoreLimits) -> Result<Store> {
        std::fs::create_dir_all(&limits.dir).with_context(|| {
            format!(
                "cannot create the recorder's store {}: create it, or set [store] path to a writable directory",
                limits.dir.display()
            )
        })?;
        let lock = lock(&limits.dir)?;
        let mut store = Store::scan(limits, true)?;
        store.remove_old();
        let (segment, file) = store.segment_for_writing(None)?;
        let durable_to_ms = store.span().map_or(0, |s| s.1);
        store.writer = Some(Writer {
            file,
            segment,
            devices: HashSet::new(),
            synced: Instant::now(),
            dirty: false,
            durable_to_ms,
            written_to_ms: durable_to_ms,
            syncer: Syncer::start(durable_to_ms)?,
            _lock: lock,
        });
        Ok(store)
    }

    /// Opens a store to read only (no lock, nothing changed): a copy from another host works
    /// without root and without an agent.
    pub fn open_read_only(dir: &Path) -> Result<Store> {
        let meta = std::fs::metadata(dir).with_context(|| {
            format!(
                "cannot read the recorder's store {}: give the directory that holds frames-*.tdr",
                dir.display()
            )
        })?;
        if !meta.is_dir() {
            bail!(
                "{} is not a directory: give the store's directory, which holds frames-*.tdr",
                dir.display()
            );
        }
        let store = Store::scan(StoreLimits::new(dir.to_path_buf()), false)?;
        if store.segments.is_empty() {
            bail!("{} holds no recorder segments (frames-*.tdr): is it a tracerd store?", dir.display());
        }
        Ok(store)
    }

    fn scan(limits: StoreLimits, writable: bool) -> Result<Store> {
        let mut names: Vec<(u64, PathBuf)> = std::fs::read_dir(&limits.dir)
            .with_context(|| format!("cannot list the recorder's store {}", limits.dir.display()))?
            .filter_map(|e| e.ok())
            .filter_map(|e| segment_ms(&e.file_name().to_string_lossy()).map(|ms| (ms, e.path())))
            .collect();
        names.sort();
        let mut store = Store {
            limits,
            segments: Vec::new(),
            devices: BTreeMap::new(),
            starts: Vec::new(),
            writer: None,
            health: StoreHealth::default(),
            writing_since: None,
        };
        let last = names.len().saturating_sub(1);
        for (i, (_, path)) in names.into_iter().enumerate() {
            store.read_segment(path, writable && i == last)?;
        }
        Ok(store)
    }

    /// Indexes one segment. Its torn tail is cut off when `cut_tail` (the agent's newest).
    fn read_segment(&mut self, path: PathBuf, cut_tail: bool) -> Result<()> {
        let mut file = File::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).with_context(|| format!("cannot read {}", path.display()))?;
        if bytes.len() < HEADER_LEN as usize || &bytes[..8] != MAGIC {
            // Not ours, or its header is gone: nothing in it can be trusted.
            tracing::warn!("{}: not a tracerd store segment (bad header); skipped", path.display());
            self.health.damaged_records += 1;
            self.health.unreadable_bytes += bytes.len() as u64;
            return Ok(());
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
        if !(OLDEST_READABLE..=FORMAT_VERSION).contains(&version) {
            bail!(
                "{}: written in store format {version}, and this tracerd ({}) reads formats {OLDEST_READABLE} to {FORMAT_VERSION}: \
                 read it with a tracerd of that format, or move the store aside (or set [store] path) to start a new one",
                path.display(),
                env!("CARGO_PKG_VERSION")
            );
        }
        let mut segment =
            Segment { path, version, bytes: bytes.len() as u64, frames: Vec::new(), slow: Vec::new() };
        let mut at = HEADER_LEN as usize;
        while at < bytes.len() {
            match record_at(&bytes, at) {
                Some((kind, payload)) => {
                    self.index(&mut segment, kind, payload, at);
                    at += RECORD_HEAD + payload.len();
                }
                None => {
                    // Damage: skip to the next record that checks, or the end (a torn tail).
                    let next = (at + 1..bytes.len()).find(|&i| record_at(&bytes, i).is_some());
                    let skipped = next.unwrap_or(bytes.len()) - at;
                    self.health.unreadable_bytes += skipped as u64;
                    match next {
                        Some(n) => {
                            self.health.damaged_records += 1;
                            tracing::warn!(
                                "{}: {skipped} damaged bytes at offset {at} skipped",
                                segment.path.display()
                            );
                            at = n;
                        }
                        None => {
                            self.health.torn_tails += 1;
                            // The agent cuts off what its predecessor left; a reader may
                            // also meet the record an agent is writing at this moment.
                            let why = if cut_tail {
                                "the agent stopped mid-write; cut off"
                            } else {
                                "an agent is writing it now, or stopped mid-write"
                            };
                            tracing::warn!(
                                "{}: the last {skipped} bytes are an unfinished record ({why})",
                                segment.path.display()
                            );
                            if cut_tail {
                                let f = OpenOptions::new().write(true).open(&segment.path)?;
                                f.set_len(at as u64)?;
                                segment.bytes = at as u64;
                            }
                            break;
                        }
                    }
                }
            }
        }
        self.segments.push(segment);
        Ok(())
    }

    fn index(&mut self, segment: &mut Segment, kind: u8, payload: &[u8], at: usize) {
        let ok = match kind {
            KIND_FRAME if payload.len() >= 16 => {
                let start_ms = u64::from_le_bytes(payload[..8].try_into().unwrap());
                let end_ms = u64::from_le_bytes(payload[8..16].try_into().unwrap());
                segment.frames.push(Entry { start_ms, end_ms, offset: at as u64, len: payload.len() as u32 });
                true
            }
            KIND_DEVICES => match serde_json::from_slice::<Vec<Device>>(payload) {
                Ok(devices) => {
                    self.devices.extend(devices.into_iter().map(|d| (d.dev, d)));
                    true
                }
                Err(_) => false,
            },
            KIND_START => match serde_json::from_slice::<Start>(payload) {
                Ok(s) => {
                    self.starts.push(s);
                    true
                }
                Err(_) => false,
            },
            // Parsed when read: a window reads few of them.
            KIND_SLOW if segment.version >= 2 && payload.len() >= 8 => {
                let minute_unix_s = u64::from_le_bytes(payload[..8].try_into().unwrap());
                segment.slow.push(SlowEntry { minute_unix_s, offset: at as u64, len: payload.len() as u32 });
                true
            }
            // A kind this version does not know: a newer writer would have changed the version.
            _ => false,
        };
        if !ok {
            self.health.damaged_records += 1;
            self.health.unreadable_bytes += (RECORD_HEAD + payload.len()) as u64;
        }
    }

    /// The newest segment if it may take more frames starting at `start_ms`, else a new one.
    fn segment_for_writing(&mut self, start_ms: Option<u64>) -> Result<(usize, File)> {
        if let Some(last) = self.segments.last() {
            let first = last.frames.first().map(|e| e.start_ms);
            // A segment of an older format is read, never written to.
            let fits = last.version == FORMAT_VERSION
                && last.bytes < self.limits.segment_bytes()
                && match (first, start_ms) {
                    (Some(f), Some(s)) => s < f + SEGMENT_SPAN_MS,
                    _ => true,
                };
            if fits {
                let file = OpenOptions::new().append(true).open(&last.path).with_context(|| {
                    format!(
                        "cannot open {} to append: the store must be writable by the agent",
                        last.path.display()
                    )
                })?;
                return Ok((self.segments.len() - 1, file));
            }
        }
        let ms = start_ms.unwrap_or_else(crate::units::unix_ms);
        // Never the name of one that exists: a clock set back must not overwrite history.
        let newest = self.segments.last().and_then(|s| segment_ms(&s.path.file_name()?.to_string_lossy()));
        let ms = newest.map_or(ms, |n| ms.max(n + 1));
        let path = self.limits.dir.join(format!("frames-{ms:013}.tdr"));
        let mut file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let mut header = Vec::with_capacity(HEADER_LEN as usize);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        header.extend_from_slice(&[0; 4]);
        file.write_all(&header).with_context(|| format!("cannot write {}", path.display()))?;
        self.segments.push(Segment {
            path,
            version: FORMAT_VERSION,
            bytes: HEADER_LEN,
            frames: Vec::new(),
            slow: Vec::new(),
        });
        Ok((self.segments.len() - 1, file))
    }

    /// Records an agent's start: views mark the gap before it.
    pub fn start(&mut self, start: Start) {
        let payload = serde_json::to_vec(&start).expect("a start encodes");
        if self.write(KIND_START, &payload).is_ok() {
            self.starts.push(start);
        }
    }

    /// Writes a sealed frame, after the devices it names that this segment has not named yet.
    /// A failed write (a full disk) is counted and warned of once; the next frame tries again.
    pub fn append(&mut self, frame: &Frame, devices: &[Device]) {
        if let Err(e) = self.rotate(frame.start_ms) {
            self.health.frames_not_stored += 1;
            self.failed(e);
            return;
        }
        let w = self.writer.as_mut().expect("a store opened to write");
        let new: Vec<&Device> = devices.iter().filter(|d| !w.devices.contains(&d.dev)).collect();
        if !new.is_empty() {
            let payload = serde_json::to_vec(&new).expect("devices encode");
            if let Err(e) = self.write(KIND_DEVICES, &payload) {
                self.health.frames_not_stored += 1;
                self.failed(e);
                return;
            }
            let w = self.writer.as_mut().expect("a store opened to write");
            w.devices.extend(new.iter().map(|d| d.dev));
            self.devices.extend(new.into_iter().map(|d| (d.dev, d.clone())));
        }
        let mut payload = Vec::with_capacity(16 + frame.data().len());
        payload.extend_from_slice(&frame.start_ms.to_le_bytes());
        payload.extend_from_slice(&frame.end_ms.to_le_bytes());
        payload.extend_from_slice(frame.data());
        match self.write(KIND_FRAME, &payload) {
            Ok(offset) => {
                let seg = self.writer.as_ref().expect("a store opened to write").segment;
                self.segments[seg].frames.push(Entry {
                    start_ms: frame.start_ms,
                    end_ms: frame.end_ms,
                    offset,
                    len: payload.len() as u32,
                });
                self.written(Instant::now());
                let w = self.writer.as_mut().expect("a store opened to write");
                w.written_to_ms = frame.end_ms;
                w.dirty = true;
                if w.synced.elapsed() >= self.limits.sync_every {
                    self.sync();
                }
            }
            Err(e) => {
                self.health.frames_not_stored += 1;
                self.failed(e);
            }
        }
    }

    /// Writes minutes of the slowest IOs as the agent files them. A failed write is counted
    /// and warned of as a frame's is.
    pub fn append_slow(&mut self, minutes: &[SlowMinute]) {
        for m in minutes {
            let mut payload = m.minute_unix_s.to_le_bytes().to_vec();
            payload.extend(serde_json::to_vec(m).expect("a slow minute encodes"));
            match self.write(KIND_SLOW, &payload) {
                Ok(offset) => {
                    let w = self.writer.as_mut().expect("a store opened to write");
                    w.dirty = true;
                    let entry =
                        SlowEntry { minute_unix_s: m.minute_unix_s, offset, len: payload.len() as u32 };
                    self.segments[w.segment].slow.push(entry);
                }
                Err(e) => {
                    self.health.slow_lists_not_stored += 1;
                    self.failed(e);
                }
            }
        }
    }

    /// Ends an outage once frames have been written for `WRITABLE_AFTER` without a failure.
    fn written(&mut self, now: Instant) {
        if self.health.failing.is_none() {
            return;
        }
        let since = *self.writing_since.get_or_insert(now);
        if now.duration_since(since) < WRITABLE_AFTER {
            return;
        }
        let e = self.health.failing.take().unwrap_or_default();
        self.writing_since = None;
        tracing::warn!(
            "the recorder's store {} takes frames again: written for {} s without a failure (after: {e}); \
             {} frames were not stored",
            self.limits.dir.display(),
            WRITABLE_AFTER.as_secs(),
            self.health.frames_not_stored
        );
    }

    /// Counts a failed write, and warns of it if it begins an outage.
    fn failed(&mut self, e: anyhow::Error) {
        self.health.write_errors += 1;
        self.writing_since = None;
        let e = format!("{e:#}");
        if self.health.failing.is_none() {
            tracing::warn!(
                "cannot write to the recorder's store {}: {e}; frames stay in memory and the store \
                 takes them again when it can (counted in tracerd_recorder_store_frames_not_stored_total)",
                self.limits.dir.display()
            );
        }
        self.health.failing = Some(e);
    }

    /// Has what was written synced, on the sync thread: once it is done, the frames written
    /// so far survive power loss. A sync that failed since the last call is counted now.
    pub fn sync(&mut self) {
        self.collect_synced();
        let Some(w) = self.writer.as_mut() else { return };
        if !w.dirty {
            return;
        }
        (w.dirty, w.synced) = (false, Instant::now());
        let to_ms = w.written_to_ms;
        match w.file.try_clone() {
            Ok(file) => {
                // The thread is gone only if it panicked: sync here instead.
                if let Err(std::sync::mpsc::SendError((file, _))) = w.syncer.requests.send((file, to_ms)) {
                    match file.sync_data() {
                        Ok(()) => w.durable_to_ms = to_ms,
                        Err(e) => self.failed(anyhow::Error::new(e).context("fdatasync")),
                    }
                }
            }
            Err(e) => self.failed(anyhow::Error::new(e).context("fdatasync")),
        }
    }

    /// Syncs on this thread: before a segment is left for a new one, and when the store closes.
    /// Always syncs: a sync asked of the thread may not have run yet, and one of a file with
    /// nothing unsynced costs next to nothing.
    fn sync_now(&mut self) {
        self.collect_synced();
        let Some(w) = self.writer.as_mut() else { return };
        (w.dirty, w.synced) = (false, Instant::now());
        match w.file.sync_data() {
            Ok(()) => w.durable_to_ms = w.written_to_ms,
            Err(e) => self.failed(anyhow::Error::new(e).context("fdatasync")),
        }
    }

    /// What the sync thread has done: the newest frame it made durable, and an error to count.
    fn collect_synced(&mut self) {
        let Some(w) = self.writer.as_mut() else { return };
        let (to_ms, error) = {
            let mut d = w.syncer.done.lock().unwrap_or_else(|e| e.into_inner());
            (d.0, d.1.take())
        };
        w.durable_to_ms = w.durable_to_ms.max(to_ms);
        if let Some(e) = error {
            self.failed(anyhow::anyhow!(e).context("fdatasync"));
        }
    }

    /// One record, written whole or not at all: a partial write is cut off again.
    fn write(&mut self, kind: u8, payload: &[u8]) -> Result<u64> {
        let w = self.writer.as_mut().expect("a store opened to write");
        let seg = &mut self.segments[w.segment];
        let mut record = Vec::with_capacity(RECORD_HEAD + payload.len());
        record.extend_from_slice(&(payload.len() as u32 + 1).to_le_bytes());
        record.extend_from_slice(&checksum(kind, payload).to_le_bytes());
        record.push(kind);
        record.extend_from_slice(payload);
        let offset = seg.bytes;
        if let Err(e) = w.file.write_all(&record) {
            let _ = w.file.set_len(offset);
            return Err(anyhow::Error::new(e).context(format!("write {}", seg.path.display())));
        }
        seg.bytes += record.len() as u64;
        Ok(offset)
    }

    /// A new segment when the newest is full or an hour old, then the bounds applied.
    fn rotate(&mut self, start_ms: u64) -> Result<()> {
        let w = self.writer.as_ref().expect("a store opened to write");
        let seg = &self.segments[w.segment];
        let first = seg.frames.first().map_or(start_ms, |e| e.start_ms);
        if seg.bytes < self.limits.segment_bytes() && start_ms < first + SEGMENT_SPAN_MS {
            return Ok(());
        }
        self.sync_now();
        let (segment, file) = self.segment_for_writing(Some(start_ms))?;
        let w = self.writer.as_mut().expect("a store opened to write");
        (w.segment, w.file, w.devices) = (segment, file, HashSet::new());
        self.remove_old();
        Ok(())
    }

    /// Removes the oldest segments past the retention, or while the newest could not grow to
    /// a full segment within the size bound (never the newest).
    fn remove_old(&mut self) {
        let newest = self.span().map_or(0, |s| s.1);
        let keep_from = newest.saturating_sub(self.limits.retention.as_millis() as u64);
        while self.segments.len() > 1 {
            let total: u64 = self.segments.iter().map(|s| s.bytes).sum();
            let old = &self.segments[0];
            let too_old = old.frames.last().is_none_or(|e| e.end_ms <= keep_from);
            let too_big = total + self.limits.segment_bytes() > self.limits.max_bytes;
            if !too_old && !too_big {
                break;
            }
            if let Err(e) = std::fs::remove_file(&old.path) {
                tracing::warn!("cannot remove the old store segment {}: {e}", old.path.display());
                break;
            }
            self.segments.remove(0);
            self.health.segments_removed += 1;
            if let Some(w) = self.writer.as_mut() {
                w.segment -= 1;
            }
        }
    }

    /// The span of the stored frames, `[start_ms, end_ms)`.
    pub fn span(&self) -> Option<(u64, u64)> {
        let mut frames = self.segments.iter().flat_map(|s| &s.frames);
        let first = frames.next()?.start_ms;
        let last = self.segments.iter().rev().find_map(|s| s.frames.last())?.end_ms;
        Some((first, last))
    }

    pub fn frame_count(&self) -> usize {
        self.segments.iter().map(|s| s.frames.len()).sum()
    }

    pub fn bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.bytes).sum()
    }

    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// The end of the newest frame synced to the disk.
    pub fn durable_to_ms(&self) -> Option<u64> {
        let w = self.writer.as_ref()?;
        Some(w.durable_to_ms.max(w.syncer.done.lock().unwrap_or_else(|e| e.into_inner()).0))
    }

    /// The newest agent start the store records (its kernel and host name the history).
    pub fn newest_start(&self) -> Option<&Start> {
        self.starts.iter().max_by_key(|s| s.started_ms)
    }

    /// Every device the store names, as it was when written.
    pub fn devices(&self) -> impl Iterator<Item = &Device> {
        self.devices.values()
    }

    /// The frames that overlap `[from_ms, to_ms)`, read from disk. A frame that no longer
    /// checks is counted and left out.
    pub fn frames(&mut self, from_ms: u64, to_ms: u64) -> Vec<Frame> {
        let (frames, bad) = self.plan_frames(from_ms, to_ms).frames();
        self.count_unreadable(bad);
        frames
    }

    /// The frames that overlap `[from_ms, to_ms)`, to read later.
    pub fn plan_frames(&self, from_ms: u64, to_ms: u64) -> Reads {
        self.plan(KIND_FRAME, |seg| {
            seg.frames
                .iter()
                .filter(|e| e.end_ms > from_ms && e.start_ms < to_ms)
                .map(|e| (e.offset, e.len))
                .collect()
        })
    }

    /// The minutes of slowest IOs that overlap `[from_unix_s, to_unix_s)`, to read later.
    pub fn plan_slow(&self, from_unix_s: f64, to_unix_s: f64) -> Reads {
        self.plan(KIND_SLOW, |seg| {
            seg.slow
                .iter()
                .filter(|e| {
                    (e.minute_unix_s + 60) as f64 > from_unix_s && (e.minute_unix_s as f64) < to_unix_s
                })
                .map(|e| (e.offset, e.len))
                .collect()
        })
    }

    fn plan(&self, kind: u8, wanted: impl Fn(&Segment) -> Vec<(u64, u32)>) -> Reads {
        let mut reads = Reads { kind, ..Default::default() };
        for seg in &self.segments {
            let places = wanted(seg);
            if places.is_empty() {
                continue;
            }
            match File::open(&seg.path) {
                Ok(file) => reads.files.push((file, places)),
                Err(_) => reads.unopened += places.len() as u64,
            }
        }
        reads
    }

    /// Counts what a read found damaged.
    pub fn count_unreadable(&mut self, bad: Unreadable) {
        self.health.damaged_records += bad.records;
        self.health.unreadable_bytes += bad.bytes;
    }

    /// The stretches inside `[from_ms, to_ms)` with no frame because no agent ran: from the
    /// end of the last frame before each agent start to the first frame after it.
    pub fn gaps(&self, from_ms: u64, to_ms: u64) -> Vec<Gap> {
        let entries: Vec<&Entry> = self.segments.iter().flat_map(|s| &s.frames).collect();
        let mut gaps = Vec::new();
        for start in &self.starts {
            let before = entries.iter().rev().find(|e| e.end_ms <= start.started_ms).map(|e| e.end_ms);
            let after = entries.iter().find(|e| e.start_ms >= start.started_ms).map(|e| e.start_ms);
            let Some(before) = before else { continue };
            let gap = Gap { from_ms: before, to_ms: after.unwrap_or(start.started_ms) };
            if gap.to_ms > from_ms && gap.from_ms < to_ms && gap.to_ms > gap.from_ms && !gaps.contains(&gap) {
                gaps.push(gap);
            }
        }
        gaps
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.sync_now();
    }
}

/// Takes the store's lock file, so that two agents never write one store.
fn lock(dir: &Path) -> Result<File> {
    let path = dir.join("lock");
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: flock on an open descriptor.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        bail!(
            "the recorder's store {} is in use by another tracerd (pid {}): stop it, or give this agent \
             another [store] path",
            dir.display(),
            holder.trim()
        );
    }
    file.set_len(0)?;
    file.write_all(format!("{}\n", std::process::id()).as_bytes())?;
    Ok(file)
}

/// `frames-<ms>.tdr` → ms.
fn segment_ms(name: &str) -> Option<u64> {
    name.strip_prefix("frames-")?.strip_suffix(".tdr")?.parse().ok()
}

fn checksum(kind: u8, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&[kind]);
    h.update(payload);
    h.finalize()
}

/// The record at `at` if it is whole and checks: (kind, payload).
fn record_at(bytes: &[u8], at: usize) -> Option<(u8, &[u8])> {
    let head = bytes.get(at..at + RECORD_HEAD)?;
    let len = u32::from_le_bytes(head[..4].try_into().unwrap());
    if len == 0 || len > MAX_RECORD {
        return None;
    }
    let crc = u32::from_le_bytes(head[4..8].try_into().unwrap());
    let payload = bytes.get(at + RECORD_HEAD..at + 8 + len as usize)?;
    let kind = head[8];
    (checksum(kind, payload) == crc).then_some((kind, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{aggregate::Lost, op::Op, recorder::FrameBuilder};

    fn dir() -> PathBuf {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("tracerd-store-test-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn frame(start_ms: u64, requests: u64) -> Frame {
        let mut b = FrameBuilder::default();
        let counted = tracer_common::SeriesAgg { requests, bytes: 4096 * requests, ..Default::default() };
        b.add_kernel(7 << 20, Op::Read, &counted);
        b.seal(start_ms, start_ms + 1000, &Lost::default())
    }

    fn device() -> Device {
        Device { name: "loop7".into(), dev: 7 << 20, disk: "loop7".into(), ..Default::default() }
    }

    fn requests(frames: &[Frame]) -> u64 {
        frames.iter().flat_map(|f| f.decode().unwrap().series).map(|(_, s)| s.requests).sum()
    }

    fn start(started_ms: u64) -> Start {
        Start { started_ms, pid: 1, tracerd_version: "0".into(), kernel: "k".into(), host: "h".into() }
    }

    fn limits(d: &Path) -> StoreLimits {
        StoreLimits::new(d.to_path_buf())
    }

    #[test]
    fn frames_devices_and_starts_read_back_after_reopening() {
        let d = dir();
        let mut s = Store::open(limits(&d)).unwrap();
        s.start(start(1_000));
        for i in 0..10 {
            s.append(&frame(1_000 + i * 1000, i + 1), &[device()]);
        }
        drop(s);
        let mut s = Store::open_read_only(&d).unwrap();
        assert_eq!(s.span(), Some((1_000, 11_000)));
        assert_eq!(requests(&s.frames(0, u64::MAX)), 55);
        assert_eq!(requests(&s.frames(3_500, 5_000)), 3 + 4);
        assert_eq!(s.devices().collect::<Vec<_>>(), vec![&device()]);
        assert_eq!(s.starts, vec![start(1_000)]);
        assert_eq!(s.health, StoreHealth::default());
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Writes to /dev/full fail as a full disk's do (ENOSPC).
    #[test]
    fn an_outage_ends_only_after_a_minute_of_writes_without_a_failure() {
        let d = dir();
        let mut s = Store::open(limits(&d)).unwrap();
        let path = s.segments[0].path.clone();
        let full = || OpenOptions::new().write(true).open("/dev/full").unwrap();
        let segment = || OpenOptions::new().append(true).open(&path).unwrap();
        s.append(&frame(0, 1), &[device()]);
        s.writer.as_mut().unwrap().file = full();
        s.append(&frame(1000, 2), &[device()]);
        assert_eq!((s.health.frames_not_stored, s.health.write_errors), (1, 1));
        assert!(s.health.failing.as_deref().is_some_and(|e| e.contains("No space left")), "{:?}", s.health);
        // A record that fits, then one that does not: still the one outage.
        s.writer.as_mut().unwrap().file = segment();
        s.append(&frame(2000, 4), &[device()]);
        assert!(s.health.failing.is_some());
        s.writer.as_mut().unwrap().file = full();
        s.append(&frame(3000, 8), &[device()]);
        assert_eq!((s.health.frames_not_stored, s.health.write_errors), (2, 2));
        // Space again: writable once frames have been written for a minute.
        s.writer.as_mut().unwrap().file = segment();
        let again = Instant::now();
        s.append(&frame(4000, 16), &[device()]);
        s.written(again + WRITABLE_AFTER - Duration::from_secs(1));
        assert!(s.health.failing.is_some());
        s.written(again + WRITABLE_AFTER + Duration::from_secs(1));
        assert_eq!(s.health.failing, None);
        assert_eq!((s.health.frames_not_stored, s.health.write_errors), (2, 2));
        drop(s);
        let mut s = Store::open_read_only(&d).unwrap();
        assert_eq!(requests(&s.frames(0, u64::MAX)), 1 + 4 + 16);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_torn_tail_is_cut_off_and_counted_and_writing_goes_on_after_it() {
        let d = dir();
        let mut s = Store::open(limits(&d)).unwrap();
        for i in 0..3 {
            s.append(&frame(i * 1000, 1), &[device()]);
        }
        let path = s.segments[0].path.clone();
        drop(s);
        // A frame record cut short, as a kill in the middle of write(2) leaves it.
        let whole = std::fs::read(&path).unwrap();
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&whole[whole.len() - 20..whole.len() - 5]).unwrap();
        let mut s = Store::open(limits(&d)).unwrap();
        assert_eq!(s.health.torn_tails, 1);
        assert_eq!(s.health.unreadable_bytes, 15);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), whole.len() as u64);
        s.append(&frame(3000, 1), &[device()]);
        drop(s);
        let mut s = Store::open_read_only(&d).unwrap();
        assert_eq!(requests(&s.frames(0, u64::MAX)), 4);
        assert_eq!(s.health, StoreHealth::default());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn damaged_bytes_are_skipped_to_the_next_record_and_counted() {
        let d = dir();
        let mut s = Store::open(limits(&d)).unwrap();
        for i in 0..5 {
            s.append(&frame(i * 1000, 1), &[device()]);
        }
        let (path, third) = (s.segments[0].path.clone(), s.segments[0].frames[2]);
        drop(s);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[third.offset as usize + RECORD_HEAD + 20] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let mut s = Store::open_read_only(&d).unwrap();
        assert_eq!(s.health.damaged_records, 1);
        assert_eq!(s.health.torn_tails, 0);
        assert_eq!(s.frame_count(), 4);
        assert_eq!(requests(&s.frames(0, u64::MAX)), 4);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_segment_of_another_format_is_refused_by_name() {
        let d = dir();
        let mut s = Store::open(limits(&d)).unwrap();
        s.append(&frame(0, 1), &[device()]);
        let path = s.segments[0].path.clone();
        drop(s);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let e = format!("{:#}", Store::open_read_only(&d).unwrap_err());
        let reads = format!("reads formats 1 to {FORMAT_VERSION}");
        assert!(
            e.contains(&format!("written in store format {}", FORMAT_VERSION + 1)) && e.contains(&reads),
            "{e}"
        );
        let e = format!("{:#}", Store::open(limits(&d)).unwrap_err());
        assert!(e.contains("move the store aside"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A store of format 1 (before the slowest IOs were kept): its frames are read, a record of
    /// a kind format 1 never had is damage there, and an agent writes on in a new segment.
    #[test]
    fn a_format_1_store_is_read_and_written_on_in_a_new_segment() {
        let d = dir();
        let mut s = Store::open(limits(&d)).unwrap();
        s.start(start(0));
        s.append(&frame(0, 3), &[device()]);
        s.append_slow(&[slow_minute(0, 50_000)]);
        let path = s.segments[0].path.clone();
        drop(s);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let mut s = Store::open(limits(&d)).unwrap();
        assert_eq!(s.health.damaged_records, 1, "a slow record in format 1 is not data");
        assert_eq!(requests(&s.frames(0, u64::MAX)), 3);
        s.append(&frame(1000, 4), &[device()]);
        s.append_slow(&[slow_minute(60, 70_000)]);
        assert_eq!(s.segment_count(), 2, "format 1 is never appended to");
        drop(s);
        let mut s = Store::open_read_only(&d).unwrap();
        assert_eq!(requests(&s.frames(0, u64::MAX)), 7);
        let (slow, bad) = s.plan_slow(0.0, 1e12).slow_minutes();
        assert_eq!((slow.len(), slow[0].ios[0].took_ns, bad), (1, 70_000, Unreadable::default()));
        std::fs::remove_dir_all(&d).unwrap();
    }

    fn slow_minute(minute_unix_s: u64, took_ns: u64) -> SlowMinute {
        let io = serde_json::value::to_raw_value(&serde_json::json!({ "took": took_ns })).unwrap();
        SlowMinute {
            device: "loop7".into(),
            minute_unix_s,
            ios: vec![crate::model::slowest::SlowIo { took_ns, io }],
        }
    }

    #[test]
    fn slowest_minutes_read_back_by_window_and_their_damage_is_counted() {
        let d = dir();
        let mut s = Store::open(limits(&d)).unwrap();
        s.append(&frame(0, 1), &[device()]);
        for m in 0..5 {
            s.append_slow(&[slow_minute(m * 60, 10_000 + m)]);
        }
        let third = s.segments[0].slow[2];
        let path = s.segments[0].path.clone();
        drop(s);
        let mut s = Store::open_read_only(&d).unwrap();
        let (slow, _) = s.plan_slow(90.0, 180.0).slow_minutes();
        let minutes: Vec<u64> = slow.iter().map(|m| m.minute_unix_s).collect();
        assert_eq!(minutes, vec![60, 120], "the minutes that overlap [90, 180)");
        // Damage after the store was opened: found by the read, counted, never returned.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[third.offset as usize + RECORD_HEAD + 10] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let (slow, bad) = s.plan_slow(0.0, 1e12).slow_minutes();
        assert_eq!((slow.len(), bad.records), (4, 1));
        s.count_unreadable(bad);
        assert_eq!(s.health.damaged_records, 1);
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Syncs run on the store's thread: what was written becomes durable without the writer
    /// waiting, and a store closed syncs the rest itself.
    #[test]
    fn frames_become_durable_on_the_sync_thread() {
        let d = dir();
        let mut l = limits(&d);
        l.sync_every = Duration::from_millis(1);
        let mut s = Store::open(l).unwrap();
        s.append(&frame(0, 1), &[device()]);
        std::thread::sleep(Duration::from_millis(5));
        s.append(&frame(1000, 1), &[device()]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.durable_to_ms() != Some(2000) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(s.durable_to_ms(), Some(2000));
        assert_eq!(s.health.write_errors, 0);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_second_writer_is_refused_while_the_first_holds_the_store() {
        let d = dir();
        let s = Store::open(limits(&d)).unwrap();
        let e = format!("{:#}", Store::open(limits(&d)).unwrap_err());
        assert!(
            e.contains("in use by another tracerd") && e.contains(&std::process::id().to_string()),
            "{e}"
        );
        drop(s);
        Store::open(limits(&d)).unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn segments_rotate_hourly_and_the_oldest_go_past_the_retention() {
        let d = dir();
        let mut l = limits(&d);
        l.retention = Duration::from_secs(2 * 3600);
        let mut s = Store::open(l.clone()).unwrap();
        // A frame every 10 minutes for 5 hours.
        for i in 0..30 {
            s.append(&frame(i * 600_000, 1), &[device()]);
        }
        // Segments go when a new one begins: as hour 4 began, hours 0 and 1 had ended more
        // than 2 h before the newest frame.
        assert_eq!(s.segment_count(), 3, "{:?}", s.segments);
        assert_eq!(s.health.segments_removed, 2);
        drop(s);
        let mut s = Store::open_read_only(&d).unwrap();
        let frames = s.frames(0, u64::MAX);
        assert_eq!(frames.first().unwrap().start_ms, 2 * 3_600_000);
        // Every segment names its devices itself.
        assert_eq!(s.devices().count(), 1);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_size_bound_removes_the_oldest_segments() {
        let d = dir();
        let mut l = limits(&d);
        l.max_bytes = 1 << 20;
        let mut s = Store::open(l).unwrap();
        let big = |start| {
            let mut b = FrameBuilder::default();
            for dev in 0..400 {
                let counted = tracer_common::SeriesAgg { requests: 1, ..Default::default() };
                b.add_kernel(dev, Op::Read, &counted);
            }
            b.seal(start, start + 1000, &Lost::default())
        };
        for i in 0..2000 {
            s.append(&big(i * 1000), &[]);
        }
        // Within the bound, give or take the frame that filled the newest segment.
        assert!(s.bytes() <= (1 << 20) + big(0).data().len() as u64 + 64, "{} bytes", s.bytes());
        assert!(s.health.segments_removed > 0);
        assert_eq!(s.span().unwrap().1, 2_000_000);
        drop(s);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn gaps_lie_between_the_last_frame_before_a_start_and_the_first_after() {
        let d = dir();
        let mut s = Store::open(limits(&d)).unwrap();
        s.start(start(0));
        s.append(&frame(0, 1), &[device()]);
        s.append(&frame(1000, 1), &[device()]);
        s.start(start(5_500));
        s.append(&frame(6_000, 1), &[device()]);
        assert_eq!(s.gaps(0, 10_000), vec![Gap { from_ms: 2_000, to_ms: 6_000 }]);
        assert_eq!(s.gaps(6_500, 10_000), vec![]);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
