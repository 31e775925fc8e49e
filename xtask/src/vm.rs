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
];
const MUSL: &str = "x86_64-unknown-linux-musl";
/// Bounds on a hang, not on speed: a TCG guest on a loaded host is many times slower than one on
/// an idle host, and no step may fail for that. One guest step (a tracer attaching, a count
/// reached) gets GUEST_HANG; the whole guest run, VM_HANG.
const GUEST_HANG: Duration = Duration::from_secs(300);
const VM_HANG: Duration = Duration::from_secs(2400);
/// Debian's meta package; it depends on the concrete `linux-image-<abi>-amd64`.
const KERNEL_META: &str = "linux-image-amd64";
/// Modules the guest prologue loads (their dependencies come along, see [`VmKernel::module_files`]).
pub const GUEST_MODULES: &[&str] =
    &["brd", "raid1", "dm-mod", "dm-multipath", "dm-round-robin", "null_blk", "loop"];
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
/// Start of an xz stream; Debian compresses vmlinuz's payload with xz.
const XZ_MAGIC: &[u8] = &[0xfd, b'7', b'z', b'X', b'Z', 0];

/// Where downloads and the unpacked kernel live (ignored by git); delete it to fetch a newer kernel.
pub fn cache_dir() -> PathBuf {
    root_dir().join(".vm-cache")
}

/// Where initramfs images and console logs go.
pub fn out_dir() -> PathBuf {
    root_dir().join("target/vm")
}

/// A kernel that qemu can boot, with its modules.
#[derive(Debug, Clone)]
pub struct VmKernel {
    /// Uncompressed vmlinux (booted through its PVH note, 2.6 s faster under TCG) or vmlinuz.
    pub image: PathBuf,
    /// `uname -r` in the guest, e.g. `6.1.0-57-amd64`.
    pub version: String,
    /// `.../lib/modules/<version>` of the unpacked package.
    pub modules_dir: PathBuf,
}

/// Installs qemu, busybox-static, mdadm, dmsetup, xz and the musl Rust target where missing.
pub fn ensure_vm_packages() -> Result<()> {
    setup::apt_install(VM_PACKAGES, "the VM tests (cargo xtask vm-test)")?;
    let installed = setup::output("rustup", &["target", "list", "--installed"])
        .context("rustup is needed to add the musl target: install it from https://rustup.rs")?;
    if !installed.lines().any(|l| l.trim() == MUSL) {
        eprintln!("xtask: adding the Rust target {MUSL} (static binaries for the VM)");
        run(Command::new("rustup").args(["target", "add", MUSL]), &format!("rustup target add {MUSL}"))?;
    }
    Ok(())
}

/// The Debian kernel, downloaded and unpacked into [`cache_dir`] on first use; later calls only
/// read the cache (no apt, no network).
pub fn kernel() -> Result<VmKernel> {
    let cache = cache_dir();
    let ready = cache.join("kernel.ready");
    if let Some(k) = fs::read_to_string(&ready).ok().and_then(|s| parse_ready(&s, &cache)) {
        return Ok(k);
    }
    let pkg = kernel_package()?;
    let download = cache.join("download");
    let _ = fs::remove_dir_all(&download);
    fs::create_dir_all(&download).with_context(|| format!("cannot create {}", download.display()))?;
    eprintln!("xtask: downloading {pkg} (about 70 MB, once)");
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
    let k = VmKernel { image, modules_dir: modules_root.join(&version), version };
    // Written last: a run interrupted above starts over instead of using half a cache. Paths are
    // relative to the cache, so a moved or symlinked cache stays valid.
    let rel = |p: &Path| p.strip_prefix(&cache).map(Path::to_path_buf).unwrap_or_else(|_| p.to_path_buf());
    fs::write(
        &ready,
        format!(
            "image={}\nversion={}\nmodules={}\n",
            rel(&k.image).display(),
            k.version,
            rel(&k.modules_dir).display()
        ),
    )?;
    Ok(k)
}

fn parse_ready(text: &str, cache: &Path) -> Option<VmKernel> {
    let fields: HashMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
    let k = VmKernel {
        image: cache.join(fields.get("image")?),
        version: fields.get("version")?.to_string(),
        modules_dir: cache.join(fields.get("modules")?),
    };
    (k.image.is_file() && k.modules_dir.is_dir()).then_some(k)
}

/// The concrete kernel package the meta package points at, e.g. `linux-image-6.1.0-57-amd64`.
fn kernel_package() -> Result<String> {
    let find = || {
        let deps = setup::output("apt-cache", &["depends", KERNEL_META])?;
        deps.lines()
            .filter_map(|l| l.trim().strip_prefix("Depends: "))
            .map(str::trim)
            .find(|d| d.starts_with("linux-image-") && !d.starts_with('<'))
            .map(str::to_string)
    };
    if let Some(pkg) = find() {
        return Ok(pkg);
    }
    if !setup::is_root() {
        bail!("apt does not know {KERNEL_META}: run `sudo apt-get update`, then this command again");
    }
    run(Command::new("apt-get").args(["update", "-q"]), "apt-get update")?;
    find().with_context(|| {
        format!("apt-cache depends {KERNEL_META} names no linux-image-* package (is this Debian bookworm?)")
    })
}

/// Extracts the xz payload of a bzImage into an ELF vmlinux that qemu boots through its PVH note.
fn uncompress_kernel(vmlinuz: &Path, out: &Path) -> Result<()> {
    let image = fs::read(vmlinuz)?;
    let start = find(&image, XZ_MAGIC).context("no xz stream in vmlinuz")?;
    let tmp = out.with_extension("tmp");
    let mut child = Command::new("xz")
        // The payload is followed by other data; stop at the end of the first stream.
        .args(["-dc", "--single-stream"])
        .stdin(Stdio::piped())
        .stdout(fs::File::create(&tmp)?)
        .spawn()
        .context("cannot start xz (apt-get install xz-utils)")?;
    let mut stdin = child.stdin.take().expect("piped");
    let feeder = thread::spawn(move || stdin.write_all(&image[start..]));
    let status = child.wait()?;
    // xz may stop reading before the trailing data: a broken pipe here is fine.
    let _ = feeder.join();
    ensure!(status.success(), "xz -dc failed ({status})");
    let elf = fs::read(&tmp)?;
    ensure!(has_pvh_note(&elf)?, "the uncompressed kernel has no PVH entry note; qemu cannot boot it");
    fs::rename(&tmp, out)?;
    Ok(())
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

/// Module name with `_` for `-` (as the kernel spells it) -> path relative to the modules dir.
fn module_index(modules_dir: &Path) -> Result<HashMap<String, String>> {
    let mut index = HashMap::new();
    let mut stack = vec![modules_dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).with_context(|| format!("cannot read {}", dir.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Some(stem) =
                path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".ko"))
            {
                let rel = path.strip_prefix(modules_dir)?.to_string_lossy().into_owned();
                index.insert(stem.replace('-', "_"), rel);
            }
        }
    }
    ensure!(!index.is_empty(), "no uncompressed .ko modules under {}", modules_dir.display());
    Ok(index)
}

/// The `depends=` entry of a module's .modinfo section.
fn module_depends(ko: &Path) -> Result<Vec<String>> {
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
    let append = format!("console=ttyS0 oops=panic panic=-1 quiet {cmdline_extra}");
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-accel", "tcg,thread=single", "-cpu", "max", "-m", "1G", "-smp", "2"])
        .args(["-nographic", "-no-reboot", "-nic", "none", "-kernel"])
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

/// A scenario body that runs when the kernel command line has `scenario=NAME` or `scenario=all`
/// (the default). Its output should put results between `VM-RESULT-BEGIN NAME` and
/// `VM-RESULT-END NAME`.
pub fn scenario(name: &str, body: &str) -> String {
    format!(
        "if [ \"$scenario\" = all ] || [ \"$scenario\" = {name} ]; then\n\
         echo 'VM-SCENARIO {name}'\n{body}\nfi\n"
    )
}

/// The /init script: mounts, loads [`GUEST_MODULES`], creates md0, lin0 (dm-0) and nullb0, runs
/// `scenarios` (shell text, see [`scenario`]), tears the devices down and powers off. A failed
/// set-up step prints `VM-SETUP-FAILED <step>` and powers off at once.
pub fn guest_script(scenarios: &str) -> String {
    let hang_s = GUEST_HANG.as_secs();
    let hang_tenths = hang_s * 10;
    format!(
        r#"#!/bin/sh
# /init of tracerd's test VM, generated by xtask/src/vm.rs.
# Kernel command-line words key=value arrive here as environment variables.
export PATH=/sbin:/bin:/usr/sbin:/usr/bin
: "${{scenario:=all}}"
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
printf "\nVM-BOOTED %s scenario=%s\n" "$(uname -r)" "$scenario"
modprobe brd rd_nr=3 rd_size=65536 || vm_fail "modprobe brd"
modprobe raid1 || vm_fail "modprobe raid1"
modprobe dm-mod || vm_fail "modprobe dm-mod"
modprobe dm-multipath || vm_fail "modprobe dm-multipath"
modprobe dm-round-robin || vm_fail "modprobe dm-round-robin"
modprobe loop || vm_fail "modprobe loop"
# nullb0..5 for the queue-depth scenario, nullb6 under multipath; timer completions keep
# requests in flight.
modprobe null_blk nr_devices=7 irqmode=2 completion_nsec=50000000 hw_queue_depth=64 \
    || vm_fail "modprobe null_blk"
# No udev in here: mdadm and dmsetup create their device nodes themselves.
export MDADM_NO_UDEV=1 DM_DISABLE_UDEV=1
mdadm --create /dev/md0 --run --force --level=1 --raid-devices=2 --metadata=1.2 --assume-clean \
    /dev/ram0 /dev/ram1 || vm_fail "mdadm --create /dev/md0"
dmsetup create lin0 --table "0 131072 linear /dev/ram2 0" || vm_fail "dmsetup create lin0"
# Request-based dm: a one-path multipath device (dm-1) over nullb6.
dmsetup create mp0 --table "0 131072 multipath 0 0 1 1 round-robin 0 1 1 /dev/nullb6 1" \
    || vm_fail "dmsetup create mp0"
for d in ram0 ram1 ram2 md0 dm-0 dm-1 nullb0 nullb6 mapper/lin0; do
    [ -b /dev/$d ] || vm_fail "/dev/$d is missing"
done
echo VM-SETUP-DONE

{scenarios}
echo VM-TEARDOWN
dmsetup remove mp0
dmsetup remove lin0
mdadm --stop /dev/md0
echo VM-DONE
vm_poweroff
"#
    )
}

/// Proves the chain: the devices exist, iogen and tracerd run, and tracerd reports on nullb0.
pub fn smoke_scenario() -> String {
    scenario(
        "smoke",
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

/// Builds everything, boots the guest with every scenario (or only `only`, for development),
/// checks the chain worked, and returns the console log for the assertions in tests/tests/vm.rs.
pub fn run_scenarios(only: Option<&str>) -> Result<PathBuf> {
    let total = Instant::now();
    step("install VM packages", ensure_vm_packages)?;
    // Only the eBPF object: the static build below compiles tracerd itself.
    step("build the eBPF object", || {
        setup::ensure(false)?;
        crate::build_ebpf()
    })?;
    let bins =
        step("build static binaries", || build_static(&["tracerd", "tracerd-tests"], &["tracerd", "iogen"]))?;
    let host_tests =
        step("build the host-kernel tests", || build_static_test("tracerd-tests", "host_kernel"))?;
    let cgroup_tests = step("build the cgroup tests", || build_static_test("tracerd-tests", "cgroups"))?;
    let kernel = step("fetch the kernel", kernel)?;
    let initramfs = out_dir().join("tracerd-vm.cpio");
    step("build the initramfs", || {
        let mut files = kernel.module_files(GUEST_MODULES, &out_dir())?;
        files.push(("/bin/tracerd".into(), bins[0].clone()));
        files.push(("/bin/iogen".into(), bins[1].clone()));
        // The host-kernel tests, run on this second kernel: the harness finds iogen at
        // <test dir>/../iogen.
        files.push(("/t/deps/host_kernel".into(), host_tests.clone()));
        files.push(("/t/deps/cgroups".into(), cgroup_tests.clone()));
        files.push(("/t/iogen".into(), bins[1].clone()));
        build_initramfs(&initramfs, &files, &guest_script(&(smoke_scenario() + &vm_scenarios::all())))
    })?;
    let console = step("boot the VM", || {
        boot(&kernel, &initramfs, &format!("scenario={}", only.unwrap_or("all")), VM_HANG)
    })?;
    let log = out_dir().join("tracerd-vm.log");
    eprintln!("xtask: vm-test: console log: {}", log.display());

    let report = |problem: &str| {
        anyhow::anyhow!(
            "{problem}\nLast console lines:\n{}\nconsole log: {}",
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
    if only.is_some() {
        return Ok(log);
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
            "the VM chain works (modules, md0, dm-0, nullb0, iogen), but `tracerd report` in the guest \
             failed (exit status {status}).\ntracerd's stderr:\n{}\nconsole log: {}",
            stderr.join("\n"),
            log.display()
        );
    }
    eprintln!("xtask: vm-test: guest run complete in {:.1} s", total.elapsed().as_secs_f64());
    Ok(log)
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
        fs::remove_dir_all(&dir).unwrap();
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
