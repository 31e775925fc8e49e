//! Segment files: the index of one, a new one when the newest is full or an hour old, and the
//! oldest removed past the retention or the size bound.

use std::{
    fs::{File, OpenOptions},
    io::Write,
    path::PathBuf,
};

use anyhow::{Context, Result};

use super::{Store, StoreLimits, format};

const SEGMENT_SPAN_MS: u64 = 3_600_000;

/// One frame's place on disk.
#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    pub start_ms: u64,
    pub end_ms: u64,
    pub offset: u64,
    pub len: u32,
}

/// One device's minute of slowest IOs, on disk.
#[derive(Clone, Copy, Debug)]
pub(super) struct SlowEntry {
    pub minute_unix_s: u64,
    pub offset: u64,
    pub len: u32,
}

/// One segment file and the index of its records.
#[derive(Debug)]
pub(super) struct Segment {
    pub path: PathBuf,
    pub version: u32,
    pub bytes: u64,
    pub frames: Vec<Entry>,
    pub slow: Vec<SlowEntry>,
}

impl StoreLimits {
    /// A segment holds an hour, or less so that the oldest can go before the size bound.
    fn segment_bytes(&self) -> u64 {
        (self.max_bytes / 16).max(256 << 10)
    }
}

impl Store {
    /// The newest segment if it may take more frames starting at `start_ms`, else a new one.
    pub(super) fn segment_for_writing(&mut self, start_ms: Option<u64>) -> Result<(usize, File)> {
        if let Some(last) = self.segments.last() {
            let first = last.frames.first().map(|e| e.start_ms);
            // A segment of an older format is read, never written to.
            let fits = last.version == format::FORMAT_VERSION
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
        let newest =
            self.segments.last().and_then(|s| format::segment_ms(&s.path.file_name()?.to_string_lossy()));
        let ms = newest.map_or(ms, |n| ms.max(n + 1));
        let path = self.limits.dir.join(format::segment_name(ms));
        let mut file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        file.write_all(&format::header()).with_context(|| format!("cannot write {}", path.display()))?;
        self.segments.push(Segment {
            path,
            version: format::FORMAT_VERSION,
            bytes: format::HEADER_LEN,
            frames: Vec::new(),
            slow: Vec::new(),
        });
        Ok((self.segments.len() - 1, file))
    }

    /// A new segment when the newest is full or an hour old, then the bounds applied.
    pub(super) fn rotate(&mut self, start_ms: u64) -> Result<()> {
        let w = self.writer.as_ref().expect("a store opened to write");
        let seg = &self.segments[w.segment];
        let first = seg.frames.first().map_or(start_ms, |e| e.start_ms);
        if seg.bytes < self.limits.segment_bytes() && start_ms < first + SEGMENT_SPAN_MS {
            return Ok(());
        }
        self.sync_now();
        let (segment, file) = self.segment_for_writing(Some(start_ms))?;
        self.writer.as_mut().expect("a store opened to write").begin(segment, file);
        self.remove_old();
        Ok(())
    }

    /// Removes the oldest segments past the retention, or while the newest could not grow to
    /// a full segment within the size bound (never the newest).
    pub(super) fn remove_old(&mut self) {
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
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::{StoredFrame, testing::*};
    use super::*;

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
        let frames: Vec<TestFrame> = s.frames(0, u64::MAX);
        assert_eq!(frames.first().unwrap().start_ms, 2 * 3_600_000);
        // Every segment names its devices itself.
        assert_eq!(s.take_names::<Named>().len(), 1);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_size_bound_removes_the_oldest_segments() {
        let d = dir();
        let mut l = limits(&d);
        l.max_bytes = 1 << 20;
        let mut s = Store::open(l).unwrap();
        // As big as a frame of 400 series.
        let big = |start| TestFrame { start_ms: start, end_ms: start + 1000, data: vec![1; 7 << 10] };
        for i in 0..2000 {
            s.append(&big(i * 1000), &[] as &[Named]);
        }
        // Within the bound, give or take the frame that filled the newest segment.
        assert!(s.bytes() <= (1 << 20) + big(0).data().len() as u64 + 64, "{} bytes", s.bytes());
        assert!(s.health.segments_removed > 0);
        assert_eq!(s.span().unwrap().1, 2_000_000);
        drop(s);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
