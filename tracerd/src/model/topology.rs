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

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
    /// A hidden disk (sysfs `hidden`): an NVMe multipath path, which has no device node and
    /// no `dev` file; its number comes from /proc/diskstats.
    pub hidden: bool,
}

impl Device {
    /// `dm-0 (lin0)`, `md0 (raid1)`, `loop0`.
    pub fn label(&self) -> String {
        match (&self.dm_name, &self.md_level) {
            (Some(n), _) => format!("{} ({n})", self.name),
            (None, Some(level)) => format!("{} ({level})", self.name),
            _ if self.is_path() => format!("{} (path)", self.name),
            _ => self.name.clone(),
        }
    }

    /// A path disk of NVMe multipath, below its head.
    pub fn is_path(&self) -> bool {
        self.hidden && !self.uppers.is_empty()
    }
}

/// The head of an NVMe multipath path disk, by the kernel's names: path `nvme<S>c<C>n<N>`
/// (subsystem, controller, namespace head instance) serves head `nvme<S>n<N>`.
pub fn nvme_head_of(path: &str) -> Option<String> {
    let rest = path.strip_prefix("nvme")?;
    let (subsys, rest) = rest.split_once('c')?;
    let (ctrl, head) = rest.split_once('n')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(subsys) && digits(ctrl) && digits(head)).then(|| format!("nvme{subsys}n{head}"))
}

/// Device numbers by name from /proc/diskstats, which lists hidden disks too.
fn diskstats_devs(path: &Path) -> HashMap<String, u32> {
    let text = fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (major, minor, name) = (f.next()?.parse().ok()?, f.next()?.parse().ok()?, f.next()?);
            Some((name.to_owned(), kernel_dev(major, minor)))
        })
        .collect()
}

#[derive(Clone, Debug, Default)]
pub struct Topology {
    devices: HashMap<u32, Device>,
}

impl Topology {
    pub fn scan() -> Result<Topology> {
        Topology::scan_root(Path::new("/sys"), Path::new("/proc/diskstats"))
    }

    /// Scans `<sys>/class/block` (a real or a test sysfs tree); `diskstats` numbers the hidden
    /// disks, which sysfs does not.
    pub fn scan_root(sys: &Path, diskstats: &Path) -> Result<Topology> {
        let class = sys.join("class/block");
        let entries = fs::read_dir(&class)
            .with_context(|| format!("cannot list block devices in {}", class.display()))?;
        let mut hidden_devs = None;
        let mut devices = HashMap::new();
        for entry in entries.flatten() {
            // Devices can vanish while we look; skip those.
            if let Ok(device) =
                read_device(&entry.path(), || hidden_devs.get_or_insert_with(|| diskstats_devs(diskstats)))
            {
                devices.insert(device.dev, device);
            }
        }
        let mut topo = Topology { devices };
        topo.link_paths();
        Ok(topo)
    }

    /// NVMe multipath heads over their path disks: sysfs names no relation (no `slaves/`).
    fn link_paths(&mut self) {
        let pairs: Vec<(u32, String, String)> = self
            .devices
            .values()
            .filter(|d| d.hidden)
            .filter_map(|d| Some((d.dev, d.name.clone(), nvme_head_of(&d.name)?)))
            .collect();
        for (dev, path, head) in pairs {
            let Some(h) = self.devices.values_mut().find(|d| d.name == head) else { continue };
            if !h.lowers.contains(&path) {
                h.lowers.push(path);
                h.lowers.sort();
            }
            if let Some(p) = self.devices.get_mut(&dev) {
                p.uppers = vec![head];
            }
        }
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

fn read_device<'a>(link: &Path, hidden_devs: impl FnOnce() -> &'a HashMap<String, u32>) -> Result<Device> {
    let path: PathBuf = fs::canonicalize(link)?;
    let name = path.file_name().context("no name")?.to_string_lossy().into_owned();
    let hidden = fs::read_to_string(path.join("hidden")).is_ok_and(|s| s.trim() == "1");
    let dev = match fs::read_to_string(path.join("dev")) {
        Ok(dev) => {
            let Some((major, minor)) = dev.trim().split_once(':') else {
                bail!("bad dev file for {name}: {dev:?}");
            };
            kernel_dev(major.parse()?, minor.parse()?)
        }
        Err(_) if hidden => {
            *hidden_devs().get(&name).with_context(|| format!("{name} is not in diskstats"))?
        }
        Err(e) => return Err(e).with_context(|| format!("{name} has no dev file")),
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
        dev,
        hidden,
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
        let t = Topology::scan_root(&dir.0, &dir.0.join("diskstats")).unwrap();
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
        let t = Topology::scan_root(&dir.0, &dir.0.join("diskstats")).unwrap();
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
    fn nvme_paths_are_numbered_from_diskstats_and_sit_below_their_head() {
        let dir = fake_sysfs(&[("nvme0n1", "259:0", None, true), ("nvme1n1", "259:2", None, false)]);
        // Path disks are hidden: no `dev` file, no device node, no `slaves/` link to the head.
        for path in ["nvme1c1n1", "nvme1c2n1"] {
            let p = dir.0.join("devices").join(path);
            fs::create_dir_all(p.join("mq")).unwrap();
            fs::write(p.join("hidden"), "1\n").unwrap();
            symlink(&p, dir.0.join("class/block").join(path)).unwrap();
        }
        fs::write(
            dir.0.join("diskstats"),
            " 259       0 nvme0n1 3 0 24 8 0 0 0 0 0 8 8 0 0 0 0 0 0\n 259       1 nvme1c1n1 3 0 24 4 0 0 0 0 0 \
             12 4 0 0 0 0 0 0\n 259       2 nvme1n1 0 0 0 0 0 0 0 0 0 0 0\n 259       3 nvme1c2n1 0 0 0 0\n",
        )
        .unwrap();
        let t = Topology::scan_root(&dir.0, &dir.0.join("diskstats")).unwrap();
        let p1 = t.by_name("nvme1c1n1").expect("a hidden path disk is a device");
        assert_eq!((p1.dev, p1.hidden, p1.is_path()), (kernel_dev(259, 1), true, true));
        assert_eq!(p1.uppers, vec!["nvme1n1"]);
        assert_eq!(p1.label(), "nvme1c1n1 (path)");
        assert_eq!(t.by_name("nvme1c2n1").unwrap().dev, kernel_dev(259, 3));
        assert_eq!(t.by_name("nvme1n1").unwrap().lowers, vec!["nvme1c1n1", "nvme1c2n1"]);
        let mut stack: Vec<&str> = t.with_lowers("nvme1n1").iter().map(|d| d.name.as_str()).collect();
        stack.sort();
        assert_eq!(stack, vec!["nvme1c1n1", "nvme1c2n1", "nvme1n1"]);
        assert!(!t.by_name("nvme0n1").unwrap().is_path() && t.by_name("nvme0n1").unwrap().lowers.is_empty());
    }

    #[test]
    fn nvme_head_names() {
        assert_eq!(nvme_head_of("nvme1c2n1").as_deref(), Some("nvme1n1"));
        assert_eq!(nvme_head_of("nvme12c3n45").as_deref(), Some("nvme12n45"));
        for not_a_path in ["nvme0n1", "nvme0n1p1", "nvmec1n1", "nvme1c1n", "sda", "nvme1c1n1p2"] {
            assert_eq!(nvme_head_of(not_a_path), None, "{not_a_path}");
        }
    }

    #[test]
    fn dev_t_encoding_round_trips() {
        assert_eq!(major_minor(kernel_dev(259, 3)), (259, 3));
        assert_eq!(kernel_dev(7, 1), 7 << 20 | 1);
    }
}
