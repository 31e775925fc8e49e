//! Reading the store: each segment indexed at open (damaged records skipped, torn tails cut
//! off), windows of frames and of slowest-IO lists planned from the index and read later, and
//! the gaps where no agent ran.

use std::{
    collections::BTreeMap,
    fs::{File, OpenOptions},
    io::Read,
    os::unix::fs::FileExt,
    path::PathBuf,
};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use super::{
    Start, Store, StoreHealth, StoreLimits, StoredFrame, StoredName, StoredSlowList, format,
    format::{FORMAT_VERSION, OLDEST_READABLE, RECORD_HEAD, record_at},
    segment::{Entry, Segment, SlowEntry},
};

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

impl Unreadable {
    /// The record of this payload, counted as damaged: it checked, but did not decode.
    fn record(payload: &[u8]) -> Unreadable {
        Unreadable { records: 1, bytes: (RECORD_HEAD + payload.len()) as u64 }
    }

    fn add(&mut self, other: Unreadable) {
        self.records += other.records;
        self.bytes += other.bytes;
    }
}

/// A stretch of time inside a window without frames because no agent ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gap {
    pub from_ms: u64,
    pub to_ms: u64,
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
    pub fn frames<F: StoredFrame>(self) -> (Vec<F>, Unreadable) {
        let (payloads, bad) = self.payloads();
        let frames = payloads
            .into_iter()
            .map(|p| {
                let (start_ms, end_ms) = format::frame_span(&p).expect("indexed frames have their span");
                F::from_stored(start_ms, end_ms, &p[format::FRAME_TIMES..])
            })
            .collect();
        (frames, bad)
    }

    /// The minutes of slowest IOs; one that does not decode counts as damaged.
    pub fn slow_minutes<M: StoredSlowList>(self) -> (Vec<M>, Unreadable) {
        let (payloads, mut bad) = self.payloads();
        let mut out = Vec::new();
        for p in payloads {
            match M::decode(&p[format::SLOW_TIMES..]) {
                Some(m) => out.push(m),
                None => bad.add(Unreadable::record(&p)),
            }
        }
        (out, bad)
    }
}

impl Store {
    pub(super) fn scan(limits: StoreLimits, writable: bool) -> Result<Store> {
        let mut names: Vec<(u64, PathBuf)> = std::fs::read_dir(&limits.dir)
            .with_context(|| format!("cannot list the recorder's store {}", limits.dir.display()))?
            .filter_map(|e| e.ok())
            .filter_map(|e| format::segment_ms(&e.file_name().to_string_lossy()).map(|ms| (ms, e.path())))
            .collect();
        names.sort();
        let mut store = Store {
            limits,
            segments: Vec::new(),
            names: Vec::new(),
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
        let Some(version) = format::version_of(&bytes) else {
            // Not ours, or its header is gone: nothing in it can be trusted.
            tracing::warn!("{}: not a tracerd store segment (bad header); skipped", path.display());
            self.health.damaged_records += 1;
            self.health.unreadable_bytes += bytes.len() as u64;
            return Ok(());
        };
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
        let mut at = format::HEADER_LEN as usize;
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
            format::KIND_FRAME => match format::frame_span(payload) {
                Some((start_ms, end_ms)) => {
                    let entry = Entry { start_ms, end_ms, offset: at as u64, len: payload.len() as u32 };
                    segment.frames.push(entry);
                    true
                }
                None => false,
            },
            // Decoded when the model takes them (`take_names`).
            format::KIND_NAMES => {
                self.names.push(payload.to_vec());
                true
            }
            format::KIND_START => match serde_json::from_slice::<Start>(payload) {
                Ok(s) => {
                    self.starts.push(s);
                    true
                }
                Err(_) => false,
            },
            // Decoded when read: a window reads few of them.
            format::KIND_SLOW if segment.version >= 2 => match format::slow_minute(payload) {
                Some(minute_unix_s) => {
                    let entry = SlowEntry { minute_unix_s, offset: at as u64, len: payload.len() as u32 };
                    segment.slow.push(entry);
                    true
                }
                None => false,
            },
            // A kind this version does not know: a newer writer would have changed the version.
            _ => false,
        };
        if !ok {
            self.health.damaged_records += 1;
            self.health.unreadable_bytes += (RECORD_HEAD + payload.len()) as u64;
        }
    }

    /// Every name the store's frames use, as it was when written (the newest record of a key
    /// wins), decoded once: the names records read at open go to the caller. A record that
    /// does not decode is counted as damaged.
    pub fn take_names<N: StoredName>(&mut self) -> BTreeMap<u32, N> {
        let mut names = BTreeMap::new();
        for payload in std::mem::take(&mut self.names) {
            match N::decode(&payload) {
                Some(decoded) => names.extend(decoded.into_iter().map(|n| (n.key(), n))),
                None => self.count_unreadable(Unreadable::record(&payload)),
            }
        }
        names
    }

    /// The frames that overlap `[from_ms, to_ms)`, read from disk. A frame that no longer
    /// checks is counted and left out.
    pub fn frames<F: StoredFrame>(&mut self, from_ms: u64, to_ms: u64) -> Vec<F> {
        let (frames, bad) = self.plan_frames(from_ms, to_ms).frames();
        self.count_unreadable(bad);
        frames
    }

    /// The frames that overlap `[from_ms, to_ms)`, to read later.
    pub fn plan_frames(&self, from_ms: u64, to_ms: u64) -> Reads {
        self.plan(format::KIND_FRAME, |seg| {
            seg.frames
                .iter()
                .filter(|e| e.end_ms > from_ms && e.start_ms < to_ms)
                .map(|e| (e.offset, e.len))
                .collect()
        })
    }

    /// The minutes of slowest IOs that overlap `[from_unix_s, to_unix_s)`, to read later.
    pub fn plan_slow(&self, from_unix_s: f64, to_unix_s: f64) -> Reads {
        self.plan(format::KIND_SLOW, |seg| {
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

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::super::testing::*;
    use super::*;

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
        assert_eq!(s.take_names::<Named>().values().collect::<Vec<_>>(), vec![&device()]);
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
        let (slow, bad) = s.plan_slow(0.0, 1e12).slow_minutes::<SlowMinute>();
        assert_eq!((slow.len(), slow[0].ios[0].took_ns, bad), (1, 70_000, Unreadable::default()));
        std::fs::remove_dir_all(&d).unwrap();
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
        let (slow, _) = s.plan_slow(90.0, 180.0).slow_minutes::<SlowMinute>();
        let minutes: Vec<u64> = slow.iter().map(|m| m.minute_unix_s).collect();
        assert_eq!(minutes, vec![60, 120], "the minutes that overlap [90, 180)");
        // Damage after the store was opened: found by the read, counted, never returned.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[third.offset as usize + RECORD_HEAD + 10] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let (slow, bad) = s.plan_slow(0.0, 1e12).slow_minutes::<SlowMinute>();
        assert_eq!((slow.len(), bad.records), (4, 1));
        s.count_unreadable(bad);
        assert_eq!(s.health.damaged_records, 1);
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
