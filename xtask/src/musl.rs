//! Static (musl) builds: the binaries and tests the VM's bare initramfs runs, each checked to
//! need no ELF loader, and the stripped binary (with its checksum) that `dist` ships and the VM
//! boots.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, ensure};

use crate::{elf::has_interp, root_dir, run, setup};

const MUSL: &str = "x86_64-unknown-linux-musl";

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

/// Builds the musl target of `packages` and returns the paths of `bins`, each checked to be
/// static (no ELF interpreter), so they run in the bare initramfs.
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

/// Where `dist` puts what it builds.
pub fn dist_dir() -> PathBuf {
    root_dir().join("target/dist")
}

/// The static binary (musl, the eBPF object inside, stripped) and its `.sha256`, in
/// `target/dist/`: what `dist` ships and what the VM tests boot. The eBPF object must be built.
pub fn static_binary() -> Result<PathBuf> {
    setup::apt_install(&["binutils"], "the static binary (strip)")?;
    ensure_musl_target()?;
    let built = build_static(&["tracerd"], &["tracerd"])?.remove(0);
    let out = dist_dir();
    fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let binary = out.join(format!("tracerd-{}-x86_64-linux-musl", env!("CARGO_PKG_VERSION")));
    fs::copy(&built, &binary)
        .with_context(|| format!("cannot copy {} to {}", built.display(), binary.display()))?;
    run(Command::new("strip").arg("--strip-all").arg(&binary), "strip")?;
    write_checksum(&binary)?;
    Ok(binary)
}

/// `NAME.sha256` beside `file`, in `sha256sum`'s format (so `sha256sum -c` checks it).
pub fn write_checksum(file: &Path) -> Result<()> {
    let dir = file.parent().context("no directory")?;
    let name = file.file_name().context("no file name")?;
    let out =
        Command::new("sha256sum").arg(name).current_dir(dir).output().context("cannot run sha256sum")?;
    ensure!(out.status.success(), "sha256sum {} failed", file.display());
    fs::write(dir.join(format!("{}.sha256", name.to_string_lossy())), out.stdout)?;
    Ok(())
}
