//! Block devices from sysfs: kernel name, `dev_t`, disk/partition relation, request-based or not.
//! The one place that turns a major:minor into the name users see.

use std::{
    collections::HashMap,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};

/// Kernel-internal `dev_t` (what the programs read from `bd_dev`): major << 20 | minor.
pub fn kernel_dev(major: u32, minor: u32) -> u32 {
    (major << 20) | minor
}

pub fn major_minor(dev: u32) -> (u32, u32) {
    (dev >> 20, dev & 0xf_ffff)
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Device {
    /// Kernel name (`loop0`, `loop0p1`, `nvme0n1`, `dm-0`).
    pub name: String,
    pub dev: u32,
    /// The whole disk: itself for a disk, the parent for a partition.
    pub disk: String,
    pub partition: bool,
    /// blk-mq (request-based): has `mq/` in sysfs.
    pub request_based: bool,
    /// Devices below this one (`slaves/`): an md array's members, a dm table's devices.
    pub lowers: Vec<String>,
    /// Devices stacked on this one (`holders/`).
    pub uppers: Vec<String>,
    /// device-mapper name (`dm/name`), e.g. `lin0`.
    pub dm_name: Option<String>,
    /// md RAID level (`md/level`), e.g. `raid1`.
    pub md_level: Option<String>,
}

impl Device {
    /// `dm-0 (lin0)`, `md0 (raid1)`, `loop0`.
    pub fn label(&self) -> String {
        match (&self.dm_name, &self.md_level) {
            (Some(n), _) => format!("{} ({n})", self.name),
            (None, Some(level)) => format!("{} ({level})", self.name),
            _ => self.name.clone(),
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Topology {
    devices: HashMap<u32, Device>,
}

impl Topology {
    pub fn scan() -> Result<Topology> {
        Topology::scan_root(Path::new("/sys"))
    }

    /// Scans `<root>/class/block` (a real or a test sysfs tree).
    pub fn scan_root(root: &Path) -> Result<Topology> {
        let class = root.join("class/block");
        let entries = fs::read_dir(&class)
            .with_context(|| format!("cannot list block devices in {}", class.display()))?;
        let mut devices = HashMap::new();
        for entry in entries.flatten() {
            // Devices can vanish while we look; skip those.
            if let Ok(device) = read_device(&entry.path()) {
                devices.insert(device.dev, device);
            }
        }
        Ok(Topology { devices })
    }

    /// A topology of known devices (the recorder's: devices as they were when seen).
    pub fn from_devices(devices: impl IntoIterator<Item = Device>) -> Topology {
        Topology { devices: devices.into_iter().map(|d| (d.dev, d)).collect() }
    }

    pub fn get(&self, dev: u32) -> Option<&Device> {
        self.devices.get(&dev)
    }

    pub fn by_name(&self, name: &str) -> Option<&Device> {
        let name = name.strip_prefix("/dev/").unwrap_or(name);
        self.devices.values().find(|d| d.name == name)
    }

    /// The device a name typed by a person means: a kernel name (`dm-0`, with or without
    /// `/dev/`), a device-mapper name (`vg-lv`, `/dev/mapper/vg-lv`: LVM's names), or a path to
    /// the device node or a link to one (`/dev/md/home`, `/dev/disk/by-id/...`), matched by
    /// its device number.
    pub fn find(&self, name: &str) -> Option<&Device> {
        if let Some(d) = self.by_name(name) {
            return Some(d);
        }
        let bare = name.strip_prefix("/dev/mapper/").unwrap_or(name);
        if let Some(d) = self.devices.values().find(|d| d.dm_name.as_deref() == Some(bare)) {
            return Some(d);
        }
        if !name.starts_with('/') {
            return None;
        }
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let node = fs::metadata(name).ok().filter(|m| m.file_type().is_block_device())?;
        let rdev = node.rdev();
        // glibc's major()/minor() encoding of dev_t.
        let major = ((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff);
        let minor = (rdev & 0xff) | ((rdev >> 12) & !0xff);
        self.get(kernel_dev(major as u32, minor as u32))
    }

    /// The names `find` takes, for error messages: kernel names, with device-mapper names
    /// beside theirs (`lin0 (dm-0)`).
    pub fn accepted_names(&self) -> String {
        let mut names = self.names();
        let mut dm: Vec<String> = self
            .devices
            .values()
            .filter_map(|d| Some(format!("{} ({})", d.dm_name.as_ref()?, d.name)))
            .collect();
        dm.sort();
        names.extend(dm);
        names.join(", ")
    }

    pub fn devices(&self) -> impl Iterator<Item = &Device> {
        self.devices.values()
    }

    pub fn partitions_of<'a>(&'a self, disk: &'a str) -> impl Iterator<Item = &'a Device> {
        self.devices.values().filter(move |d| d.partition && d.disk == disk)
    }

    /// Name for a `dev_t`: the kernel name, or `major:minor` for a device sysfs no longer has.
    pub fn name_of(&self, dev: u32) -> String {
        match self.get(dev) {
            Some(d) => d.name.clone(),
            None => {
                let (major, minor) = major_minor(dev);
                format!("{major}:{minor}")
            }
        }
    }

    /// The device and every device below it, recursively (a stack's members).
    pub fn with_lowers(&self, name: &str) -> Vec<&Device> {
        let mut out: Vec<&Device> = Vec::new();
        let mut todo = vec![name.to_owned()];
        while let Some(n) = todo.pop() {
            if let Some(d) = self.by_name(&n) {
                if out.iter().any(|o| o.dev == d.dev) {
                    continue;
                }
                todo.extend(d.lowers.iter().cloned());
                out.push(d);
            }
        }
        out
    }

    /// Sorted names, for error messages.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.devices.values().map(|d| d.name.clone()).collect();
        names.sort();
        names
    }
}

fn read_device(link: &Path) -> Result<Device> {
    let path: PathBuf = fs::canonicalize(link)?;
    let name = path.file_name().context("no name")?.to_string_lossy().into_owned();
    let dev = fs::read_to_string(path.join("dev"))?;
    let Some((major, minor)) = dev.trim().split_once(':') else {
        bail!("bad dev file for {name}: {dev:?}");
    };
    let partition = path.join("partition").exists();
    let disk_path = if partition { path.parent().context("partition without disk")? } else { &path };
    let disk = disk_path.file_name().context("no disk name")?.to_string_lossy().into_owned();
    let text = |p: PathBuf| fs::read_to_string(p).ok().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty());
    let names_in = |dir: &str| {
        let mut v: Vec<String> = fs::read_dir(path.join(dir))
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        v.sort();
        v
    };
    let (lowers, uppers) = (names_in("slaves"), names_in("holders"));
    Ok(Device {
        dev: kernel_dev(major.parse()?, minor.parse()?),
        disk,
        partition,
        request_based: disk_path.join("mq").is_dir(),
        lowers,
        uppers,
        dm_name: text(path.join("dm/name")),
        md_level: text(path.join("md/level")),
        name,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A fake sysfs: (name, "maj:min", parent disk or None, blk-mq).
    pub fn fake_sysfs(devices: &[(&str, &str, Option<&str>, bool)]) -> tempdir::Dir {
        fake_stacked_sysfs(devices, &[])
    }

    /// (name, "maj:min", lowers, dm name, md level).
    pub type FakeStacked<'a> = (&'a str, &'a str, &'a [&'a str], Option<&'a str>, Option<&'a str>);

    /// Like `fake_sysfs`, plus stacked devices: (name, "maj:min", lowers, dm name, md level).
    pub fn fake_stacked_sysfs(
        devices: &[(&str, &str, Option<&str>, bool)],
        stacked: &[FakeStacked],
    ) -> tempdir::Dir {
        let dir = tempdir::Dir::new();
        fs::create_dir_all(dir.0.join("class/block")).unwrap();
        for &(name, dev, parent, mq) in devices {
            let path = match parent {
                Some(p) => dir.0.join("devices").join(p).join(name),
                None => dir.0.join("devices").join(name),
            };
            fs::create_dir_all(&path).unwrap();
            fs::write(path.join("dev"), format!("{dev}\n")).unwrap();
            if parent.is_some() {
                fs::write(path.join("partition"), "1\n").unwrap();
            }
            if mq {
                fs::create_dir_all(path.join("mq")).unwrap();
            }
            symlink(&path, dir.0.join("class/block").join(name)).unwrap();
        }
        for &(name, dev, lowers, dm_name, md_level) in stacked {
            let path = dir.0.join("devices/virtual").join(name);
            fs::create_dir_all(path.join("slaves")).unwrap();
            fs::write(path.join("dev"), format!("{dev}\n")).unwrap();
            for l in lowers {
                symlink(dir.0.join("devices").join(l), path.join("slaves").join(l)).unwrap();
                let holders = dir.0.join("devices").join(l).join("holders");
                fs::create_dir_all(&holders).unwrap();
                symlink(&path, holders.join(name)).unwrap();
            }
            if let Some(n) = dm_name {
                fs::create_dir_all(path.join("dm")).unwrap();
                fs::write(path.join("dm/name"), format!("{n}\n")).unwrap();
            }
            if let Some(level) = md_level {
                fs::create_dir_all(path.join("md")).unwrap();
                fs::write(path.join("md/level"), format!("{level}\n")).unwrap();
            }
            symlink(&path, dir.0.join("class/block").join(name)).unwrap();
        }
        dir
    }

    pub mod tempdir {
        use std::path::PathBuf;
        pub struct Dir(pub PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "tracerd-test-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn disks_and_partitions_from_sysfs() {
        let dir = fake_sysfs(&[
            ("loop0", "7:0", None, true),
            ("loop0p1", "259:0", Some("loop0"), false),
            ("md0", "9:0", None, false),
        ]);
        let t = Topology::scan_root(&dir.0).unwrap();
        let p = t.by_name("/dev/loop0p1").unwrap();
        assert_eq!(p.disk, "loop0");
        assert!(p.partition && p.request_based);
        assert_eq!(p.dev, kernel_dev(259, 0));
        assert!(!t.by_name("md0").unwrap().request_based);
        assert_eq!(t.partitions_of("loop0").count(), 1);
        assert_eq!(t.name_of(kernel_dev(7, 0)), "loop0");
        assert_eq!(t.name_of(kernel_dev(8, 16)), "8:16");
        assert_eq!(t.names(), vec!["loop0", "loop0p1", "md0"]);
    }

    #[test]
    fn stacks_from_slaves_dm_and_md() {
        let dir = fake_stacked_sysfs(
            &[("ram0", "1:0", None, false), ("ram1", "1:1", None, false), ("ram2", "1:2", None, false)],
            &[
                ("md0", "9:0", &["ram0", "ram1"], None, Some("raid1")),
                ("dm-0", "253:0", &["ram2"], Some("lin0"), None),
                ("dm-1", "253:1", &["md0"], Some("top"), None),
            ],
        );
        let t = Topology::scan_root(&dir.0).unwrap();
        assert_eq!(t.by_name("md0").unwrap().lowers, vec!["ram0", "ram1"]);
        assert_eq!(t.by_name("ram0").unwrap().uppers, vec!["md0"]);
        assert_eq!(t.by_name("md0").unwrap().label(), "md0 (raid1)");
        assert_eq!(t.by_name("dm-0").unwrap().label(), "dm-0 (lin0)");
        let mut stack: Vec<&str> = t.with_lowers("dm-1").iter().map(|d| d.name.as_str()).collect();
        stack.sort();
        assert_eq!(stack, vec!["dm-1", "md0", "ram0", "ram1"]);
        // Names as people type them: dm names bare or under /dev/mapper, kernel names with /dev/.
        for (typed, kernel) in
            [("top", "dm-1"), ("/dev/mapper/top", "dm-1"), ("lin0", "dm-0"), ("/dev/md0", "md0")]
        {
            assert_eq!(t.find(typed).map(|d| d.name.as_str()), Some(kernel), "{typed}");
        }
        assert!(t.find("top0").is_none() && t.find("/dev/mapper/nothing").is_none());
        assert!(t.find("/nonexistent/node").is_none(), "a path that is not a block device node");
        let names = t.accepted_names();
        assert!(names.contains("ram2, lin0 (dm-0), top (dm-1)"), "{names}");
    }

    #[test]
    fn dev_t_encoding_round_trips() {
        assert_eq!(major_minor(kernel_dev(259, 3)), (259, 3));
        assert_eq!(kernel_dev(7, 1), 7 << 20 | 1);
    }
}
