//! The cgroups IOs are charged to, by name: the kernel programs give a cgroup id (a kernfs
//! node id) and say whose it is (the bio's blkcg, or the submitting task's v2 cgroup); this
//! finds the cgroup's path in the hierarchy the id belongs to.
//!
//! The io controller's hierarchy is v2 where the host mounts only v2, or v1 blkio where the
//! host still mounts it (ids of two hierarchies are unrelated: each root is 1). A path is found
//! by opening the id as a kernfs file handle (one call, as systemd and bpftool do), or, where
//! that is refused (no CAP_DAC_READ_SEARCH), by walking the hierarchy's directories: a
//! cgroup's inode number is its id.

use std::{
    collections::HashMap,
    ffi::CString,
    os::unix::{ffi::OsStrExt, fs::MetadataExt},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use tracer_common::{IoRecord, flag};

use crate::model::cgroups::Named;

/// Where the cgroup hierarchies are mounted (from /proc/self/mountinfo).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Mounts {
    /// The unified (v2) hierarchy.
    pub v2: Option<PathBuf>,
    /// The v1 hierarchy with the blkio controller, where the host mounts one.
    pub blkio_v1: Option<PathBuf>,
}

/// Which hierarchy a cgroup id belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Hierarchy {
    V2,
    BlkioV1,
}

impl Mounts {
    pub fn detect() -> Mounts {
        std::fs::read_to_string("/proc/self/mountinfo").map(|m| Mounts::parse(&m)).unwrap_or_default()
    }

    /// Reads mountinfo lines: `id parent maj:min root mountpoint opts - fstype source superopts`.
    pub fn parse(mountinfo: &str) -> Mounts {
        let mut m = Mounts::default();
        for line in mountinfo.lines() {
            let Some((left, right)) = line.split_once(" - ") else { continue };
            let fields: Vec<&str> = left.split(' ').collect();
            let theirs: Vec<&str> = right.split(' ').collect();
            let (Some(root), Some(point), Some(fstype)) = (fields.get(3), fields.get(4), theirs.first())
            else {
                continue;
            };
            // A bind mount of a subtree would give paths relative to it: only whole hierarchies.
            if *root != "/" {
                continue;
            }
            let point = PathBuf::from(unescape(point));
            match *fstype {
                "cgroup2" if m.v2.is_none() => m.v2 = Some(point),
                "cgroup"
                    if m.blkio_v1.is_none()
                        && theirs.get(2).is_some_and(|o| o.split(',').any(|o| o == "blkio")) =>
                {
                    m.blkio_v1 = Some(point);
                }
                _ => {}
            }
        }
        m
    }

    /// The hierarchy of a record's cgroup: the task's is always v2; a bio's blkcg lives where
    /// the io controller is, v1 blkio where mounted.
    pub fn hierarchy_of(&self, rec: &IoRecord) -> Hierarchy {
        self.hierarchy(rec.flags & flag::CGROUP_TASK != 0)
    }

    /// The hierarchy of a cgroup id that is the task's (`task`) or a bio's blkcg.
    pub fn hierarchy(&self, task: bool) -> Hierarchy {
        if !task && self.blkio_v1.is_some() { Hierarchy::BlkioV1 } else { Hierarchy::V2 }
    }

    pub fn root(&self, h: Hierarchy) -> Option<&Path> {
        match h {
            Hierarchy::V2 => self.v2.as_deref(),
            Hierarchy::BlkioV1 => self.blkio_v1.as_deref(),
        }
    }
}

/// Mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

struct Cached {
    named: Named,
    /// Asked about since the last `forget_idle`: a flag, not a clock read per IO.
    used: bool,
    /// When it was named, or when `forget_idle` last found it used.
    idle_since: Instant,
}

/// Cgroup ids to paths, cached; entries unused for a while are forgotten, so short-lived
/// cgroups do not accumulate.
pub struct CgroupNames {
    pub mounts: Mounts,
    cache: HashMap<(Hierarchy, u64), Cached>,
    /// File handles were refused (no CAP_DAC_READ_SEARCH): walk instead.
    walk_only: bool,
    /// A walk's findings for ids not yet asked about (one walk names many).
    walked: HashMap<(Hierarchy, u64), Arc<str>>,
    last_walk: Option<Instant>,
}

/// At most one walk of a hierarchy per this long: an id still unknown after it is gone.
const WALK_EVERY: Duration = Duration::from_millis(500);

impl CgroupNames {
    pub fn new(mounts: Mounts) -> CgroupNames {
        CgroupNames {
            mounts,
            cache: HashMap::new(),
            walk_only: false,
            walked: HashMap::new(),
            last_walk: None,
        }
    }

    pub fn detect() -> CgroupNames {
        CgroupNames::new(Mounts::detect())
    }

    /// The cgroup a record is charged to.
    pub fn of(&mut self, rec: &IoRecord) -> Named {
        let h = self.mounts.hierarchy_of(rec);
        self.named(h, rec.cgroup)
    }

    pub fn named(&mut self, h: Hierarchy, id: u64) -> Named {
        if id == 0 {
            return Named::Unknown;
        }
        if let Some(c) = self.cache.get_mut(&(h, id)) {
            c.used = true;
            return c.named.clone();
        }
        let named = self.look_up(h, id);
        self.cache.insert((h, id), Cached { named: named.clone(), used: false, idle_since: Instant::now() });
        named
    }

    /// Forgets ids not asked about for `idle` (measured from the call after their last use, so
    /// never sooner); returns how many.
    pub fn forget_idle(&mut self, idle: Duration) -> usize {
        let before = self.cache.len();
        let now = Instant::now();
        self.cache.retain(|_, c| {
            if std::mem::take(&mut c.used) {
                c.idle_since = now;
            }
            now.duration_since(c.idle_since) < idle
        });
        self.walked.clear();
        before - self.cache.len()
    }

    pub fn cached(&self) -> usize {
        self.cache.len()
    }

    fn look_up(&mut self, h: Hierarchy, id: u64) -> Named {
        let Some(root) = self.mounts.root(h).map(Path::to_path_buf) else { return Named::Unknown };
        if id == 1 {
            return Named::Path("/".into());
        }
        if !self.walk_only {
            match by_handle(&root, id) {
                Ok(Some(path)) => return Named::Path(path),
                Ok(None) => return Named::Gone,
                Err(e) => {
                    tracing::info!(
                        "cgroup ids cannot be opened as file handles under {} ({e}): walking the \
                         hierarchy to name them instead",
                        root.display()
                    );
                    self.walk_only = true;
                }
            }
        }
        if let Some(p) = self.walked.remove(&(h, id)) {
            return Named::Path(p);
        }
        if self.last_walk.is_some_and(|t| t.elapsed() < WALK_EVERY) {
            return Named::Gone;
        }
        self.last_walk = Some(Instant::now());
        let mut found = Vec::new();
        walk(&root, &root, 0, &mut found);
        for (ino, path) in found {
            self.walked.insert((h, ino), path);
        }
        self.walked.remove(&(h, id)).map_or(Named::Gone, Named::Path)
    }
}

/// The v2 cgroup of a live task, from /proc (a slow IO of the in-kernel aggregation, whose
/// queue program reads no cgroup): its path, or Gone if the task is.
pub fn of_task(pid: u32) -> Named {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else { return Named::Gone };
    text.lines().find_map(|l| l.strip_prefix("0::")).map_or(Named::Unknown, |p| Named::Path(p.into()))
}

/// The path of cgroup `id` under `root`, opening it by its kernfs file handle. Ok(None): no
/// such cgroup (any more); Err: handles are refused here.
fn by_handle(root: &Path, id: u64) -> std::io::Result<Option<Arc<str>>> {
    // struct file_handle with an 8-byte handle: the kernfs node id (FILEID_KERNFS).
    #[repr(C)]
    struct Handle {
        bytes: u32,
        kind: i32,
        id: u64,
    }
    const FILEID_KERNFS: i32 = 0xfe;
    let croot = CString::new(root.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: a NUL-terminated path; the fd is closed below.
    let mount = unsafe { libc::open(croot.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if mount < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut handle = Handle { bytes: 8, kind: FILEID_KERNFS, id };
    // SAFETY: `handle` is a file_handle header followed by its 8 bytes.
    let fd = unsafe {
        libc::open_by_handle_at(
            mount,
            (&raw mut handle).cast(),
            libc::O_RDONLY | libc::O_CLOEXEC | libc::O_PATH,
        )
    };
    let err = std::io::Error::last_os_error();
    // SAFETY: our fd.
    unsafe { libc::close(mount) };
    if fd < 0 {
        return match err.raw_os_error() {
            Some(libc::ESTALE | libc::ENOENT) => Ok(None),
            _ => Err(err),
        };
    }
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}"));
    // SAFETY: our fd.
    unsafe { libc::close(fd) };
    let link = link?;
    Ok(Some(relative(root, &link)))
}

/// `path` from `root` ("/" for the root itself), as a cgroup path reads.
fn relative(root: &Path, path: &Path) -> Arc<str> {
    match path.strip_prefix(root) {
        Ok(rest) => format!("/{}", rest.display()).into(),
        Err(_) => path.display().to_string().into(),
    }
}

/// Collects (inode, path) of every cgroup under `dir`.
fn walk(root: &Path, dir: &Path, depth: usize, found: &mut Vec<(u64, Arc<str>)>) {
    // Kubernetes nests 5 deep; anything past 32 is a loop or an attack on our stack.
    if depth > 32 {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let Ok(meta) = e.metadata() else { continue };
        if meta.is_dir() {
            found.push((meta.ino(), relative(root, &e.path())));
            walk(root, &e.path(), depth + 1, found);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_gives_v2_and_the_v1_blkio_hierarchy() {
        let host = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
            35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
            38 31 0:35 / /sys/fs/cgroup/blkio rw,relatime - cgroup cgroup rw,blkio\n\
            41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
        let m = Mounts::parse(host);
        assert_eq!(m.v2.as_deref(), Some(Path::new("/sys/fs/cgroup/unified")));
        assert_eq!(m.blkio_v1.as_deref(), Some(Path::new("/sys/fs/cgroup/blkio")));
        let mut rec = IoRecord { cgroup: 5, ..Default::default() };
        assert_eq!(m.hierarchy_of(&rec), Hierarchy::BlkioV1);
        rec.flags |= flag::CGROUP_TASK;
        assert_eq!(m.hierarchy_of(&rec), Hierarchy::V2, "a task's cgroup is always v2");

        let v2_only = Mounts::parse("25 22 0:23 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n");
        assert_eq!(v2_only.v2.as_deref(), Some(Path::new("/sys/fs/cgroup")));
        assert_eq!(v2_only.hierarchy_of(&IoRecord::default()), Hierarchy::V2);
        // A bind mount of a subtree is not a hierarchy's root; an escaped space is unescaped.
        let odd = Mounts::parse(
            "1 0 0:23 /sub /mnt/x rw - cgroup2 cgroup2 rw\n2 0 0:23 / /mnt/a\\040b rw - cgroup2 cgroup2 rw\n",
        );
        assert_eq!(odd.v2.as_deref(), Some(Path::new("/mnt/a b")));
    }

    #[test]
    fn the_root_and_unknown_ids_need_no_lookup() {
        let mut names = CgroupNames::new(Mounts { v2: Some("/nonexistent-cgroup".into()), blkio_v1: None });
        assert_eq!(names.named(Hierarchy::V2, 1), Named::Path("/".into()));
        assert_eq!(names.named(Hierarchy::V2, 0), Named::Unknown);
        assert_eq!(names.named(Hierarchy::BlkioV1, 7), Named::Unknown, "no v1 blkio mounted");
    }

    #[test]
    fn names_are_forgotten_only_after_idle_without_use() {
        let mut names = CgroupNames::new(Mounts { v2: Some("/nonexistent-cgroup".into()), blkio_v1: None });
        let idle = Duration::from_millis(10);
        let past_idle = || std::thread::sleep(idle * 2);
        names.named(Hierarchy::V2, 1);
        assert_eq!(names.forget_idle(Duration::from_secs(3600)), 0);
        past_idle();
        assert_eq!((names.forget_idle(idle), names.cached()), (1, 0), "unused since it was named");
        names.named(Hierarchy::V2, 1);
        past_idle();
        names.named(Hierarchy::V2, 1);
        assert_eq!(names.forget_idle(idle), 0, "used since the last call");
        past_idle();
        assert_eq!((names.forget_idle(idle), names.cached()), (1, 0));
    }
}
