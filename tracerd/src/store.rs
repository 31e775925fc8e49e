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
//! frame's encoded bytes), the devices the following frames name (JSON), and an agent's start
//! (JSON), which marks a gap in the history.
//!
//! Crash safety: every frame is written with one write(2) as it is sealed, so a killed agent
//! loses only the frame it was filling; the file is synced (fdatasync) every `sync_every`, so
//! power loss loses at most that much. A record cut short by a crash (a torn tail) is cut off
//! when the agent opens the store again; a damaged record elsewhere is skipped up to the next
//! record that checks. Both are counted, never read as data. A segment of another format
//! version is refused by name.

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

use crate::model::{recorder::Frame, topology::Device};

/// The format this tracerd writes and reads.
pub const FORMAT_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"TRACERD\0";
const HEADER_LEN: u64 = 16;
/// len + crc + kind.
const RECORD_HEAD: usize = 9;
/// No record is larger: a length beyond it is damage, not data.
const MAX_RECORD: u32 = 64 << 20;
const KIND_FRAME: u8 = 1;
const KIND_DEVICES: u8 = 2;
const KIND_START: u8 = 3;
const SEGMENT_SPAN_MS: u64 = 3_600_000;

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
    pub write_errors: u64,
    /// The last write error, while writes fail.
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

#[derive(Debug)]
struct Segment {
    path: PathBuf,
    bytes: u64,
    frames: Vec<Entry>,
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
    _lock: File,
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
        store.writer = Some(Writer {
            file,
            segment,
            devices: HashSet::new(),
            synced: Instant::now(),
            dirty: false,
            durable_to_ms: store.span().map_or(0, |s| s.1),
            written_to_ms: store.span().map_or(0, |s| s.1),
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
        if version != FORMAT_VERSION {
            bail!(
                "{}: written in store format {version}, and this tracerd ({}) reads format {FORMAT_VERSION}: \
                 read it with a tracerd of that format, or move the store aside (or set [store] path) to start a new one",
                path.display(),
                env!("CARGO_PKG_VERSION")
            );
        }
        let mut segment = Segment { path, bytes: bytes.len() as u64, frames: Vec::new() };
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
                            tracing::warn!(
                                "{}: the last {skipped} bytes are an unfinished record (the agent stopped mid-write){}",
                                segment.path.display(),
                                if cut_tail { "; cut off" } else { "" }
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
            let fits = last.bytes < self.limits.segment_bytes()
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
        self.segments.push(Segment { path, bytes: HEADER_LEN, frames: Vec::new() });
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
            self.failed(e);
            return;
        }
        let w = self.writer.as_mut().expect("a store opened to write");
        let new: Vec<&Device> = devices.iter().filter(|d| !w.devices.contains(&d.dev)).collect();
        if !new.is_empty() {
            let payload = serde_json::to_vec(&new).expect("devices encode");
            if let Err(e) = self.write(KIND_DEVICES, &payload) {
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
                if let Some(e) = self.health.failing.take() {
                    tracing::warn!(
                        "the recorder's store {} takes frames again (after: {e}); {} frames were not stored",
                        self.limits.dir.display(),
                        self.health.frames_not_stored
                    );
                }
                let w = self.writer.as_mut().expect("a store opened to write");
                w.written_to_ms = frame.end_ms;
                w.dirty = true;
                if w.synced.elapsed() >= self.limits.sync_every {
                    self.sync();
                }
            }
            Err(e) => self.failed(e),
        }
    }

    fn failed(&mut self, e: anyhow::Error) {
        self.health.frames_not_stored += 1;
        self.health.write_errors += 1;
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

    /// Syncs what was written: frames up to `durable_to_ms` survive power loss.
    pub fn sync(&mut self) {
        let Some(w) = self.writer.as_mut() else { return };
        if !w.dirty {
            return;
        }
        match w.file.sync_data() {
            Ok(()) => {
                w.durable_to_ms = w.written_to_ms;
                w.dirty = false;
                w.synced = Instant::now();
            }
            Err(e) => {
                w.synced = Instant::now();
                self.failed(anyhow::Error::new(e).context("fdatasync"));
            }
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
        self.sync();
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
        self.writer.as_ref().map(|w| w.durable_to_ms)
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
        let mut out = Vec::new();
        for seg in &self.segments {
            let entries: Vec<&Entry> =
                seg.frames.iter().filter(|e| e.end_ms > from_ms && e.start_ms < to_ms).collect();
            if entries.is_empty() {
                continue;
            }
            let Ok(file) = File::open(&seg.path) else {
                self.health.damaged_records += entries.len() as u64;
                continue;
            };
            for e in entries {
                let mut record = vec![0; RECORD_HEAD + e.len as usize];
                let read =
                    file.read_exact_at(&mut record, e.offset).ok().and_then(|()| record_at(&record, 0));
                match read {
                    Some((KIND_FRAME, payload)) => {
                        out.push(Frame::from_parts(e.start_ms, e.end_ms, payload[16..].into()))
                    }
                    _ => {
                        self.health.damaged_records += 1;
                        self.health.unreadable_bytes += record.len() as u64;
                    }
                }
            }
        }
        out
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
        self.sync();
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
        bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let e = format!("{:#}", Store::open_read_only(&d).unwrap_err());
        assert!(e.contains("written in store format 2") && e.contains("reads format 1"), "{e}");
        let e = format!("{:#}", Store::open(limits(&d)).unwrap_err());
        assert!(e.contains("move the store aside"), "{e}");
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
