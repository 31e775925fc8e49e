//! Kernel modules for the guest: the ones it loads, their `depends=` closure from each module's
//! `.modinfo`, and the `modules.dep` busybox's modprobe reads.

use std::{
    collections::{BTreeMap, HashMap},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, ensure};

use super::kernel::VmKernel;
use crate::run;

/// Modules the guest prologue loads (their dependencies come along, see [`VmKernel::module_files`]).
pub const GUEST_MODULES: &[&str] = &[
    "brd",
    "raid0",
    "raid1",
    "raid10",
    "raid456",
    "dm-mod",
    "dm-multipath",
    "dm-round-robin",
    "dm-crypt",
    "dm-delay",
    "dm-thin-pool",
    "dm-snapshot",
    "dm-integrity",
    "dm-writecache",
    "dm-cache",
    "dm-cache-smq",
    "crc32c_generic",
    "null_blk",
    "loop",
    // Real drivers on qemu's emulated disks (see `REAL_DISKS` in vm/qemu.rs), and the schedulers that are
    // modules in Debian's builds (mq-deadline is built in).
    "virtio_pci",
    "nvme",
    // NVMe over TCP on loopback, the kernel's own target: ANA failover.
    "nvmet",
    "nvmet-tcp",
    "nvme-tcp",
    "virtio_blk",
    "virtio_scsi",
    "sd_mod",
    "kyber-iosched",
    "bfq",
];

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

impl VmKernel {
    /// The module files for `modules` and everything they depend on (read from each module's
    /// `depends=`), plus a `modules.dep` for them written under `work`, as (guest path, host path)
    /// pairs for [`build_initramfs`](super::initramfs::build_initramfs). In the guest, `modprobe NAME [PARAM=VALUE...]` loads them.
    pub fn module_files(&self, modules: &[&str], work: &Path) -> Result<Vec<(String, PathBuf)>> {
        let index = module_index(&self.modules_dir)?;
        let mut order = Vec::new();
        let mut deps = BTreeMap::new();
        for m in modules {
            self.visit_module(m, &index, &mut order, &mut deps)?;
        }
        // modules.dep lists dependencies so that modprobe loads them from the last one backwards.
        let mut dep_text = String::new();
        for rel in &order {
            let mut line = format!("{rel}:");
            for d in order.iter().rev().filter(|d| deps[rel].contains(d)) {
                line.push(' ');
                line.push_str(d);
            }
            dep_text.push_str(&line);
            dep_text.push('\n');
        }
        fs::create_dir_all(work)?;
        let dep_file = work.join("modules.dep");
        fs::write(&dep_file, dep_text)?;
        let guest_dir = format!("/lib/modules/{}", self.version);
        let mut files: Vec<(String, PathBuf)> =
            order.iter().map(|rel| (format!("{guest_dir}/{rel}"), self.modules_dir.join(rel))).collect();
        files.push((format!("{guest_dir}/modules.dep"), dep_file));
        Ok(files)
    }

    /// Which of `modules` this kernel's package lacks (the cloud build drops drivers): neither
    /// a module file nor built in.
    pub fn absent_modules<'a>(&self, modules: &[&'a str]) -> Result<Vec<&'a str>> {
        let index = module_index(&self.modules_dir)?;
        let builtin = self.builtin_modules(modules);
        Ok(modules
            .iter()
            .copied()
            .filter(|m| !index.contains_key(&m.replace('-', "_")) && !builtin.contains(m))
            .collect())
    }

    /// Which of `modules` this kernel has built in (`modules.builtin`: 6.12 builds virtio_pci
    /// in, 6.1 as a module): there is nothing to load.
    pub fn builtin_modules<'a>(&self, modules: &[&'a str]) -> Vec<&'a str> {
        let text = fs::read_to_string(self.modules_dir.join("modules.builtin")).unwrap_or_default();
        let names: Vec<String> = text
            .lines()
            .filter_map(|l| {
                Path::new(l).file_name()?.to_str()?.strip_suffix(".ko").map(|n| n.replace('-', "_"))
            })
            .collect();
        modules.iter().copied().filter(|m| names.contains(&m.replace('-', "_"))).collect()
    }

    /// Depth-first over `depends=`: pushes every module to `order` after what it needs, and
    /// records in `deps` everything it needs, directly or not.
    fn visit_module(
        &self,
        name: &str,
        index: &HashMap<String, String>,
        order: &mut Vec<String>,
        deps: &mut BTreeMap<String, Vec<String>>,
    ) -> Result<String> {
        let rel = index.get(&name.replace('-', "_")).cloned().with_context(|| {
            format!("kernel {} has no module {name} (under {})", self.version, self.modules_dir.display())
        })?;
        if deps.contains_key(&rel) {
            return Ok(rel);
        }
        deps.insert(rel.clone(), Vec::new()); // also ends a (malformed) cycle
        let mut closure: Vec<String> = Vec::new();
        for d in module_depends(&self.modules_dir.join(&rel))? {
            let d_rel = self.visit_module(&d, index, order, deps)?;
            for x in std::iter::once(&d_rel).chain(&deps[&d_rel]) {
                if !closure.contains(x) {
                    closure.push(x.clone());
                }
            }
        }
        deps.insert(rel.clone(), closure);
        order.push(rel.clone());
        Ok(rel)
    }
}

/// Module name with `_` for `-` (as the kernel spells it) -> path of its uncompressed `.ko`
/// relative to the modules dir. Compressed modules (`.ko.xz`, 6.12) are uncompressed beside
/// themselves when first needed: busybox's modprobe loads only plain ones.
fn module_index(modules_dir: &Path) -> Result<HashMap<String, String>> {
    let mut index = HashMap::new();
    let mut stack = vec![modules_dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).with_context(|| format!("cannot read {}", dir.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
            let Some(stem) = [".ko", ".ko.xz"].iter().find_map(|suffix| name.strip_suffix(suffix)) else {
                continue;
            };
            let rel = path.strip_prefix(modules_dir)?.to_string_lossy().into_owned();
            index.insert(stem.replace('-', "_"), rel.trim_end_matches(".xz").to_owned());
        }
    }
    ensure!(!index.is_empty(), "no .ko or .ko.xz modules under {}", modules_dir.display());
    Ok(index)
}

/// Makes sure `ko` exists uncompressed, from `ko`.xz if need be.
fn uncompressed_module(ko: &Path) -> Result<()> {
    if ko.is_file() {
        return Ok(());
    }
    let xz = ko.with_extension("ko.xz");
    let tmp = ko.with_extension("ko.tmp");
    let out = fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    run(Command::new("xz").arg("-dc").arg(&xz).stdout(out), &format!("xz -dc {}", xz.display()))?;
    fs::rename(&tmp, ko)?;
    Ok(())
}

/// The `depends=` entry of a module's .modinfo section.
fn module_depends(ko: &Path) -> Result<Vec<String>> {
    uncompressed_module(ko)?;
    let data = fs::read(ko).with_context(|| format!("cannot read {}", ko.display()))?;
    let start = find(&data, b"\0depends=")
        .with_context(|| format!("{} has no depends= entry", ko.display()))?
        + b"\0depends=".len();
    let end = data[start..].iter().position(|&b| b == 0).map_or(data.len(), |n| start + n);
    Ok(String::from_utf8_lossy(&data[start..end])
        .split(',')
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_closure_and_modules_dep() {
        let dir = std::env::temp_dir().join(format!("xtask-modules-{}", std::process::id()));
        let modules = dir.join("lib/modules/6.1.0-test");
        let ko = |rel: &str, depends: &str| {
            let path = modules.join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, format!("\x7fELF...\0license=GPL\0depends={depends}\0vermagic=6.1\0")).unwrap();
        };
        // top needs mid and base; mid needs base: base loads first, then mid, then top.
        ko("kernel/a/top-mod.ko", "base,mid_mod");
        ko("kernel/b/mid-mod.ko", "base");
        ko("kernel/base.ko", "");
        ko("kernel/unused.ko", "");
        let k = VmKernel {
            image: dir.join("vmlinux"),
            version: "6.1.0-test".into(),
            package: "linux-image-6.1.0-test".into(),
            modules_dir: modules.clone(),
        };
        let files = k.module_files(&["top_mod"], &dir).unwrap();
        let guest: Vec<&str> = files.iter().map(|(g, _)| g.as_str()).collect();
        assert_eq!(
            guest,
            [
                "/lib/modules/6.1.0-test/kernel/base.ko",
                "/lib/modules/6.1.0-test/kernel/b/mid-mod.ko",
                "/lib/modules/6.1.0-test/kernel/a/top-mod.ko",
                "/lib/modules/6.1.0-test/modules.dep",
            ]
        );
        // modprobe loads the listed dependencies from the last one backwards.
        assert_eq!(
            fs::read_to_string(dir.join("modules.dep")).unwrap(),
            "kernel/base.ko:\nkernel/b/mid-mod.ko: kernel/base.ko\n\
             kernel/a/top-mod.ko: kernel/b/mid-mod.ko kernel/base.ko\n"
        );
        assert!(k.module_files(&["missing"], &dir).is_err());
        assert_eq!(k.absent_modules(&["base", "missing", "mid-mod"]).unwrap(), ["missing"]);
        // A module built into the kernel is not absent, and there is nothing to load.
        fs::write(
            modules.join("modules.builtin"),
            "kernel/drivers/virtio/virtio_pci.ko\nkernel/x/in-tree.ko\n",
        )
        .unwrap();
        assert_eq!(k.builtin_modules(&["virtio_pci", "in_tree", "base"]), ["virtio_pci", "in_tree"]);
        assert_eq!(k.absent_modules(&["virtio_pci", "missing"]).unwrap(), ["missing"]);

        // 6.12 ships modules as .ko.xz: found, uncompressed beside themselves, listed plain.
        let xz = modules.join("kernel/c/packed.ko");
        fs::create_dir_all(xz.parent().unwrap()).unwrap();
        fs::write(&xz, "\x7fELF\0depends=base\0").unwrap();
        run(Command::new("xz").arg(&xz), "xz").unwrap();
        assert!(!xz.exists() && xz.with_extension("ko.xz").is_file());
        let files = k.module_files(&["packed"], &dir).unwrap();
        assert_eq!(files[1].0, "/lib/modules/6.1.0-test/kernel/c/packed.ko");
        assert_eq!(fs::read(&files[1].1).unwrap(), b"\x7fELF\0depends=base\0");
        fs::remove_dir_all(&dir).unwrap();
    }
}
