//! Which devices are traced (`--device`, or every block device) and which traced device each
//! record counts towards. Partitions: IO submitted to a partition counts towards its disk,
//! unless the partition itself was named with `--device`, then towards the partition.
//! A named stacked device (md, dm) brings the devices below it, so its layers can be timed.

use std::collections::{HashMap, HashSet};

use anyhow::{Result, bail};
use tracer_common::IoRecord;

use crate::model::topology::{Device, Topology};

#[derive(Clone, Debug, Default)]
pub struct Selection {
    /// Device names from `--device` (or the config's `devices.include`); empty means every
    /// block device.
    pub names: Vec<String>,
    /// Devices never traced (`devices.exclude`, `--exclude`; `*` wildcards). An excluded disk
    /// takes its partitions with it: their IO counts towards it.
    pub exclude: Vec<String>,
}

/// A selection resolved against the current topology.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resolved {
    /// Devices that count as series of their own.
    targets: HashSet<u32>,
    /// Partition -> its disk.
    disk_of: HashMap<u32, u32>,
    /// Every `dev_t` the kernel side must trace (targets, plus partitions of target disks and
    /// disks of target partitions, whose requests carry the partition's IO).
    pub kernel_devs: HashSet<u32>,
    /// Traced devices below a traced stacked device (`holders/`) -> that upper device: their
    /// IO should name an upper IO.
    below: HashMap<u32, u32>,
    /// Traced NVMe multipath path disks: the kernel side links a head's bio moved to one.
    pub paths: HashSet<u32>,
}

impl Selection {
    pub fn resolve(&self, topo: &Topology) -> Result<Resolved> {
        let mut r = Resolved::default();
        for d in topo.devices().filter(|d| d.partition) {
            if let Some(disk) = topo.by_name(&d.disk) {
                r.disk_of.insert(d.dev, disk.dev);
            }
        }
        let excluded = |d: &Device| {
            self.exclude.iter().any(|p| {
                name_matches(p, &d.name)
                    || d.partition && name_matches(p, &d.disk)
                    || d.dm_name.as_ref().is_some_and(|n| name_matches(p, n))
            })
        };
        if self.names.is_empty() {
            for d in topo.devices().filter(|d| !excluded(d)) {
                r.kernel_devs.insert(d.dev);
                if !d.partition {
                    r.targets.insert(d.dev);
                }
            }
            r.find_stacks(topo);
            return Ok(r);
        }
        for name in &self.names {
            let Some(d) = topo.find(name) else {
                bail!(
                    "unknown block device '{name}': it is not in /sys/class/block. Known devices: {}. \
                     Name a device by its kernel name (loop0, nvme0n1), its device-mapper name \
                     (vg-lv, /dev/mapper/vg-lv), or a path to its node (/dev/md/NAME, /dev/disk/by-id/...).",
                    topo.accepted_names()
                );
            };
            if excluded(d) {
                bail!("device '{name}' is both named and excluded: drop it from one of the two");
            }
            for d in topo.with_lowers(&d.name).into_iter().filter(|d| !excluded(d)) {
                r.add_named(topo, d);
            }
        }
        r.find_stacks(topo);
        Ok(r)
    }
}

impl Resolved {
    /// Which traced devices lie below a traced stacked device.
    fn find_stacks(&mut self, topo: &Topology) {
        for d in topo.devices().filter(|d| self.kernel_devs.contains(&d.dev)) {
            if d.is_path() {
                self.paths.insert(d.dev);
            }
            let upper =
                d.uppers.iter().filter_map(|u| topo.by_name(u)).find(|u| self.targets.contains(&u.dev));
            if let Some(u) = upper {
                self.below.insert(d.dev, u.dev);
            }
        }
    }

    /// The traced stacked device `dev` lies below, if any (`dev` as IO is submitted to it: a
    /// partition where a stack is built on one).
    pub fn upper_of(&self, dev: u32) -> Option<u32> {
        self.below.get(&dev).copied()
    }

    /// A named device: its own series; the kernel also traces what carries its IO.
    fn add_named(&mut self, topo: &Topology, d: &Device) {
        self.targets.insert(d.dev);
        self.kernel_devs.insert(d.dev);
        if d.partition {
            if let Some(disk) = topo.by_name(&d.disk) {
                self.kernel_devs.insert(disk.dev);
            }
        } else {
            self.kernel_devs.extend(topo.partitions_of(&d.name).map(|p| p.dev));
        }
    }

    /// The traced device a record counts towards, or None if it belongs to no target.
    /// The devices that count as series of their own.
    pub fn targets(&self) -> impl Iterator<Item = u32> + '_ {
        self.targets.iter().copied()
    }

    /// Whether `dev` counts as a series of its own.
    pub fn is_target(&self, dev: u32) -> bool {
        self.targets.contains(&dev)
    }

    /// The series an IO queued on `dev` counts towards (its own, else its disk's).
    pub fn target_of_dev(&self, dev: u32) -> Option<u32> {
        if self.targets.contains(&dev) {
            return Some(dev);
        }
        let disk = *self.disk_of.get(&dev)?;
        self.targets.contains(&disk).then_some(disk)
    }

    pub fn target_of(&self, rec: &IoRecord) -> Option<u32> {
        if rec.dev != 0 && self.targets.contains(&rec.dev) {
            return Some(rec.dev);
        }
        let disk = if rec.disk != 0 { rec.disk } else { *self.disk_of.get(&rec.dev)? };
        self.targets.contains(&disk).then_some(disk)
    }
}

/// Whether a device name matches a pattern (`*` matches any run of characters; a leading
/// `/dev/` is ignored on both).
pub fn name_matches(pattern: &str, name: &str) -> bool {
    fn go(p: &[u8], n: &[u8]) -> bool {
        match p.split_first() {
            None => n.is_empty(),
            Some((b'*', rest)) => (0..=n.len()).any(|i| go(rest, &n[i..])),
            Some((c, rest)) => n.first() == Some(c) && go(rest, &n[1..]),
        }
    }
    let strip = |s: &str| s.strip_prefix("/dev/").unwrap_or(s).to_owned();
    go(strip(pattern).as_bytes(), strip(name).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::topology::{kernel_dev, tests::fake_sysfs};

    fn topo() -> (Topology, crate::model::topology::tests::tempdir::Dir) {
        let dir = fake_sysfs(&[
            ("loop0", "7:0", None, true),
            ("loop0p1", "259:0", Some("loop0"), false),
            ("loop1", "7:1", None, true),
        ]);
        (Topology::scan_root(&dir.0, &dir.0.join("diskstats")).unwrap(), dir)
    }

    fn rec(disk: u32, dev: u32) -> IoRecord {
        IoRecord { disk, dev, ..Default::default() }
    }

    #[test]
    fn everything_counts_partition_io_towards_the_disk() {
        let (t, _d) = topo();
        let r = Selection::default().resolve(&t).unwrap();
        let (loop0, p1, loop1) = (kernel_dev(7, 0), kernel_dev(259, 0), kernel_dev(7, 1));
        assert_eq!(r.kernel_devs.len(), 3);
        assert_eq!(r.target_of(&rec(loop0, p1)), Some(loop0));
        assert_eq!(r.target_of(&rec(loop1, loop1)), Some(loop1));
        // A merge record has no disk: found through the partition.
        assert_eq!(r.target_of(&rec(0, p1)), Some(loop0));
    }

    #[test]
    fn excluded_disks_take_their_partitions() {
        let (t, _d) = topo();
        let r = Selection { exclude: vec!["loop0".into()], ..Default::default() }.resolve(&t).unwrap();
        assert_eq!(r.kernel_devs, HashSet::from([kernel_dev(7, 1)]));
        let r = Selection { exclude: vec!["loop*".into()], ..Default::default() }.resolve(&t).unwrap();
        assert!(r.kernel_devs.is_empty());
        let named = Selection { names: vec!["loop1".into()], exclude: vec!["loop*".into()] };
        assert!(named.resolve(&t).unwrap_err().to_string().contains("both named and excluded"));
    }

    #[test]
    fn a_named_partition_is_its_own_series() {
        let (t, _d) = topo();
        let r = Selection { names: vec!["loop0p1".into()], ..Default::default() }.resolve(&t).unwrap();
        let (loop0, p1) = (kernel_dev(7, 0), kernel_dev(259, 0));
        assert!(r.kernel_devs.contains(&loop0) && r.kernel_devs.contains(&p1));
        assert_eq!(r.target_of(&rec(loop0, p1)), Some(p1));
        assert_eq!(r.target_of(&rec(loop0, loop0)), None);
        assert_eq!(r.target_of(&rec(kernel_dev(7, 1), 0)), None);
    }

    #[test]
    fn a_named_stack_brings_its_lower_devices() {
        use crate::model::topology::tests::fake_stacked_sysfs;
        let dir = fake_stacked_sysfs(
            &[("ram0", "1:0", None, false), ("ram1", "1:1", None, false), ("ram2", "1:2", None, false)],
            &[("md0", "9:0", &["ram0", "ram1"], None, Some("raid1"))],
        );
        let t = Topology::scan_root(&dir.0, &dir.0.join("diskstats")).unwrap();
        let r = Selection { names: vec!["md0".into()], ..Default::default() }.resolve(&t).unwrap();
        let want: HashSet<u32> = [kernel_dev(9, 0), kernel_dev(1, 0), kernel_dev(1, 1)].into();
        assert_eq!(r.kernel_devs, want);
        assert_eq!(r.target_of(&rec(0, kernel_dev(1, 1))), Some(kernel_dev(1, 1)));
        assert_eq!(r.target_of(&rec(0, kernel_dev(1, 2))), None);
    }

    #[test]
    fn unknown_devices_are_refused_with_the_known_list() {
        let (t, _d) = topo();
        let err = Selection { names: vec!["sdz".into()], ..Default::default() }
            .resolve(&t)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown block device 'sdz'") && err.contains("loop0, loop0p1, loop1"), "{err}");
    }

    #[test]
    fn patterns() {
        assert!(name_matches("loop*", "loop12"));
        assert!(name_matches("/dev/sda", "sda"));
        assert!(name_matches("*p1", "nvme0n1p1"));
        assert!(!name_matches("loop*", "nvme0n1"));
        assert!(!name_matches("sda", "sda1"));
    }
}
