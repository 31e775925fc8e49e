//! Debian kernels for the VM: which build a series means, its download and unpacking into the
//! cache, and the uncompressed vmlinux qemu boots.

use std::{
    collections::HashMap,
    fs,
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
};

use anyhow::{Context, Result, bail, ensure};

use super::cache_dir;
use crate::{elf::has_pvh_note, run, setup};

/// Starts of an xz and a zstd stream: Debian compresses vmlinuz's payload with one of them.
const XZ_MAGIC: &[u8] = &[0xfd, b'7', b'z', b'X', b'Z', 0];
const ZSTD_MAGIC: &[u8] = &[0x28, 0xb5, 0x2f, 0xfd];

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
        "{meta} now depends on {pkg}, which is not a {} kernel: add a series for it in xtask/src/vm/kernel.rs",
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
