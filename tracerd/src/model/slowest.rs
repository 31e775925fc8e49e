//! The slowest IOs of each device, minute by minute, each kept whole (its `snoop --json` line):
//! part of the agent's flight recorder. The kernel aggregates most IOs without a record, so
//! the agent tells it, per device, how slow an IO must be to be sent anyway (`SLOW_NS`): the
//! entry bar of this minute's slowest list. Each minute starts with a low bar (10 µs), so no
//! slow IO is missed; once the list is full the bar is its last IO's time, and only rises. So
//! the kernel sends what completes before the agent first raises the bar (one read of the
//! ring buffer), then about `PER_MINUTE` times the log of the minute's IOs.

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::store::StoredSlowList;

/// Slow IOs kept per device and minute.
pub const PER_MINUTE: usize = 10;
use tracer_common::limits::SLOW_FLOOR_NS as FLOOR_NS;

/// One slow IO: how long it took (Q2C, else D2C) and its whole record as `snoop --json` shows it,
/// kept as its JSON text (a parsed value would take several times the memory).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SlowIo {
    pub took_ns: u64,
    pub io: Box<serde_json::value::RawValue>,
}

impl SlowIo {
    /// The record, parsed.
    pub fn io(&self) -> serde_json::Value {
        serde_json::from_str(self.io.get()).unwrap_or_default()
    }
}

/// One device's slowest IOs of one minute, slowest first.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SlowMinute {
    pub device: String,
    pub minute_unix_s: u64,
    pub ios: Vec<SlowIo>,
}

/// Kept in the store as its JSON.
impl StoredSlowList for SlowMinute {
    fn minute_unix_s(&self) -> u64 {
        self.minute_unix_s
    }

    fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a slow minute encodes")
    }

    fn decode(bytes: &[u8]) -> Option<SlowMinute> {
        serde_json::from_slice(bytes).ok()
    }
}

#[derive(Debug, Default)]
pub struct Slowest {
    minute: u64,
    /// This minute's slowest per device (`dev_t`: its name, the IOs slowest first).
    current: BTreeMap<u32, (String, Vec<SlowIo>)>,
    /// Earlier minutes, oldest first.
    history: VecDeque<SlowMinute>,
    /// Minutes kept (the recorder's retention).
    retention_minutes: u64,
    /// The bar the kernel has for each device (`dev_t`).
    bars: HashMap<u32, u64>,
    /// Bars to write to the kernel.
    pending: Vec<(u32, u64)>,
}

impl Slowest {
    pub fn new(retention_minutes: u64) -> Slowest {
        Slowest { retention_minutes: retention_minutes.max(1), ..Default::default() }
    }

    /// Starts the bar of a device the kernel aggregates.
    pub fn track(&mut self, dev: u32) {
        if let std::collections::hash_map::Entry::Vacant(bar) = self.bars.entry(dev) {
            bar.insert(FLOOR_NS);
            self.pending.push((dev, FLOOR_NS));
        }
    }

    /// Whether an IO this slow may enter `dev`'s list (cheap: before its line is built).
    pub fn wants(&self, dev: u32, took_ns: u64) -> bool {
        self.current.get(&dev).is_none_or(|(_, v)| v.len() < PER_MINUTE || took_ns > v[v.len() - 1].took_ns)
    }

    /// Takes an IO of `dev` (named `device`) that `wants` admitted; raises the kernel's bar
    /// once the minute's list is full.
    pub fn offer(&mut self, dev: u32, device: &str, took_ns: u64, io: &serde_json::Value) {
        let Ok(io) = serde_json::value::to_raw_value(io) else { return };
        let (_, list) = self.current.entry(dev).or_insert_with(|| (device.to_owned(), Vec::new()));
        let at = list.partition_point(|s| s.took_ns >= took_ns);
        list.insert(at, SlowIo { took_ns, io });
        list.truncate(PER_MINUTE);
        if list.len() == PER_MINUTE {
            let bar = list[PER_MINUTE - 1].took_ns + 1;
            if let Some(kernel_bar) = self.bars.get_mut(&dev)
                && *kernel_bar < bar
            {
                *kernel_bar = bar;
                self.pending.push((dev, bar));
            }
        }
    }

    /// Every second: a new minute files the last one and lowers every bar to the floor.
    /// Returns the minutes filed (for the store).
    pub fn tick(&mut self, now_ms: u64) -> Vec<SlowMinute> {
        let minute = now_ms / 60_000;
        if minute == self.minute {
            return Vec::new();
        }
        let filed = self.current();
        self.current.clear();
        self.history.extend(filed.iter().cloned());
        self.minute = minute;
        let keep_from = (minute * 60).saturating_sub(self.retention_minutes * 60);
        while self.history.front().is_some_and(|m| m.minute_unix_s < keep_from) {
            self.history.pop_front();
        }
        for (&dev, bar) in self.bars.iter_mut() {
            if *bar != FLOOR_NS {
                *bar = FLOOR_NS;
                self.pending.push((dev, FLOOR_NS));
            }
        }
        filed
    }

    /// This minute's lists so far (what an agent that stops files).
    pub fn current(&self) -> Vec<SlowMinute> {
        self.current
            .values()
            .map(|(device, ios)| SlowMinute {
                device: device.clone(),
                minute_unix_s: self.minute * 60,
                ios: ios.clone(),
            })
            .collect()
    }

    /// Bars to write to the kernel's `SLOW_NS`.
    pub fn take_pending(&mut self) -> Vec<(u32, u64)> {
        std::mem::take(&mut self.pending)
    }

    /// The minutes that overlap `[from_unix_s, to_unix_s)`, this one included.
    pub fn window(&self, from_unix_s: f64, to_unix_s: f64) -> Vec<SlowMinute> {
        self.history
            .iter()
            .cloned()
            .chain(self.current())
            .filter(|m| (m.minute_unix_s + 60) as f64 > from_unix_s && (m.minute_unix_s as f64) < to_unix_s)
            .collect()
    }
}

/// One list per device and minute: lists of the same minute (from the store and from memory,
/// or from two agents that each ran part of it) are joined, an IO found in both kept once, the
/// slowest `PER_MINUTE` kept. Ordered by minute, then device.
pub fn merge(minutes: Vec<SlowMinute>) -> Vec<SlowMinute> {
    let mut joined: BTreeMap<(u64, String), Vec<SlowIo>> = BTreeMap::new();
    for m in minutes {
        let list = joined.entry((m.minute_unix_s, m.device)).or_default();
        for io in m.ios {
            if !list.iter().any(|k| k.took_ns == io.took_ns && k.io.get() == io.io.get()) {
                list.push(io);
            }
        }
    }
    joined
        .into_iter()
        .map(|((minute_unix_s, device), mut ios)| {
            ios.sort_by_key(|s| std::cmp::Reverse(s.took_ns));
            ios.truncate(PER_MINUTE);
            SlowMinute { device, minute_unix_s, ios }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io(n: u64) -> serde_json::Value {
        serde_json::json!({ "sector": n })
    }

    #[test]
    fn keeps_the_slowest_and_raises_the_bar_once_full() {
        let mut s = Slowest::new(60);
        s.tick(60_000);
        s.track(7);
        assert_eq!(s.take_pending(), vec![(7, FLOOR_NS)]);
        for took in 1..=PER_MINUTE as u64 {
            assert!(s.wants(7, took * 20_000));
            s.offer(7, "loop0", took * 20_000, &io(took));
        }
        assert_eq!(s.take_pending(), vec![(7, 20_001)], "full: the 10th slowest + 1");
        for took in [50_000_000u64, 2_000_000, 3_000_000] {
            s.offer(7, "loop0", took, &io(took));
        }
        // Three slower ones pushed out 20, 40 and 60 µs: the 10th slowest is 80 µs.
        assert_eq!(s.take_pending().last(), Some(&(7, 80_001)));
        assert!(!s.wants(7, 80_000) && s.wants(7, 80_001));
        let w = s.window(0.0, f64::MAX);
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].ios[0].took_ns, 50_000_000, "slowest first");
        assert_eq!(w[0].ios.len(), PER_MINUTE);
    }

    #[test]
    fn minutes_of_two_sources_join_without_doubles() {
        let mut a = Slowest::new(60);
        a.tick(60_000);
        for took in [30_000u64, 10_000] {
            a.offer(7, "loop0", took, &io(took));
        }
        let stored = a.tick(120_000);
        assert_eq!((stored.len(), stored[0].minute_unix_s, stored[0].ios.len()), (1, 60, 2));
        // A second agent ran later in the same minute.
        let mut b = Slowest::new(60);
        b.tick(61_000);
        b.offer(7, "loop0", 20_000, &io(20_000));
        let mut all = stored.clone();
        all.extend(a.window(0.0, 200.0));
        all.extend(b.window(0.0, 200.0));
        let m = merge(all);
        assert_eq!(m.len(), 1, "{m:?}");
        let took: Vec<u64> = m[0].ios.iter().map(|s| s.took_ns).collect();
        assert_eq!(
            took,
            vec![30_000, 20_000, 10_000],
            "the store's and memory's copy once, both agents' IOs"
        );
    }

    #[test]
    fn minutes_are_filed_start_low_and_age_out() {
        let mut s = Slowest::new(2);
        s.tick(60_000);
        s.track(7);
        for took in 0..12u64 {
            s.offer(7, "loop0", 2_000_000 + took, &io(took));
        }
        assert_eq!(s.take_pending().last(), Some(&(7, 2_000_002 + 1)));
        s.tick(61_000);
        assert_eq!(s.take_pending(), vec![], "the same minute: the bar stays");
        s.tick(120_000);
        assert_eq!(s.take_pending(), vec![(7, FLOOR_NS)], "a new minute starts low");
        let w = s.window(60.0, 120.0);
        assert_eq!((w.len(), w[0].minute_unix_s, w[0].ios.len()), (1, 60, PER_MINUTE));
        assert!(s.window(120.0, 180.0).is_empty(), "the new minute has nothing yet");
        s.tick(240_000);
        s.tick(300_000);
        assert!(s.window(0.0, 400.0).is_empty(), "older than the retention");
    }

    #[test]
    fn filed_minutes_read_back_from_the_store_whole() {
        use crate::store::{Store, StoreLimits, Unreadable};
        let d = std::env::temp_dir().join(format!("tracerd-slowest-store-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let mut s = Slowest::new(60);
        s.tick(60_000);
        s.offer(7, "loop0", 70_000, &io(3));
        let filed = s.tick(120_000);
        let mut store = Store::open(StoreLimits::new(d.clone())).unwrap();
        store.append_slow(&filed);
        drop(store);
        let store = Store::open_read_only(&d).unwrap();
        let (read, bad) = store.plan_slow(0.0, 1e12).slow_minutes::<SlowMinute>();
        assert_eq!(bad, Unreadable::default());
        assert_eq!((read.len(), read[0].device.as_str(), read[0].minute_unix_s), (1, "loop0", 60));
        assert_eq!((read[0].ios[0].took_ns, read[0].ios[0].io()), (70_000, io(3)));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
