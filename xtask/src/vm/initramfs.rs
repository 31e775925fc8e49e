//! The guest's initramfs: busybox and its applets, host tools with their shared libraries, the
//! mount points, `/dev/console`, `/init` and the given files, as one newc cpio archive.

mod cpio;

use std::{
    collections::BTreeMap,
    fs,
    io::BufWriter,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail, ensure};

use crate::{elf::has_interp, setup};
use cpio::CpioWriter;

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

pub fn which(cmd: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .map(|d| Path::new(d).join(cmd))
        .find(|p| p.is_file())
}

/// What `ldd` lists for a binary, including the ELF interpreter.
pub fn shared_libraries(bin: &Path) -> Result<Vec<PathBuf>> {
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
