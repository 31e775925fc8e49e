//! Writing the store: records appended whole, each segment naming what its frames use, syncs
//! on a thread of their own, and failed writes counted, an outage warned of once.

use std::{
    collections::HashSet,
    fs::{File, OpenOptions},
    io::{Read, Write},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use super::{
    Start, Store, StoredFrame, StoredName, StoredSlowList, format,
    segment::{Entry, SlowEntry},
};

/// How long a failing store must write without a failure to be called writable again. A disk
/// at the edge of full takes a small record and refuses the next: an outage is warned of once
/// and ends once, not at every record that happens to fit.
const WRITABLE_AFTER: Duration = Duration::from_secs(60);

/// The open segment the agent appends to.
#[derive(Debug)]
pub(super) struct Writer {
    file: File,
    /// The segment's index in `segments`.
    pub segment: usize,
    /// Names already written into this segment (by key), so that each segment names its own.
    names: HashSet<u32>,
    synced: Instant,
    dirty: bool,
    /// The end of the newest frame known synced.
    durable_to_ms: u64,
    written_to_ms: u64,
    syncer: Syncer,
    _lock: File,
}

impl Writer {
    pub fn new(file: File, segment: usize, durable_to_ms: u64, lock: File) -> Result<Writer> {
        Ok(Writer {
            file,
            segment,
            names: HashSet::new(),
            synced: Instant::now(),
            dirty: false,
            durable_to_ms,
            written_to_ms: durable_to_ms,
            syncer: Syncer::start(durable_to_ms)?,
            _lock: lock,
        })
    }

    /// Appends to a new segment from now on.
    pub fn begin(&mut self, segment: usize, file: File) {
        (self.segment, self.file, self.names) = (segment, file, HashSet::new());
    }
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

impl Store {
    /// Records an agent's start: views mark the gap before it.
    pub fn start(&mut self, start: Start) {
        let payload = serde_json::to_vec(&start).expect("a start encodes");
        if self.write(format::KIND_START, &payload).is_ok() {
            self.starts.push(start);
        }
    }

    /// Writes a sealed frame, after the names it uses that this segment has not named yet;
    /// returns those names, written. A failed write (a full disk) is counted and warned of
    /// once; the next frame tries again.
    pub fn append<'n, F: StoredFrame, N: StoredName>(&mut self, frame: &F, names: &'n [N]) -> Vec<&'n N> {
        let (start_ms, end_ms) = frame.span_ms();
        if let Err(e) = self.rotate(start_ms) {
            self.health.frames_not_stored += 1;
            self.failed(e);
            return Vec::new();
        }
        let w = self.writer.as_mut().expect("a store opened to write");
        let new: Vec<&N> = names.iter().filter(|n| !w.names.contains(&n.key())).collect();
        if !new.is_empty() {
            if let Err(e) = self.write(format::KIND_NAMES, &N::encode(&new)) {
                self.health.frames_not_stored += 1;
                self.failed(e);
                return Vec::new();
            }
            let w = self.writer.as_mut().expect("a store opened to write");
            w.names.extend(new.iter().map(|n| n.key()));
        }
        let payload = format::frame_payload(start_ms, end_ms, frame.data());
        match self.write(format::KIND_FRAME, &payload) {
            Ok(offset) => {
                let seg = self.writer.as_ref().expect("a store opened to write").segment;
                self.segments[seg].frames.push(Entry { start_ms, end_ms, offset, len: payload.len() as u32 });
                self.written(Instant::now());
                let w = self.writer.as_mut().expect("a store opened to write");
                w.written_to_ms = end_ms;
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
        new
    }

    /// Writes minutes of the slowest IOs as the agent files them. A failed write is counted
    /// and warned of as a frame's is.
    pub fn append_slow<M: StoredSlowList>(&mut self, minutes: &[M]) {
        for m in minutes {
            let minute_unix_s = m.minute_unix_s();
            let payload = format::slow_payload(minute_unix_s, &m.encode());
            match self.write(format::KIND_SLOW, &payload) {
                Ok(offset) => {
                    let w = self.writer.as_mut().expect("a store opened to write");
                    w.dirty = true;
                    let entry = SlowEntry { minute_unix_s, offset, len: payload.len() as u32 };
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
    pub(super) fn sync_now(&mut self) {
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
        let record = format::record(kind, payload);
        let offset = seg.bytes;
        if let Err(e) = w.file.write_all(&record) {
            let _ = w.file.set_len(offset);
            return Err(anyhow::Error::new(e).context(format!("write {}", seg.path.display())));
        }
        seg.bytes += record.len() as u64;
        Ok(offset)
    }

    /// The end of the newest frame synced to the disk.
    pub fn durable_to_ms(&self) -> Option<u64> {
        let w = self.writer.as_ref()?;
        Some(w.durable_to_ms.max(w.syncer.done.lock().unwrap_or_else(|e| e.into_inner()).0))
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.sync_now();
    }
}

/// Takes the store's lock file, so that two agents never write one store.
pub(super) fn lock(dir: &Path) -> Result<File> {
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

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

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
}
