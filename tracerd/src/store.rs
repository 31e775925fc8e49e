//! The recorder's store on disk: its frames kept across agent restarts and reboots, read by
//! the agent's views and, offline, by `report --store`.
//!
//! An append-only format of our own, rather than an embedded database: a frame is already a
//! self-contained byte string written once and never changed, so a log of checksummed records
//! is all the store needs, and it can be read by a reader that trusts nothing in it.
//!
//! The store handles bytes and segments only: what a frame, a device name or a list of slowest
//! IOs holds is the model's to encode and decode (`StoredFrame`, `StoredName`,
//! `StoredSlowList`). It is a directory of segment files, `frames-<first ms>.tdr`, one per hour
//! of frames (or less, when the size bound asks), each a header and checksummed records
//! (`format`); `segment` creates, rotates and removes them, `writer` appends and syncs, and
//! `read` indexes them at open and reads windows back.
//!
//! Crash safety: every frame is written with one write(2) as it is sealed, so a killed agent
//! loses only the frame it was filling; the file is synced (fdatasync) every `sync_every`, so
//! power loss loses at most that much. A record cut short by a crash (a torn tail) is cut off
//! when the agent opens the store again; a damaged record elsewhere is skipped up to the next
//! record that checks. Both are counted, never read as data. A segment of format 1 is read
//! (it has no slowest IOs) and an agent writes on in a new segment; a segment of a format this
//! tracerd does not know is refused by name.

mod format;
mod read;
mod segment;
mod writer;

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

pub use format::FORMAT_VERSION;
pub use read::{Gap, Reads, Unreadable};
use segment::Segment;
use writer::Writer;

/// What the store needs of a frame: the span it is indexed by, and its bytes, which it keeps
/// as they are.
pub trait StoredFrame: Sized {
    /// `[start_ms, end_ms)`, wall-clock ms since the Unix epoch.
    fn span_ms(&self) -> (u64, u64);
    fn data(&self) -> &[u8];
    /// The frame again, from what the store kept.
    fn from_stored(start_ms: u64, end_ms: u64, data: &[u8]) -> Self;
}

/// What the store needs of a name the frames use (a device, by its `dev_t`). Each segment
/// holds the names of its frames, so that it reads alone.
pub trait StoredName: Sized {
    /// What the frames call it.
    fn key(&self) -> u32;
    /// The payload of one names record that holds `names`.
    fn encode(names: &[&Self]) -> Vec<u8>;
    /// What a names record holds; None when it does not decode (damage).
    fn decode(payload: &[u8]) -> Option<Vec<Self>>;
}

/// What the store needs of one device's slowest IOs of one minute.
pub trait StoredSlowList: Sized {
    /// The minute's start, in Unix seconds: what a window finds it by.
    fn minute_unix_s(&self) -> u64;
    fn encode(&self) -> Vec<u8>;
    /// None when the bytes do not decode (damage).
    fn decode(bytes: &[u8]) -> Option<Self>;
}

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

/// A store opened to read (`report --store`) or to write (the agent).
#[derive(Debug)]
pub struct Store {
    pub limits: StoreLimits,
    segments: Vec<Segment>,
    /// The names records read at open, until the model takes them (`take_names`).
    names: Vec<Vec<u8>>,
    starts: Vec<Start>,
    writer: Option<Writer>,
    pub health: StoreHealth,
    /// While writes fail: when the frames began to be written again.
    writing_since: Option<Instant>,
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
        let lock = writer::lock(&limits.dir)?;
        let mut store = Store::scan(limits, true)?;
        store.remove_old();
        let (segment, file) = store.segment_for_writing(None)?;
        let durable_to_ms = store.span().map_or(0, |s| s.1);
        store.writer = Some(Writer::new(file, segment, durable_to_ms, lock)?);
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

    /// The newest agent start the store records (its kernel and host name the history).
    pub fn newest_start(&self) -> Option<&Start> {
        self.starts.iter().max_by_key(|s| s.started_ms)
    }
}

/// Stand-ins for what the model stores, so that the store's tests need nothing of it: a frame
/// whose bytes carry its count of requests, names by key, and lists of slowest IOs.
#[cfg(test)]
mod testing {
    use super::*;

    pub fn dir() -> PathBuf {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("tracerd-store-test-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[derive(Clone, Debug, PartialEq)]
    pub struct TestFrame {
        pub start_ms: u64,
        pub end_ms: u64,
        pub data: Vec<u8>,
    }

    impl StoredFrame for TestFrame {
        fn span_ms(&self) -> (u64, u64) {
            (self.start_ms, self.end_ms)
        }

        fn data(&self) -> &[u8] {
            &self.data
        }

        fn from_stored(start_ms: u64, end_ms: u64, data: &[u8]) -> TestFrame {
            TestFrame { start_ms, end_ms, data: data.to_vec() }
        }
    }

    /// A frame of a second, about as long as one of a single series.
    pub fn frame(start_ms: u64, requests: u64) -> TestFrame {
        let mut data = requests.to_le_bytes().to_vec();
        data.resize(32, 0xa5);
        TestFrame { start_ms, end_ms: start_ms + 1000, data }
    }

    pub fn requests(frames: &[TestFrame]) -> u64 {
        frames.iter().map(|f| u64::from_le_bytes(f.data[..8].try_into().unwrap())).sum()
    }

    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
    pub struct Named {
        pub name: String,
        pub dev: u32,
    }

    impl StoredName for Named {
        fn key(&self) -> u32 {
            self.dev
        }

        fn encode(names: &[&Named]) -> Vec<u8> {
            serde_json::to_vec(names).unwrap()
        }

        fn decode(payload: &[u8]) -> Option<Vec<Named>> {
            serde_json::from_slice(payload).ok()
        }
    }

    pub fn device() -> Named {
        Named { name: "loop7".into(), dev: 7 << 20 }
    }

    #[derive(Clone, Debug, Serialize, Deserialize)]
    pub struct SlowIo {
        pub took_ns: u64,
    }

    #[derive(Clone, Debug, Serialize, Deserialize)]
    pub struct SlowMinute {
        pub device: String,
        pub minute_unix_s: u64,
        pub ios: Vec<SlowIo>,
    }

    impl StoredSlowList for SlowMinute {
        fn minute_unix_s(&self) -> u64 {
            self.minute_unix_s
        }

        fn encode(&self) -> Vec<u8> {
            serde_json::to_vec(self).unwrap()
        }

        fn decode(bytes: &[u8]) -> Option<SlowMinute> {
            serde_json::from_slice(bytes).ok()
        }
    }

    pub fn slow_minute(minute_unix_s: u64, took_ns: u64) -> SlowMinute {
        SlowMinute { device: "loop7".into(), minute_unix_s, ios: vec![SlowIo { took_ns }] }
    }

    pub fn start(started_ms: u64) -> Start {
        Start { started_ms, pid: 1, tracerd_version: "0".into(), kernel: "k".into(), host: "h".into() }
    }

    pub fn limits(d: &Path) -> StoreLimits {
        StoreLimits::new(d.to_path_buf())
    }
}
