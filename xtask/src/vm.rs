//! `cargo xtask vm-test`: tracerd inside a Debian 6.1 kernel under qemu.
//!
//! The host kernel has no md, dm, brd, null_blk or kprobes; Debian's 6.1 kernel has them all as
//! modules. The VM is a kernel plus an initramfs (busybox, mdadm, dmsetup, static musl builds of the
//! project's binaries, the modules) whose `/init` is a shell script; its serial console is the
//! result. There is no KVM here, so qemu emulates (TCG), single-threaded: multi-threaded TCG crashed
//! the guest under kprobes on md/dm/brd in 3 of 7 runs, single-threaded in none of 36.
//!
//! Adding a scenario: write a shell body that prints its result between `VM-RESULT-BEGIN NAME` and
//! `VM-RESULT-END NAME` (see [`smoke_scenario`]), wrap it with [`scenario`], put it through
//! [`guest_script`], boot, and read the result back with [`result_section`]. The prologue gives
//! every scenario /dev/md0 (raid1 over ram0+ram1), /dev/dm-0 (`lin0`, linear over ram2) and
//! /dev/nullb0.

use crate::vm_scenarios;
use std::{
    collections::{BTreeMap, HashMap},
    fs,
    io::{BufWriter, Read, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};

use crate::{cpio::CpioWriter, root_dir, run, setup};

/// musl-tools: the static build compiles C (ring, for TLS) with x86_64-linux-musl-gcc.
const VM_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "mdadm",
    "dmsetup",
    "xz-utils",
    "util-linux",
    "fdisk",
    "musl-tools",
    "zstd",
];
const MUSL: &str = "x86_64-unknown-linux-musl";
/// Bounds on a hang, not on speed: a TCG guest on a loaded host is many times slower than one on
/// an idle host, and no step may fail for that. One guest step (a tracer attaching, a count
/// reached) gets GUEST_HANG; the whole guest run, VM_HANG. The PREEMPT_RT guest runs every
/// scenario in about 2400 s here, while the other core runs 6.12 and then 6.1 (about 3500 s).
const GUEST_HANG: Duration = Duration::from_secs(300);
const VM_HANG: Duration = Duration::from_secs(3300);
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
    // Real drivers on qemu's emulated disks (see [`REAL_DISKS`]), and the schedulers that are
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

/// qemu's emulated disks, each backed by qemu's null driver (reads return zeros, writes are
/// dropped: no image files): a plain NVMe namespace, one namespace shared by two controllers of
/// one NVMe subsystem (native multipath: a head disk over two hidden path disks; qemu wants
/// one serial for a subsystem's controllers), a virtio-scsi
/// disk and a virtio-blk disk.
const REAL_DISKS: &[&str] = &[
    "-blockdev",
    "driver=null-co,node-name=nvme_plain,size=67108864,read-zeroes=on",
    "-device",
    "nvme,serial=tracerd-plain,drive=nvme_plain",
    "-device",
    "nvme-subsys,id=mpath,nqn=tracerd-mpath",
    "-device",
    "nvme,serial=tracerd-mpath,subsys=mpath",
    "-device",
    "nvme,serial=tracerd-mpath,subsys=mpath",
    "-blockdev",
    // 2 ms per IO: a controller reset finds requests in flight.
    "driver=null-co,node-name=nvme_shared,size=67108864,read-zeroes=on,latency-ns=2000000",
    "-device",
    "nvme-ns,drive=nvme_shared,nsid=1,shared=on",
    "-device",
    "virtio-scsi-pci,id=scsi0",
    "-blockdev",
    "driver=null-co,node-name=scsi_disk,size=67108864,read-zeroes=on",
    "-device",
    "scsi-hd,drive=scsi_disk,bus=scsi0.0",
    "-blockdev",
    "driver=null-co,node-name=virtio_disk,size=67108864,read-zeroes=on",
    "-device",
    "virtio-blk-pci,drive=virtio_disk",
];
/// Mount points the prologue mounts on.
const GUEST_DIRS: &[&str] = &["proc", "sys", "dev", "tmp", "run", "sys/kernel/debug", "sys/kernel/tracing"];
/// Userspace tools copied from the host with their shared libraries: (guest path, command).
/// util-linux's own tools go to /usr/local (ahead of busybox's applets on the host tests' PATH):
/// the host-kernel tests use their long options.
const GUEST_TOOLS: &[(&str, &str)] = &[
    ("/sbin/mdadm", "mdadm"),
    ("/sbin/dmsetup", "dmsetup"),
    ("/usr/local/sbin/losetup", "losetup"),
    ("/usr/local/sbin/sfdisk", "sfdisk"),
    ("/usr/local/bin/partx", "partx"),
    ("/usr/local/bin/setpriv", "setpriv"),
];
/// Starts of an xz and a zstd stream: Debian compresses vmlinuz's payload with one of them.
const XZ_MAGIC: &[u8] = &[0xfd, b'7', b'z', b'X', b'Z', 0];
const ZSTD_MAGIC: &[u8] = &[0x28, 0xb5, 0x2f, 0xfd];

/// Where downloads and the unpacked kernels live (ignored by git); delete a kernel's directory
/// to fetch its newest build again.
pub fn cache_dir() -> PathBuf {
    root_dir().join(".vm-cache")
}

/// Where initramfs images and console logs go.
pub fn out_dir() -> PathBuf {
    root_dir().join("target/vm")
}

/// A Debian kernel series the VM boots. The build is chosen by apt, never named here: `meta` is
/// Debian's meta package, whose dependency is the newest build of the series, and that build's
/// version must belong to `series` and `flavour` (a meta package that moved on is an error, not
/// a silent change of kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSeries {
    /// What `--kernel` takes: `6.1`, `6.12`, `6.12-rt`, `6.12-cloud`.
    pub name: &'static str,
    meta: &'static str,
    /// Start of `uname -r`, e.g. `6.12.`.
    series: &'static str,
    /// `rt`, `cloud`, or empty for the generic build.
    flavour: &'static str,
    /// Part of `--kernel all` and `cargo xtask test`.
    pub in_all: bool,
}

pub const KERNELS: &[KernelSeries] = &[
    // Bookworm's own kernel.
    KernelSeries { name: "6.1", meta: "linux-image-amd64", series: "6.1.", flavour: "", in_all: true },
    // Bookworm's newer LTS kernel, and its PREEMPT_RT build: completions in threads, programs
    // that can be preempted.
    KernelSeries { name: "6.12", meta: "linux-image-6.12-amd64", series: "6.12.", flavour: "", in_all: true },
    KernelSeries {
        name: "6.12-rt",
        meta: "linux-image-6.12-rt-amd64",
        series: "6.12.",
        flavour: "rt",
        in_all: true,
    },
    // The cloud build drops drivers; a scenario whose module is missing says so and skips.
    KernelSeries {
        name: "6.12-cloud",
        meta: "linux-image-6.12-cloud-amd64",
        series: "6.12.",
        flavour: "cloud",
        in_all: false,
    },
];

impl KernelSeries {
    /// `6.1`, `all`, ... as given to `--kernel`.
    pub fn select(arg: &str) -> Result<Vec<KernelSeries>> {
        if arg == "all" {
            return Ok(KERNELS.iter().filter(|k| k.in_all).copied().collect());
        }
        let names: Vec<&str> = KERNELS.iter().map(|k| k.name).collect();
        arg.split(',')
            .map(|a| {
                KERNELS.iter().find(|k| k.name == a.trim()).copied().with_context(|| {
                    format!("no kernel {a:?}: --kernel takes one of {} or all", names.join(", "))
                })
            })
            .collect()
    }

    /// Whether `uname -r` of a build (e.g. `6.12.117+deb12-rt-amd64`) is one of this series.
    fn owns(&self, release: &str) -> bool {
        let Some(rest) = release.strip_prefix(self.series) else { return false };
        let flavour = rest.strip_suffix("-amd64").and_then(|r| r.rsplit('-').next()).unwrap_or("");
        let flavour = if ["rt", "cloud"].contains(&flavour) { flavour } else { "" };
        flavour == self.flavour
    }

    fn cache(&self) -> PathBuf {
        cache_dir().join(self.name)
    }
}

/// A kernel that qemu can boot, with its modules.
#[derive(Debug, Clone)]
pub struct VmKernel {
    /// Uncompressed vmlinux (booted through its PVH note, 2.6 s faster under TCG) or vmlinuz.
    pub image: PathBuf,
    /// `uname -r` in the guest, e.g. `6.1.0-57-amd64`.
    pub version: String,
    /// The Debian package it came from.
    pub package: String,
    /// `.../lib/modules/<version>` of the unpacked package.
    pub modules_dir: PathBuf,
}

/// Installs qemu, busybox-static, mdadm, dmsetup, xz, zstd and the musl Rust target where missing.
pub fn ensure_vm_packages() -> Result<()> {
    setup::apt_install(VM_PACKAGES, "the VM tests (cargo xtask vm-test)")?;
    ensure_musl_target()
}

/// The musl Rust target and musl-gcc (for ring's C), where missing: static binaries.
pub fn ensure_musl_target() -> Result<()> {
    setup::apt_install(&["musl-tools"], "static binaries (musl)")?;
    let installed = setup::output("rustup", &["target", "list", "--installed"])
        .context("rustup is needed to add the musl target: install it from https://rustup.rs")?;
    if !installed.lines().any(|l| l.trim() == MUSL) {
        eprintln!("xtask: adding the Rust target {MUSL} (static binaries for the VM)");
        run(Command::new("rustup").args(["target", "add", MUSL]), &format!("rustup target add {MUSL}"))?;
    }
    Ok(())
}

/// The newest Debian build of `series`, downloaded and unpacked into its cache directory on
/// first use; later calls only read the cache (no apt, no network).
pub fn kernel(series: KernelSeries) -> Result<VmKernel> {
    let cache = series.cache();
    let ready = cache.join("kernel.ready");
    if let Some(k) = fs::read_to_string(&ready).ok().and_then(|s| parse_ready(&s, &cache, series)) {
        return Ok(k);
    }
    let pkg = kernel_package(series)?;
    let download = cache.join("download");
    let _ = fs::remove_dir_all(&download);
    fs::create_dir_all(&download).with_context(|| format!("cannot create {}", download.display()))?;
    eprintln!("xtask: downloading {pkg} (70-110 MB, once)");
    let mut cmd = Command::new("apt-get");
    // As root, apt drops to the _apt user, which cannot write into the workspace.
    if setup::is_root() {
        cmd.args(["-o", "APT::Sandbox::User=root"]);
    }
    // apt's progress goes to stderr: stdout is for vm-test's result.
    cmd.args(["download", "-q", &pkg]).current_dir(&download).stdout(std::io::stderr());
    run(&mut cmd, &format!("apt-get download {pkg}"))?;
    let deb = fs::read_dir(&download)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .with_context(|| format!("apt-get download {pkg} left no .deb in {}", download.display()))?;
    let tree = cache.join(&pkg);
    let _ = fs::remove_dir_all(&tree);
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tree), &format!("dpkg-deb -x {}", deb.display()))?;
    fs::remove_dir_all(&download)?;

    let modules_root = ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|d| tree.join(d))
        .find(|d| d.is_dir())
        .with_context(|| format!("{pkg} has no lib/modules directory"))?;
    let version = fs::read_dir(&modules_root)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
        .with_context(|| format!("{} is empty", modules_root.display()))?;
    ensure!(series.owns(&version), "{pkg} unpacked kernel {version}, which is not of series {}", series.name);
    let vmlinuz = tree.join(format!("boot/vmlinuz-{version}"));
    ensure!(vmlinuz.is_file(), "{pkg} has no {}", vmlinuz.display());
    let vmlinux = tree.join(format!("boot/vmlinux-{version}"));
    let image = match uncompress_kernel(&vmlinuz, &vmlinux) {
        Ok(()) => vmlinux,
        Err(e) => {
            eprintln!("xtask: booting the compressed kernel (slower): {e:#}");
            vmlinuz
        }
    };
    let k = VmKernel { image, modules_dir: modules_root.join(&version), version, package: pkg };
    // Written last: a run interrupted above starts over instead of using half a cache. Paths are
    // relative to the cache, so a moved or symlinked cache stays valid.
    let rel = |p: &Path| p.strip_prefix(&cache).map(Path::to_path_buf).unwrap_or_else(|_| p.to_path_buf());
    fs::write(
        &ready,
        format!(
            "image={}\nversion={}\npackage={}\nmodules={}\n",
            rel(&k.image).display(),
            k.version,
            k.package,
            rel(&k.modules_dir).display()
        ),
    )?;
    Ok(k)
}

fn parse_ready(text: &str, cache: &Path, series: KernelSeries) -> Option<VmKernel> {
    let fields: HashMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
    let k = VmKernel {
        image: cache.join(fields.get("image")?),
        version: fields.get("version")?.to_string(),
        package: fields.get("package")?.to_string(),
        modules_dir: cache.join(fields.get("modules")?),
    };
    (k.image.is_file() && k.modules_dir.is_dir() && series.owns(&k.version)).then_some(k)
}

/// The concrete kernel package the series' meta package points at, e.g.
/// `linux-image-6.12.117+deb12-rt-amd64`.
fn kernel_package(series: KernelSeries) -> Result<String> {
    let meta = series.meta;
    let find = || {
        let deps = setup::output("apt-cache", &["depends", meta])?;
        deps.lines()
            .filter_map(|l| l.trim().strip_prefix("Depends: "))
            .map(str::trim)
            .find(|d| d.starts_with("linux-image-") && !d.starts_with('<'))
            .map(str::to_string)
    };
    let pkg = match find() {
        Some(pkg) => pkg,
        None if !setup::is_root() => {
            bail!("apt does not know {meta}: run `sudo apt-get update`, then this command again")
        }
        None => {
            run(Command::new("apt-get").args(["update", "-q"]), "apt-get update")?;
            find().with_context(|| {
                format!("apt-cache depends {meta} names no linux-image-* package (is this Debian bookworm?)")
            })?
        }
    };
    let release = pkg.trim_start_matches("linux-image-");
    ensure!(
        series.owns(release),
        "{meta} now depends on {pkg}, which is not a {} kernel: add a series for it in xtask/src/vm.rs",
        series.name
    );
    Ok(pkg)
}

/// Extracts the compressed payload of a bzImage (xz on 6.1, zstd on 6.12) into an ELF vmlinux
/// that qemu boots through its PVH note.
fn uncompress_kernel(vmlinuz: &Path, out: &Path) -> Result<()> {
    let image = fs::read(vmlinuz)?;
    let payload = bzimage_payload(&image)?;
    // The build appends the uncompressed size (4 bytes) to the stream: xz stops at the end of its
    // stream by itself, zstd must not see it.
    let (tool, args, data): (&str, &[&str], &[u8]) = if payload.starts_with(XZ_MAGIC) {
        ("xz", &["-dc", "--single-stream"], payload)
    } else if payload.starts_with(ZSTD_MAGIC) {
        ("zstd", &["-dcq"], &payload[..payload.len().saturating_sub(4)])
    } else {
        bail!("the kernel payload is neither xz nor zstd (starts {:02x?})", &payload[..payload.len().min(6)]);
    };
    let data = data.to_vec();
    let tmp = out.with_extension("tmp");
    let mut child = Command::new(tool)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(fs::File::create(&tmp)?)
        .spawn()
        .with_context(|| format!("cannot start {tool} (apt-get install xz-utils zstd)"))?;
    let mut stdin = child.stdin.take().expect("piped");
    let feeder = thread::spawn(move || stdin.write_all(&data));
    let status = child.wait()?;
    // xz may stop reading before the trailing size: a broken pipe here is fine.
    let _ = feeder.join();
    ensure!(status.success(), "{tool} -dc failed ({status})");
    let elf = fs::read(&tmp)?;
    ensure!(has_pvh_note(&elf)?, "the uncompressed kernel has no PVH entry note; qemu cannot boot it");
    fs::rename(&tmp, out)?;
    Ok(())
}

/// The compressed kernel inside a bzImage, from its setup header (boot protocol 2.08+):
/// `payload_offset` counts from the protected-mode code, which follows the setup sectors.
fn bzimage_payload(image: &[u8]) -> Result<&[u8]> {
    ensure!(image.len() > 0x250 && image[0x202..0x206] == *b"HdrS", "not a bzImage (no HdrS header)");
    let setup_sects = match image[0x1f1] {
        0 => 4,
        n => n as usize,
    };
    let word = |o: usize| u32::from_le_bytes(image[o..o + 4].try_into().unwrap()) as usize;
    let start = (setup_sects + 1) * 512 + word(0x248);
    image.get(start..start + word(0x24c)).context("the bzImage payload lies outside the file")
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

impl VmKernel {
    /// The module files for `modules` and everything they depend on (read from each module's
    /// `depends=`), plus a `modules.dep` for them written under `work`, as (guest path, host path)
    /// pairs for [`build_initramfs`]. In the guest, `modprobe NAME [PARAM=VALUE...]` loads them.
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

/// Builds the musl target of `packages` and returns the paths of `bins`, each checked to be
/// static (no ELF interpreter), so they run in the bare initramfs.
/// Builds an integration test of `package` as a static (musl) executable; returns its path.
pub fn build_static_test(package: &str, test: &str) -> Result<PathBuf> {
    let mut cmd = crate::cargo(None);
    cmd.args(["test", "--release", "--no-run", "--message-format=json", "--target", MUSL, "-p", package])
        .args(["--test", test]);
    let out = cmd.output().context("cannot run cargo test --no-run")?;
    ensure!(
        out.status.success(),
        "building the {test} test ({MUSL}) failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let exe = stdout
        .lines()
        .filter(|l| l.contains(&format!("\"name\":\"{test}\"")))
        .find_map(|l| {
            let at = l.find("\"executable\":\"")? + "\"executable\":\"".len();
            Some(l[at..at + l[at..].find('"')?].to_owned())
        })
        .with_context(|| format!("cargo did not name the {test} test executable"))?;
    let path = PathBuf::from(exe);
    ensure!(!has_interp(&fs::read(&path)?)?, "{} is dynamically linked", path.display());
    Ok(path)
}

pub fn build_static(packages: &[&str], bins: &[&str]) -> Result<Vec<PathBuf>> {
    let mut cmd = crate::cargo(None);
    cmd.args(["build", "--release", "--target", MUSL]);
    for p in packages {
        cmd.args(["-p", p]);
    }
    run(&mut cmd, &format!("building static binaries ({MUSL})"))?;
    let dir = root_dir().join("target").join(MUSL).join("release");
    bins.iter()
        .map(|b| {
            let path = dir.join(b);
            ensure!(path.is_file(), "{} was not built; is {b} a bin of {packages:?}?", path.display());
            ensure!(
                !has_interp(&fs::read(&path)?)?,
                "{} is dynamically linked; the VM has no musl loader. Build with \
                 RUSTFLAGS='-C target-feature=+crt-static'",
                path.display()
            );
            Ok(path)
        })
        .collect()
}

struct ProgramHeader {
    kind: u32,
    offset: usize,
    size: usize,
}

const PT_INTERP: u32 = 3;
const PT_NOTE: u32 = 4;
/// XEN_ELFNOTE_PHYS32_ENTRY: the 32-bit entry point qemu uses to boot an ELF kernel (PVH).
const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;

/// Program headers of a little-endian ELF64 file.
fn program_headers(elf: &[u8]) -> Result<Vec<ProgramHeader>> {
    ensure!(elf.len() >= 64 && elf[..4] == *b"\x7fELF", "not an ELF file");
    ensure!(elf[4] == 2 && elf[5] == 1, "not a little-endian 64-bit ELF file");
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(elf[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(elf[o..o + 8].try_into().unwrap()) as usize;
    let (phoff, phentsize, phnum) = (u64_at(32), u16_at(54), u16_at(56));
    ensure!(phentsize >= 56 && phoff + phentsize * phnum <= elf.len(), "truncated ELF program headers");
    Ok((0..phnum)
        .map(|i| {
            let h = phoff + i * phentsize;
            ProgramHeader { kind: u32_at(h), offset: u64_at(h + 8), size: u64_at(h + 32) }
        })
        .collect())
}

fn has_interp(elf: &[u8]) -> Result<bool> {
    Ok(program_headers(elf)?.iter().any(|h| h.kind == PT_INTERP))
}

fn has_pvh_note(elf: &[u8]) -> Result<bool> {
    for h in program_headers(elf)?.iter().filter(|h| h.kind == PT_NOTE) {
        let notes = elf.get(h.offset..h.offset + h.size).context("truncated ELF note")?;
        let mut at = 0;
        // Each note: namesz, descsz, type, name (4-aligned), desc (4-aligned).
        while at + 12 <= notes.len() {
            let word = |o: usize| u32::from_le_bytes(notes[o..o + 4].try_into().unwrap()) as usize;
            let (namesz, descsz, kind) = (word(at), word(at + 4), word(at + 8) as u32);
            let name = notes.get(at + 12..at + 12 + namesz).unwrap_or_default();
            if name == b"Xen\0" && kind == XEN_ELFNOTE_PHYS32_ENTRY {
                return Ok(true);
            }
            at += 12 + namesz.div_ceil(4) * 4 + descsz.div_ceil(4) * 4;
        }
    }
    Ok(false)
}

/// Writes an initramfs (uncompressed newc cpio) to `out`: busybox with its applet links, mdadm and
/// dmsetup with their shared libraries, the mount points, `/dev/console`, `/init` (the shell
/// script `init`) and `files` as (guest path, host file) pairs, which win over the rest.
pub fn build_initramfs(out: &Path, files: &[(String, PathBuf)], init: &str) -> Result<()> {
    enum Node {
        Dir,
        File(PathBuf),
        Symlink(String),
        Init,
        Console,
    }
    let mut tree: BTreeMap<String, Node> = BTreeMap::new();
    let mut add = |path: &str, node: Node| -> Result<()> {
        let path = path.trim_start_matches('/').to_string();
        for parent in Path::new(&path).ancestors().skip(1).filter(|p| !p.as_os_str().is_empty()) {
            let parent = parent.to_string_lossy().into_owned();
            match tree.get(&parent) {
                None | Some(Node::Dir) => tree.insert(parent, Node::Dir),
                Some(_) => bail!("initramfs: /{parent} is a file but /{path} needs it as a directory"),
            };
        }
        if matches!(tree.get(&path), Some(Node::Dir)) && !matches!(node, Node::Dir) {
            bail!("initramfs: /{path} is a directory and cannot also be a file");
        }
        tree.insert(path, node);
        Ok(())
    };

    for d in GUEST_DIRS {
        add(d, Node::Dir)?;
    }
    add("dev/console", Node::Console)?;
    let busybox = which("busybox").context("busybox is missing: apt-get install busybox-static")?;
    ensure!(
        !has_interp(&fs::read(&busybox)?)?,
        "{} is dynamically linked: apt-get install busybox-static (it replaces the busybox package)",
        busybox.display()
    );
    let applets = setup::output(&busybox.to_string_lossy(), &["--list-full"])
        .with_context(|| format!("{} --list-full failed", busybox.display()))?;
    for applet in applets.lines().map(str::trim).filter(|a| !a.is_empty()) {
        add(applet, Node::Symlink("/bin/busybox".into()))?;
    }
    add("bin/busybox", Node::File(busybox))?;
    for (guest, tool) in GUEST_TOOLS {
        let host = which(tool).with_context(|| format!("{tool} is missing: apt-get install {tool}"))?;
        for lib in shared_libraries(&host)? {
            add(&lib.to_string_lossy(), Node::File(lib.clone()))?;
        }
        add(guest, Node::File(host))?;
    }
    for (guest, host) in files {
        add(guest, Node::File(host.clone()))?;
    }
    add("init", Node::Init)?;

    let tmp = out.with_extension("tmp");
    if let Some(dir) = out.parent() {
        fs::create_dir_all(dir)?;
    }
    let mut w = CpioWriter::new(BufWriter::new(
        fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?,
    ));
    for (path, node) in &tree {
        match node {
            Node::Dir => w.dir(path, 0o755)?,
            Node::Symlink(target) => w.symlink(path, target)?,
            Node::Init => w.file(path, 0o755, init.as_bytes())?,
            Node::Console => w.char_dev(path, 0o600, 5, 1)?,
            Node::File(host) => {
                let data =
                    fs::read(host).with_context(|| format!("cannot read {} for /{path}", host.display()))?;
                let mode = {
                    use std::os::unix::fs::PermissionsExt;
                    fs::metadata(host)?.permissions().mode()
                };
                w.file(path, mode, &data)?;
            }
        }
    }
    w.finish()?;
    fs::rename(&tmp, out)?;
    Ok(())
}

fn which(cmd: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .map(|d| Path::new(d).join(cmd))
        .find(|p| p.is_file())
}

/// What `ldd` lists for a binary, including the ELF interpreter.
fn shared_libraries(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd").arg(bin).output().context("cannot run ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(out.status.success(), "ldd {} failed: {}", bin.display(), String::from_utf8_lossy(&out.stderr));
    let mut libs = Vec::new();
    for line in text.lines().map(str::trim) {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)", "/lib64/ld-linux-x86-64.so.2 (0x...)",
        // "linux-vdso.so.1 (0x...)" (in the kernel, nothing to copy).
        let path = match line.split_once("=> ") {
            Some((_, rest)) => rest.split(" (").next().unwrap_or_default(),
            None => line.split(" (").next().unwrap_or_default(),
        };
        if line.contains("not found") {
            bail!("{}: a shared library is missing on the host: {line}", bin.display());
        }
        if path.starts_with('/') {
            libs.push(PathBuf::from(path));
        }
    }
    Ok(libs)
}

/// Boots `kernel` with `initramfs` and returns the serial console (kernel messages and the output
/// of /init, without carriage returns or terminal escapes), also written to
/// `target/vm/<initramfs name>.log`. Words `key=value` in
/// `cmdline_extra` reach /init as environment variables. Fails on a timeout (qemu is killed), a
/// kernel panic, BUG or oops, or a qemu error, with the console lines that show it.
pub fn boot(kernel: &VmKernel, initramfs: &Path, cmdline_extra: &str, timeout: Duration) -> Result<String> {
    let stem = initramfs.file_stem().unwrap_or_default().to_string_lossy();
    boot_logged(kernel, initramfs, cmdline_extra, timeout, &out_dir().join(format!("{stem}.log")))
}

/// [`boot`], with the console log written to `log`.
pub fn boot_logged(
    kernel: &VmKernel,
    initramfs: &Path,
    cmdline_extra: &str,
    timeout: Duration,
    log: &Path,
) -> Result<String> {
    // oops=panic panic=-1 with -no-reboot: a crashed guest ends qemu instead of hanging.
    // noirqdebug: under TCG, PREEMPT_RT's threaded serial interrupt looked unhandled often enough
    // that the kernel disabled IRQ 4, printing that (an emergency message) in the middle of a
    // result line.
    let append = format!("console=ttyS0 oops=panic panic=-1 quiet noirqdebug {cmdline_extra}");
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-accel", "tcg,thread=single", "-cpu", "max", "-m", "1G", "-smp", "2"])
        .args(["-nographic", "-no-reboot", "-nic", "none"])
        .args(REAL_DISKS)
        .arg("-kernel")
        .arg(&kernel.image)
        .arg("-initrd")
        .arg(initramfs)
        .args(["-append", append.trim_end()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start qemu-system-x86_64 (apt-get install qemu-system-x86)")?;

    if let Some(dir) = log.parent() {
        fs::create_dir_all(dir)?;
    }
    let console = Arc::new(Mutex::new(Vec::new()));
    let stdout_reader = {
        let (console, mut stdout) = (console.clone(), child.stdout.take().expect("piped"));
        let mut file = fs::File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
        thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n @ 1..) = stdout.read(&mut buf) {
                let _ = file.write_all(&buf[..n]);
                console.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        })
    };
    let stderr_reader = {
        let mut stderr = child.stderr.take().expect("piped");
        thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        })
    };

    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(50));
    };
    let _ = stdout_reader.join();
    let qemu_stderr = stderr_reader.join().unwrap_or_default();
    let text = strip_escapes(&String::from_utf8_lossy(&console.lock().unwrap()));
    // The raw stream was there to follow a run live (tail -f); keep the clean text for readers.
    fs::write(log, &text).with_context(|| format!("cannot write {}", log.display()))?;
    let where_ = format!("console log: {}", log.display());

    let Some(status) = status else {
        bail!(
            "the VM did not power off within {timeout:?} and was killed. Last console lines:\n{}\n{where_}",
            tail(&text, 60)
        );
    };
    if let Some(crash) = kernel_crash(&text) {
        bail!("the guest kernel crashed:\n{crash}\n{where_}");
    }
    if !status.success() {
        bail!(
            "qemu failed ({status}): {}\nLast console lines:\n{}\n{where_}",
            qemu_stderr.trim(),
            tail(&text, 60)
        );
    }
    Ok(text)
}

/// The console without carriage returns and the terminal escapes SeaBIOS prints.
fn strip_escapes(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\r' => {}
            // CSI: ESC [ parameters, then one final byte in @..~; anything else: ESC and one char.
            '\x1b' => {
                if chars.next() == Some('[') {
                    while chars.next().is_some_and(|c| !('@'..='~').contains(&c)) {}
                }
            }
            c => out.push(c),
        }
    }
    out
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A kernel line of the form "[    1.234567] ..." (printk time stamps are on in Debian's kernel).
fn is_kernel_line(line: &str) -> bool {
    let Some((stamp, _)) = line.strip_prefix('[').and_then(|l| l.split_once("] ")) else {
        return false;
    };
    let Some((secs, frac)) = stamp.trim_start().split_once('.') else {
        return false;
    };
    !secs.is_empty()
        && secs.bytes().all(|b| b.is_ascii_digit())
        && frac.len() == 6
        && frac.bytes().all(|b| b.is_ascii_digit())
}

/// The lines around the first panic, BUG or oops the guest kernel printed, if any.
fn kernel_crash(console: &str) -> Option<String> {
    const SIGNS: &[&str] = &["Kernel panic", "BUG:", "Oops", "kernel BUG at", "general protection fault"];
    let lines: Vec<&str> = console.lines().collect();
    let first = lines.iter().position(|l| is_kernel_line(l) && SIGNS.iter().any(|s| l.contains(s)))?;
    let mut report = lines[first.saturating_sub(5)..(first + 50).min(lines.len())].join("\n");
    if console.contains("Attempted to kill init") {
        report.push_str("\n(/init exited: a guest script must end with `poweroff -f`)");
    }
    Some(report)
}

/// The lines between `VM-RESULT-BEGIN name` and `VM-RESULT-END name`, without kernel messages that
/// the serial console interleaved; None if the guest never printed both markers.
pub fn result_section(console: &str, name: &str) -> Option<String> {
    let (begin, end) = (format!("VM-RESULT-BEGIN {name}"), format!("VM-RESULT-END {name}"));
    let mut lines = console.lines().skip_while(|l| l.trim_end() != begin).skip(1);
    let mut out = Vec::new();
    loop {
        let line = lines.next()?;
        if line.trim_end() == end {
            return Some(out.join("\n"));
        }
        if !is_kernel_line(line) {
            out.push(line);
        }
    }
}

/// Shell functions that decide which scenarios run: `scenarios` and `absent` (modules this
/// kernel's package lacks) are comma lists from the kernel command line.
const SCENARIO_SELECTION: &str = r#"vm_listed() { case ",$2," in *",$1,"*) return 0;; esac; return 1; }
vm_wants() { [ "$scenarios" = all ] || vm_listed "$1" "$scenarios"; }
vm_have() { for m in "$@"; do vm_listed "$m" "$absent" && return 1; done; return 0; }
vm_missing() { for m in "$@"; do vm_listed "$m" "$absent" && printf '%s ' "$m"; done; }"#;

/// A scenario body that runs when the kernel command line's `scenarios=` lists NAME (or is
/// `all`, the default), and the kernel has every module of `needs`; otherwise it prints
/// `VM-SKIPPED NAME: ...` with the missing modules. Its output should put results between
/// `VM-RESULT-BEGIN NAME` and `VM-RESULT-END NAME`.
pub fn scenario(name: &str, needs: &[&str], body: &str) -> String {
    let needs = needs.join(" ");
    format!(
        "if vm_wants {name}; then\n\
         if vm_have {needs}; then\n\
         echo 'VM-SCENARIO {name}'\n{body}\n\
         else echo \"VM-SKIPPED {name}: kernel $(uname -r) has no module $(vm_missing {needs})\"; fi\nfi\n"
    )
}

/// The /init script: mounts, loads those of [`GUEST_MODULES`] the kernel has (the command line's
/// `absent=` names the others, `builtin=` those built in), creates md0, lin0 (dm-0), mp0 (dm-1) and nullb0 where their
/// modules allow, runs `scenarios` (shell text, see [`scenario`]), tears the devices down and
/// powers off. A failed set-up step prints `VM-SETUP-FAILED <step>` and powers off at once.
pub fn guest_script(scenarios: &str) -> String {
    let hang_s = GUEST_HANG.as_secs();
    let hang_tenths = hang_s * 10;
    format!(
        r#"#!/bin/sh
# /init of tracerd's test VM, generated by xtask/src/vm.rs.
# Kernel command-line words key=value arrive here as environment variables.
export PATH=/sbin:/bin:/usr/sbin:/usr/bin
: "${{scenarios:=all}}" "${{absent:=}}" "${{builtin:=}}"
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mount -t debugfs debugfs /sys/kernel/debug
mount -t tracefs tracefs /sys/kernel/tracing

# poweroff -f ends qemu (-no-reboot); without it /init exits and the kernel panics.
vm_poweroff() {{ sync; poweroff -f; sleep 60; }}
vm_fail() {{ echo "VM-SETUP-FAILED $*"; vm_poweroff; }}
# vm_until WHAT COMMAND...: runs COMMAND until it succeeds. Nothing here may depend on how fast
# the guest runs, so the only bound is one for a hang ({hang_s} s): then it prints VM-HANG WHAT,
# which fails the run.
vm_until() {{
    what=$1; shift
    i=0
    until "$@"; do
        if [ $i -ge {hang_tenths} ]; then echo "VM-HANG $what"; return 1; fi
        sleep 0.1; i=$((i + 1))
    done
}}
# vm_wait_for FILE PATTERN PID: waits until FILE has PATTERN or process PID is gone.
vm_wait_for() {{
    vm_until "no '$2' in $1" vm_has_or_gone "$@" || return 1
    grep -q "$2" "$1" 2>/dev/null || echo "VM-WARNING process $3 exited before '$2' appeared in $1"
}}
vm_has_or_gone() {{ grep -q "$2" "$1" 2>/dev/null || ! kill -0 "$3" 2>/dev/null; }}

# A leading newline: the firmware leaves the cursor at the end of its last line.
printf "\nVM-BOOTED %s scenarios=%s absent=%s\n" "$(uname -r)" "$scenarios" "$absent"
{SCENARIO_SELECTION}
# A module the kernel has built in (the command line's builtin=) is there already.
vm_load() {{ vm_have "$1" && ! vm_listed "$1" "$builtin" || return 0; modprobe "$@" || vm_fail "modprobe $1"; }}
# ram0-1 md0, ram2 lin0, ram3 crypt0, ram4 delay0, ram5-6 the thin pool's metadata and data,
# ram7-8 md1 (raid10), ram16-17 md4 (raid0, both made by the md scenario), ram9-11 md2 (raid5)
# and ram12-15 md3 (raid6, both made by the raid5 scenario), ram18-26 the dmc scenario's targets.
vm_load brd rd_nr=27 rd_size=65536
vm_load raid0
vm_load raid1
vm_load raid10
vm_load dm-mod
# The thin pool's persistent data and raid456 checksum with crc32c: its implementation before
# libcrc32c.
vm_load crc32c_generic
vm_load raid456
vm_load dm-crypt
vm_load dm-delay
vm_load dm-thin-pool
vm_load dm-multipath
vm_load dm-round-robin
vm_load loop
vm_load virtio_pci
vm_load nvme
vm_load nvmet
vm_load nvmet-tcp
vm_load nvme-tcp
vm_load virtio_blk
vm_load virtio_scsi
vm_load sd_mod
vm_load kyber-iosched
vm_load bfq
# nullb0..5 for the queue-depth scenario (nullb5 then backs the ana scenario's NVMe/TCP
# namespace), nullb6 under multipath; timer completions keep
# requests in flight.
vm_load null_blk nr_devices=7 irqmode=2 completion_nsec=50000000 hw_queue_depth=64
# No udev in here: mdadm and dmsetup create their device nodes themselves.
export MDADM_NO_UDEV=1 DM_DISABLE_UDEV=1
devices=""
if vm_have brd raid1; then
    mdadm --create /dev/md0 --run --force --level=1 --raid-devices=2 --metadata=1.2 --assume-clean \
        /dev/ram0 /dev/ram1 || vm_fail "mdadm --create /dev/md0"
    devices="$devices ram0 ram1 md0"
fi
if vm_have brd dm-mod; then
    dmsetup create lin0 --table "0 131072 linear /dev/ram2 0" || vm_fail "dmsetup create lin0"
    devices="$devices ram2 dm-0 mapper/lin0"
fi
# Request-based dm: a one-path multipath device (dm-1) over nullb6.
if vm_have dm-mod dm-multipath dm-round-robin null_blk; then
    dmsetup create mp0 --table "0 131072 multipath 0 0 1 1 round-robin 0 1 1 /dev/nullb6 1" \
        || vm_fail "dmsetup create mp0"
    devices="$devices dm-1 mapper/mp0"
fi
vm_have null_blk && devices="$devices nullb0 nullb6"
for d in $devices; do
    [ -b /dev/$d ] || vm_fail "/dev/$d is missing"
done
echo VM-SETUP-DONE

{scenarios}
echo VM-TEARDOWN
[ -b /dev/mapper/mp0 ] && dmsetup remove mp0
[ -b /dev/mapper/lin0 ] && dmsetup remove lin0
[ -b /dev/md0 ] && mdadm --stop /dev/md0
echo VM-DONE
# PREEMPT_RT writes the console from a thread: give it a moment to send the last lines before
# the power goes (the run's result is already complete; this only keeps the log whole).
sleep 1
vm_poweroff
"#
    )
}

/// Proves the chain: the devices exist, iogen and tracerd run, and tracerd reports on nullb0.
pub fn smoke_scenario() -> String {
    scenario(
        "smoke",
        &["null_blk"],
        r#"echo "block devices: $(ls /sys/block | tr '\n' ' ')"
/bin/iogen /dev/nullb0 read 100 4096 1
/bin/tracerd --version
/bin/tracerd report --duration 600 --json --device nullb0 >/tmp/report.json 2>/tmp/report.err &
report=$!
# Loading takes a second or more under TCG: start the IO once tracerd says it is attached, and
# end the capture once the IO is done (the report drains every record before it exits).
vm_wait_for /tmp/report.err "attached [0-9]* hooks" $report
/bin/iogen /dev/nullb0 read 500 4096 4
kill -INT $report
wait $report
echo "tracerd report exit status: $?"
echo "VM-RESULT-BEGIN smoke"
cat /tmp/report.json
echo "VM-RESULT-END smoke"
echo "--- tracerd report stderr:"
cat /tmp/report.err
echo "--- end of tracerd report stderr""#,
    )
}

/// Runs `f` as a named step, logging its duration and naming it in the error.
fn step<T>(name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let start = Instant::now();
    eprintln!("xtask: vm-test: {name}");
    let result = f().with_context(|| format!("vm-test step \"{name}\" failed"));
    eprintln!("xtask: vm-test: {name}: {:.1} s", start.elapsed().as_secs_f64());
    result
}

/// A finished guest run: its console log and what it ran on.
pub struct VmRun {
    pub kernel: VmKernel,
    pub log: PathBuf,
    /// Modules of [`GUEST_MODULES`] the kernel lacks (their scenarios skipped).
    pub absent: Vec<&'static str>,
    /// Boot to power-off.
    pub guest_seconds: f64,
}

/// Static binaries and tests every kernel's initramfs carries, built once per xtask run.
pub struct GuestBinaries {
    tracerd: PathBuf,
    iogen: PathBuf,
    host_tests: PathBuf,
    cgroup_tests: PathBuf,
}

/// Builds the eBPF object and the static binaries and tests the guest runs.
pub fn build_guest_binaries() -> Result<GuestBinaries> {
    step("install VM packages", ensure_vm_packages)?;
    // Only the eBPF object: the static build below compiles tracerd itself.
    step("build the eBPF object", || {
        setup::ensure(false)?;
        crate::build_ebpf()
    })?;
    // The guest runs the binary `cargo xtask dist` ships.
    let tracerd = step("build the static binary (dist)", crate::dist::static_binary)?;
    let iogen = step("build iogen", || build_static(&["tracerd-tests"], &["iogen"]))?.remove(0);
    Ok(GuestBinaries {
        tracerd,
        iogen,
        host_tests: step("build the host-kernel tests", || {
            build_static_test("tracerd-tests", "host_kernel")
        })?,
        cgroup_tests: step("build the cgroup tests", || build_static_test("tracerd-tests", "cgroups"))?,
    })
}

/// Builds `target/vm/STEM.cpio` for `kernel`: the modules of [`GUEST_MODULES`] it has, the guest
/// binaries, `tools` (guest path, host command) with their shared libraries, and an /init that
/// runs `scenarios_text`; boots it running the scenarios `names` and returns the console
/// (also in `target/vm/STEM.log`) and the modules the kernel lacks.
pub fn boot_guest(
    kernel: &VmKernel,
    bins: &GuestBinaries,
    tools: &[(&str, &str)],
    stem: &str,
    scenarios_text: &str,
    names: &[&str],
    timeout: Duration,
) -> Result<(String, Vec<&'static str>)> {
    let absent = kernel.absent_modules(GUEST_MODULES)?;
    if !absent.is_empty() {
        eprintln!(
            "xtask: vm-test: kernel {} has no module {}: the scenarios that need them will say SKIPPED",
            kernel.version,
            absent.join(", ")
        );
    }
    let builtin = kernel.builtin_modules(GUEST_MODULES);
    let present: Vec<&str> =
        GUEST_MODULES.iter().copied().filter(|m| !absent.contains(m) && !builtin.contains(m)).collect();
    let initramfs = out_dir().join(format!("{stem}.cpio"));
    step("build the initramfs", || {
        let mut files = kernel.module_files(&present, &out_dir().join(stem))?;
        files.push(("/bin/tracerd".into(), bins.tracerd.clone()));
        files.push(("/bin/iogen".into(), bins.iogen.clone()));
        // The host-kernel tests, run on this second kernel: the harness finds iogen at
        // <test dir>/../iogen.
        files.push(("/t/deps/host_kernel".into(), bins.host_tests.clone()));
        files.push(("/t/deps/cgroups".into(), bins.cgroup_tests.clone()));
        files.push(("/t/iogen".into(), bins.iogen.clone()));
        for (guest, tool) in tools {
            let host = which(tool).with_context(|| format!("{tool} is missing on this machine"))?;
            for lib in shared_libraries(&host)? {
                files.push((lib.to_string_lossy().into_owned(), lib));
            }
            files.push((guest.to_string(), host));
        }
        build_initramfs(&initramfs, &files, &guest_script(scenarios_text))
    })?;
    let cmdline =
        format!("scenarios={} absent={} builtin={}", names.join(","), absent.join(","), builtin.join(","));
    let console = step(&format!("boot kernel {} ({})", kernel.version, names.join(", ")), || {
        boot(kernel, &initramfs, &cmdline, timeout)
    })?;
    Ok((console, absent))
}

/// [`run_scenarios`] on each of `kernels`, two guests at a time: under TCG with
/// `thread=single` a guest keeps one host core busy, and these machines have two. The longest
/// (the last: the PREEMPT_RT build) starts first. Kernels are fetched one by one before (apt is
/// not run twice at once). Results come back in the order of `kernels`.
pub fn run_kernels(
    kernels: &[KernelSeries],
    bins: &GuestBinaries,
    scenarios: &[&str],
    assert_results: bool,
) -> Vec<Result<VmRun>> {
    let fetched: Vec<Result<()>> = kernels
        .iter()
        .map(|k| step(&format!("fetch kernel {}", k.name), || kernel(*k)).map(|_| ()))
        .collect();
    let queue = std::sync::Mutex::new((0..kernels.len()).collect::<Vec<_>>());
    let results: Vec<std::sync::Mutex<Option<Result<VmRun>>>> =
        kernels.iter().map(|_| std::sync::Mutex::new(None)).collect();
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 2);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    // Its own statement: the guard must not live through the guest's run.
                    let next = queue.lock().unwrap_or_else(|e| e.into_inner()).pop();
                    let Some(i) = next else { break };
                    let result = match &fetched[i] {
                        Ok(()) => run_scenarios(kernels[i], bins, scenarios, assert_results),
                        Err(e) => Err(anyhow::anyhow!("{e:#}")),
                    };
                    *results[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
                }
            });
        }
    });
    results
        .into_iter()
        .map(|r| {
            r.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or_else(|| Err(anyhow::anyhow!("the guest's thread ended without a result")))
        })
        .collect()
}

/// Boots `series` with `scenarios` (names from [`vm_scenarios::NAMES`]), checks the chain
/// worked, and returns the run for the assertions in tests/tests/vm.rs. With `assert_results`
/// off (one scenario, for development) only the guest's own failures fail it.
pub fn run_scenarios(
    series: KernelSeries,
    bins: &GuestBinaries,
    scenarios: &[&str],
    assert_results: bool,
) -> Result<VmRun> {
    let total = Instant::now();
    let kernel = step(&format!("fetch kernel {}", series.name), || kernel(series))?;
    let guest = Instant::now();
    let (console, absent) = boot_guest(
        &kernel,
        bins,
        &[],
        &format!("tracerd-vm-{}", series.name),
        &(smoke_scenario() + &vm_scenarios::all()),
        scenarios,
        VM_HANG,
    )?;
    let guest_seconds = guest.elapsed().as_secs_f64();
    let log = out_dir().join(format!("tracerd-vm-{}.log", series.name));
    eprintln!("xtask: vm-test: console log: {}", log.display());

    let report = |problem: &str| {
        anyhow::anyhow!(
            "kernel {}: {problem}\nLast console lines:\n{}\nconsole log: {}",
            kernel.version,
            tail(&console, 60),
            log.display()
        )
    };
    if let Some(line) = console.lines().find(|l| l.starts_with("VM-SETUP-FAILED")) {
        return Err(report(&format!("the guest set-up failed: {line}")));
    }
    if let Some(line) = console.lines().find(|l| l.starts_with("VM-HANG")) {
        return Err(report(&format!(
            "a guest step hung ({} s without progress): {line}",
            GUEST_HANG.as_secs()
        )));
    }
    for marker in ["VM-SETUP-DONE", "VM-DONE"] {
        if !console.lines().any(|l| l == marker) {
            return Err(report(&format!("the guest never printed {marker}")));
        }
    }
    // What tracerd chose on this kernel, for the test log (tests/tests/vm.rs asserts it).
    if let Some(doctor) = result_section(&console, "doctor_text") {
        eprintln!("xtask: vm-test: tracerd doctor on {}:\n{doctor}", kernel.version);
    }
    let run = VmRun { kernel: kernel.clone(), log: log.clone(), absent, guest_seconds };
    if !assert_results || !scenarios.contains(&"smoke") || console.contains("VM-SKIPPED smoke:") {
        return Ok(run);
    }
    let json = result_section(&console, "smoke").ok_or_else(|| report("no smoke result markers"))?;
    let status = console.lines().find_map(|l| l.strip_prefix("tracerd report exit status: ")).unwrap_or("?");
    if status != "0" || json.trim().is_empty() {
        let stderr: Vec<&str> = console
            .lines()
            .skip_while(|l| *l != "--- tracerd report stderr:")
            .skip(1)
            .take_while(|l| *l != "--- end of tracerd report stderr")
            .collect();
        bail!(
            "kernel {}: the VM chain works (modules, md0, dm-0, nullb0, iogen), but `tracerd report` in \
             the guest failed (exit status {status}).\ntracerd's stderr:\n{}\nconsole log: {}",
            kernel.version,
            stderr.join("\n"),
            run.log.display()
        );
    }
    eprintln!(
        "xtask: vm-test: kernel {}: guest run complete in {:.1} s ({:.1} s with building)",
        kernel.version,
        guest_seconds,
        total.elapsed().as_secs_f64()
    );
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_section_skips_kernel_lines() {
        let console =
            "noise\nVM-RESULT-BEGIN a\n{\"x\":\n[    3.141592] md: md0 stopped.\n1}\nVM-RESULT-END a\n";
        assert_eq!(result_section(console, "a").as_deref(), Some("{\"x\":\n1}"));
        assert_eq!(result_section(console, "b"), None);
        assert_eq!(result_section("VM-RESULT-BEGIN a\nunterminated\n", "a"), None);
    }

    #[test]
    fn escapes_are_stripped() {
        assert_eq!(strip_escapes("\x1bc\x1b[?7l\x1b[2J\x1b[0mSeaBIOS\r\nok\r\n"), "SeaBIOS\nok\n");
    }

    #[test]
    fn kernel_lines() {
        assert!(is_kernel_line("[    0.000000] Linux version 6.1.0"));
        assert!(is_kernel_line("[12345.123456] BUG: kernel NULL pointer dereference"));
        assert!(!is_kernel_line("[1.5] json"));
        assert!(!is_kernel_line("BUG: printed by a script"));
    }

    #[test]
    fn crash_detection() {
        let ok = "[    1.000000] brd: module loaded\nBUG: not from the kernel\nVM-DONE\n";
        assert_eq!(kernel_crash(ok), None);
        let crashed =
            "[    1.000000] x\n[    2.000000] Kernel panic - not syncing: Attempted to kill init!\n";
        let report = kernel_crash(crashed).unwrap();
        assert!(report.contains("Kernel panic") && report.contains("poweroff -f"), "{report}");
    }

    /// A minimal ELF64 with one PT_NOTE segment holding `notes`.
    fn elf_with_notes(notes: &[(&[u8], u32)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (name, kind) in notes {
            for w in [name.len() as u32, 4, *kind] {
                body.extend_from_slice(&w.to_le_bytes());
            }
            body.extend_from_slice(name);
            body.resize(body.len().div_ceil(4) * 4, 0);
            body.extend_from_slice(&[1, 2, 3, 4]);
        }
        let mut elf = vec![0u8; 64 + 56];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[32..40].copy_from_slice(&64u64.to_le_bytes()); // e_phoff
        elf[54..56].copy_from_slice(&56u16.to_le_bytes()); // e_phentsize
        elf[56..58].copy_from_slice(&1u16.to_le_bytes()); // e_phnum
        elf[64..68].copy_from_slice(&PT_NOTE.to_le_bytes());
        elf[72..80].copy_from_slice(&120u64.to_le_bytes()); // p_offset
        elf[96..104].copy_from_slice(&(body.len() as u64).to_le_bytes()); // p_filesz
        elf.extend_from_slice(&body);
        elf
    }

    #[test]
    fn pvh_note() {
        let pvh = elf_with_notes(&[(b"GNU\0", 3), (b"Xen\0", XEN_ELFNOTE_PHYS32_ENTRY)]);
        assert!(has_pvh_note(&pvh).unwrap());
        assert!(!has_interp(&pvh).unwrap());
        assert!(!has_pvh_note(&elf_with_notes(&[(b"Xen\0", 6), (b"GNU\0", 18)])).unwrap());
    }

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

    /// The selection as the guest's shell runs it (busybox sh there; sh here).
    #[test]
    fn scenarios_run_when_chosen_and_skip_loudly_without_their_modules() {
        let guest = |scenarios: &str, absent: &str| {
            let script = format!(
                "{SCENARIO_SELECTION}\nscenarios={scenarios}\nabsent={absent}\n{}{}",
                scenario("md", &["brd", "raid1"], "echo md ran"),
                scenario("cg", &[], "echo cg ran")
            );
            let out = Command::new("sh").arg("-c").arg(&script).output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8(out.stdout).unwrap()
        };
        assert_eq!(guest("all", ""), "VM-SCENARIO md\nmd ran\nVM-SCENARIO cg\ncg ran\n");
        assert_eq!(guest("cg,doctor", ""), "VM-SCENARIO cg\ncg ran\n");
        let skipped = guest("all", "loop,raid1");
        assert!(
            skipped.starts_with("VM-SKIPPED md: kernel ") && skipped.contains("has no module raid1 \n"),
            "{skipped}"
        );
        assert!(skipped.ends_with("VM-SCENARIO cg\ncg ran\n"), "{skipped}");
    }

    #[test]
    fn kernel_series_own_their_builds_only() {
        let by = |name: &str| KERNELS.iter().find(|k| k.name == name).unwrap();
        assert!(by("6.1").owns("6.1.0-57-amd64"));
        assert!(!by("6.1").owns("6.12.117+deb12-amd64"), "6.12 is not 6.1");
        assert!(!by("6.1").owns("6.1.0-57-rt-amd64"));
        assert!(by("6.12").owns("6.12.117+deb12-amd64"));
        assert!(!by("6.12").owns("6.12.117+deb12-rt-amd64"));
        assert!(by("6.12-rt").owns("6.12.117+deb12-rt-amd64"));
        assert!(by("6.12-cloud").owns("6.12.117+deb12-cloud-amd64"));
        let names = |arg: &str| KernelSeries::select(arg).unwrap().iter().map(|k| k.name).collect::<Vec<_>>();
        assert_eq!(names("all"), ["6.1", "6.12", "6.12-rt"]);
        assert_eq!(names("6.12-rt,6.1"), ["6.12-rt", "6.1"]);
        let err = KernelSeries::select("5.10").unwrap_err().to_string();
        assert!(err.contains("6.12-rt") && err.contains("all"), "{err}");
    }

    #[test]
    fn bzimage_payload_from_the_setup_header() {
        let mut image = vec![0u8; 0x1000];
        image[0x1f1] = 2; // setup sectors: code starts at 3 * 512
        image[0x202..0x206].copy_from_slice(b"HdrS");
        image[0x248..0x24c].copy_from_slice(&0x100u32.to_le_bytes());
        image[0x24c..0x250].copy_from_slice(&6u32.to_le_bytes());
        image[0x700..0x706].copy_from_slice(XZ_MAGIC);
        assert_eq!(bzimage_payload(&image).unwrap(), XZ_MAGIC);
        image[0x24c..0x250].copy_from_slice(&0x1000u32.to_le_bytes());
        assert!(bzimage_payload(&image).is_err(), "past the end of the file");
        assert!(bzimage_payload(&[0u8; 0x300]).is_err(), "no HdrS");
    }

    #[test]
    fn elf_checks_on_host_files() {
        // The xtask binary itself: dynamically linked on glibc hosts.
        let me = fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(program_headers(&me).is_ok());
        assert!(!has_pvh_note(&me).unwrap());
        assert!(program_headers(b"not an elf file, but long enough to be read as a header........").is_err());
    }
}
