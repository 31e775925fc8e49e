//! The in-kernel aggregation's per-cgroup series (`CGROUP_SERIES`, `CGROUP_AGG`), used while
//! the agent labels series by cgroup. A (cgroup, device, op) key gets a series when a record of
//! it arrives, while any is free; a key with no IO for a while gives its series back, so that
//! short-lived cgroups do not hold them. Labels are applied when the daemon folds: ranking,
//! `other` and expiry work from the counts per cgroup id.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use aya::{
    Ebpf,
    maps::{HashMap as BpfHashMap, PerCpuArray, PerCpuValues},
    util::nr_cpus,
};
use tracer_common::{CgroupSeriesKey, SeriesAgg, names};

use crate::kernel::series::{SERIES_BYTES_PER_CPU, bytes_per_device};

/// A key with no IO for this long gives its series back (at most `expire_after` of the labels).
pub const IDLE: Duration = Duration::from_secs(30);

/// The (cgroup, device, op) series the kernel keeps: what [`SERIES_BYTES_PER_CPU`] holds.
pub fn capacity() -> u32 {
    (SERIES_BYTES_PER_CPU / (bytes_per_device() / tracer_common::agg::OPS as usize)) as u32
}

/// Who a per-cgroup series counts for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CgroupOf {
    pub dev: u32,
    /// `agg::READ` or `agg::WRITE`.
    pub op: u32,
    pub cgroup: u64,
    /// The id is the submitting task's (v2) rather than the bio's blkcg.
    pub task: bool,
}

#[derive(Debug)]
struct Given {
    index: u32,
    of: CgroupOf,
    /// Totals over CPUs at the last fold.
    last: SeriesAgg,
    last_io: Instant,
}

/// The per-cgroup series given out, and those taken back but not yet read a last time.
#[derive(Debug)]
pub struct CgroupSeriesTable {
    capacity: u32,
    free: Vec<u32>,
    given: HashMap<CgroupSeriesKey, Given>,
    /// Removed from the kernel's map: read once more at the next fold (a completion that found
    /// the key before it went may still count), then free.
    draining: Vec<Given>,
    idle: Duration,
    /// Keys refused a series because none was free.
    pub refused: u64,
}

impl CgroupSeriesTable {
    /// `capacity` series (0 when labels are off); a key idle for `idle` gives its series back.
    pub fn new(capacity: u32, idle: Duration) -> CgroupSeriesTable {
        CgroupSeriesTable {
            capacity,
            free: (0..capacity).rev().collect(),
            given: HashMap::new(),
            draining: Vec::new(),
            idle,
            refused: 0,
        }
    }

    /// (series in use, capacity).
    pub fn usage(&self) -> (usize, usize) {
        (self.given.len() + self.draining.len(), self.capacity as usize)
    }

    /// Gives the key a series: zeroes its counters, then puts the key in the kernel's map.
    /// False when none is free.
    pub fn give(&mut self, ebpf: &mut Ebpf, key: CgroupSeriesKey, of: CgroupOf) -> Result<bool> {
        if self.given.contains_key(&key) {
            return Ok(true);
        }
        let Some(index) = self.free.pop() else {
            if self.refused == 0 {
                tracing::warn!(
                    "all {} in-kernel cgroup series are in use: IO of further cgroups goes as \
                     records until some are idle for {} s",
                    self.capacity,
                    self.idle.as_secs()
                );
            }
            self.refused += 1;
            return Ok(false);
        };
        {
            let mut agg: PerCpuArray<_, SeriesAgg> =
                PerCpuArray::try_from(ebpf.map_mut(names::CGROUP_AGG).context("CGROUP_AGG map")?)?;
            let cpus = nr_cpus().map_err(|(_, e)| e)?;
            agg.set(index, PerCpuValues::try_from(vec![SeriesAgg::default(); cpus])?, 0)?;
        }
        let inserted = keys(ebpf)?.insert(key, index, 0);
        if let Err(e) = inserted {
            self.free.push(index);
            return Err(e).context("cannot give a cgroup its series in the kernel");
        }
        let last = SeriesAgg::default();
        self.given.insert(key, Given { index, of, last, last_io: Instant::now() });
        Ok(true)
    }

    /// Takes back every series of the device whose series is `series` (1-based): its IO goes
    /// as records, or it is no longer traced.
    pub fn release_device(&mut self, ebpf: &mut Ebpf, series: u32) -> Result<()> {
        let of_device: Vec<CgroupSeriesKey> =
            self.given.keys().filter(|k| k.series == series).copied().collect();
        self.take_back(ebpf, &of_device)
    }

    fn take_back(&mut self, ebpf: &mut Ebpf, which: &[CgroupSeriesKey]) -> Result<()> {
        if which.is_empty() {
            return Ok(());
        }
        let mut map = keys(ebpf)?;
        for key in which {
            // Already gone from the kernel's map is fine: it is taken back either way.
            let _ = map.remove(key);
            if let Some(g) = self.given.remove(key) {
                self.draining.push(g);
            }
        }
        Ok(())
    }

    /// Calls `f(of, counted)` with what each series counted since the last fold; series taken
    /// back at the last fold are read a last time and freed; series idle now are taken back.
    pub fn fold(
        &mut self,
        ebpf: &mut Ebpf,
        now: Instant,
        mut f: impl FnMut(&CgroupOf, &SeriesAgg),
    ) -> Result<()> {
        if self.given.is_empty() && self.draining.is_empty() {
            return Ok(());
        }
        let draining = std::mem::take(&mut self.draining);
        let mut idle = Vec::new();
        {
            let agg: PerCpuArray<_, SeriesAgg> =
                PerCpuArray::try_from(ebpf.map(names::CGROUP_AGG).context("CGROUP_AGG map")?)?;
            let mut read = |g: &mut Given| -> Result<()> {
                let per_cpu = agg.get(&g.index, 0)?;
                let total = per_cpu.iter().fold(SeriesAgg::default(), |t, c| t.wrapping_add(c));
                let delta = total.wrapping_sub(&g.last);
                g.last = total;
                if delta.requests != 0 {
                    g.last_io = now;
                    f(&g.of, &delta);
                }
                Ok(())
            };
            for (key, g) in self.given.iter_mut() {
                read(g)?;
                if now.duration_since(g.last_io) >= self.idle {
                    idle.push(*key);
                }
            }
            for mut g in draining {
                read(&mut g)?;
                self.free.push(g.index);
            }
        }
        self.take_back(ebpf, &idle)
    }
}

fn keys(ebpf: &mut Ebpf) -> Result<BpfHashMap<&mut aya::maps::MapData, CgroupSeriesKey, u32>> {
    Ok(BpfHashMap::try_from(ebpf.map_mut(names::CGROUP_SERIES).context("CGROUP_SERIES map")?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_series_fill_the_bytes_per_cpu_that_device_series_may_take() {
        let one = bytes_per_device() / tracer_common::agg::OPS as usize;
        assert!(capacity() as usize * one <= SERIES_BYTES_PER_CPU);
        assert!((capacity() as usize + 1) * one > SERIES_BYTES_PER_CPU);
        assert!(capacity() >= 300, "{} series of {one} bytes", capacity());
    }
}
