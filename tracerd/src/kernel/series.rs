//! The in-kernel aggregation's series (`tracer_common::agg`): which device has which series,
//! and folding the kernel's per-CPU counters into differences the daemon adds to its
//! histograms. Series go to devices as they first do IO, while any are free; a device without
//! one goes on as records. Their number is set at load from the devices traced ([`capacity`]).

use std::collections::HashMap;

use anyhow::{Context, Result};
use aya::{
    Ebpf,
    maps::{Array, PerCpuArray, PerCpuValues},
    util::nr_cpus,
};
use tracer_common::{SeriesAgg, agg, limits, names};

/// What the series may take per CPU, all devices together: 192 devices' reads and writes.
pub const SERIES_BYTES_PER_CPU: usize = 1 << 20;

/// The bytes of one device's series (a read and a write) on one CPU.
pub fn bytes_per_device() -> usize {
    std::mem::size_of::<SeriesAgg>() * agg::OPS as usize
}

/// Devices to size the series for, with `targets` devices traced at start: each of them and half
/// as many again for devices that appear later, at least [`limits::SERIES_DEVICES`], at most
/// what [`SERIES_BYTES_PER_CPU`] holds. The kernel allocates them per CPU at load.
pub fn capacity(targets: usize) -> u32 {
    let wanted = u32::try_from(targets.saturating_add(targets / 2)).unwrap_or(u32::MAX);
    wanted.clamp(limits::SERIES_DEVICES, most())
}

/// The most devices the series are ever sized for: what [`SERIES_BYTES_PER_CPU`] holds.
pub fn most() -> u32 {
    ((SERIES_BYTES_PER_CPU / bytes_per_device()) as u32).min(limits::MAX_DEVICES)
}

/// Indices of traced devices into `SERIES_OF` (1-based, reused after a device goes).
#[derive(Debug, Default)]
pub struct DeviceIndex {
    of: HashMap<u32, u32>,
    free: Vec<u32>,
    next: u32,
}

impl DeviceIndex {
    /// An index for `dev`; None when all `MAX_DEVICES` are taken.
    pub fn take(&mut self, dev: u32) -> Option<u32> {
        let index = match self.free.pop() {
            Some(i) => i,
            None if self.next < limits::MAX_DEVICES => {
                self.next += 1;
                self.next
            }
            None => return None,
        };
        self.of.insert(dev, index);
        Some(index)
    }

    pub fn get(&self, dev: u32) -> Option<u32> {
        self.of.get(&dev).copied()
    }

    pub fn free(&mut self, dev: u32) {
        if let Some(i) = self.of.remove(&dev) {
            self.free.push(i);
        }
    }
}

/// The series given out, and what each had counted at the last fold.
#[derive(Debug)]
pub struct SeriesTable {
    /// Series (0-based) -> the device it counts for.
    owner: Vec<Option<u32>>,
    by_dev: HashMap<u32, u32>,
    /// Totals over CPUs at the last fold, per SERIES entry.
    last: Vec<SeriesAgg>,
    /// Devices refused a series because none was free (logged once each).
    pub refused: u64,
}

impl SeriesTable {
    pub fn new(devices: u32) -> SeriesTable {
        SeriesTable {
            owner: vec![None; devices as usize],
            by_dev: HashMap::new(),
            last: vec![SeriesAgg::default(); (devices * agg::OPS) as usize],
            refused: 0,
        }
    }

    /// (series in use, capacity), in devices.
    pub fn usage(&self) -> (usize, usize) {
        (self.by_dev.len(), self.owner.len())
    }

    pub fn has(&self, dev: u32) -> bool {
        self.by_dev.contains_key(&dev)
    }

    /// `dev`'s series as the kernel numbers it (1-based, `SERIES_OF`).
    pub fn series_of(&self, dev: u32) -> Option<u32> {
        self.by_dev.get(&dev).map(|s| s + 1)
    }

    /// Gives `dev` (device index `index`) a free series: zeroes its counters, then points the
    /// kernel at it. True if it has one now.
    pub fn give(&mut self, ebpf: &mut Ebpf, dev: u32, index: u32) -> Result<bool> {
        if self.has(dev) {
            return Ok(true);
        }
        let Some(free) = self.owner.iter().position(Option::is_none) else {
            if self.refused == 0 {
                tracing::warn!(
                    "all {} in-kernel series are in use: further devices are traced as records \
                     (each IO crosses the ring buffer, which costs more CPU)",
                    self.owner.len()
                );
            }
            self.refused += 1;
            return Ok(false);
        };
        {
            let mut series: PerCpuArray<_, SeriesAgg> =
                PerCpuArray::try_from(ebpf.map_mut(names::SERIES).context("SERIES map")?)?;
            let cpus = nr_cpus().map_err(|(_, e)| e)?;
            for op in 0..agg::OPS {
                let i = free as u32 * agg::OPS + op;
                let zeros = PerCpuValues::try_from(vec![SeriesAgg::default(); cpus])?;
                series.set(i, zeros, 0)?;
                self.last[i as usize] = SeriesAgg::default();
            }
        }
        set_series_of(ebpf, index, free as u32 + 1)?;
        self.owner[free] = Some(dev);
        self.by_dev.insert(dev, free as u32);
        Ok(true)
    }

    /// Points the kernel at no series for the device at `index`; the series keeps its owner,
    /// so the next fold still reads what it counted.
    pub fn stop(&mut self, ebpf: &mut Ebpf, index: u32) -> Result<()> {
        set_series_of(ebpf, index, 0)
    }

    /// Takes `dev`'s series back (the device is no longer traced).
    pub fn release(&mut self, ebpf: &mut Ebpf, dev: u32, index: Option<u32>) -> Result<()> {
        if let Some(series) = self.by_dev.remove(&dev) {
            self.owner[series as usize] = None;
        }
        // Whatever it was, the index may go to another device: it must start with no series.
        if let Some(index) = index {
            set_series_of(ebpf, index, 0)?;
        }
        Ok(())
    }

    /// Calls `f(dev, op, counted)` with what each series counted since the last fold.
    pub fn fold(&mut self, ebpf: &Ebpf, mut f: impl FnMut(u32, u32, &SeriesAgg)) -> Result<()> {
        let series: PerCpuArray<_, SeriesAgg> =
            PerCpuArray::try_from(ebpf.map(names::SERIES).context("SERIES map")?)?;
        for (s, owner) in self.owner.iter().enumerate() {
            let Some(dev) = owner else { continue };
            for op in 0..agg::OPS {
                let i = s as u32 * agg::OPS + op;
                let per_cpu = series.get(&i, 0)?;
                let total = per_cpu.iter().fold(SeriesAgg::default(), |t, c| t.wrapping_add(c));
                let delta = total.wrapping_sub(&self.last[i as usize]);
                self.last[i as usize] = total;
                if delta.requests != 0 {
                    f(*dev, op, &delta);
                }
            }
        }
        Ok(())
    }
}

fn set_series_of(ebpf: &mut Ebpf, index: u32, series: u32) -> Result<()> {
    let mut of: Array<_, u32> = Array::try_from(ebpf.map_mut(names::SERIES_OF).context("SERIES_OF map")?)?;
    of.set(index, series, 0)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_are_sized_to_the_devices_within_a_bound_per_cpu() {
        assert_eq!(capacity(0), limits::SERIES_DEVICES);
        assert_eq!(capacity(20), limits::SERIES_DEVICES, "a small host keeps the minimum");
        assert_eq!(capacity(60), 90, "60 busy disks, and half as many again");
        let most = capacity(100_000);
        assert!(most as usize * bytes_per_device() <= SERIES_BYTES_PER_CPU);
        assert!((most as usize + 1) * bytes_per_device() > SERIES_BYTES_PER_CPU, "the bound is used");
        assert_eq!(most, 192, "{} bytes per device and CPU", bytes_per_device());
    }
}
