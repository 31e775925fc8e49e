//! Installs what a fresh machine lacks, or says exactly what to install.
//! Every step checks first, so a set-up machine costs a few milliseconds.

use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::run;

const BPF_LINKER_VERSION: &str = "0.13.0";
const LLVM: &str = "/usr/lib/llvm-22";
/// What bpf-linker needs to build against Debian's LLVM 22.
const LINKER_BUILD_PACKAGES: &[&str] = &["llvm-22-dev", "libpolly-22-dev", "libzstd-dev", "zlib1g-dev"];
/// What the integration tests drive IO and check with.
/// (podman and runc run the image, man-db renders the package's man pages.)
const TEST_PACKAGES: &[&str] = &[
    "fio",
    "util-linux",
    "fdisk",
    "cpio",
    "prometheus",
    "systemd",
    "curl",
    "openssl",
    "tmux",
    "podman",
    "runc",
    "man-db",
];

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc_geteuid() == 0 }
}

unsafe extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

pub(crate) fn output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn is_debian() -> bool {
    std::path::Path::new("/etc/debian_version").exists()
}

fn package_installed(pkg: &str) -> bool {
    output("dpkg-query", &["-W", "-f=${Status}", pkg]).is_some_and(|s| s.contains("install ok installed"))
}

/// Installs Debian packages that are missing (one `apt-get update` first).
pub(crate) fn apt_install(pkgs: &[&str], why: &str) -> Result<()> {
    let missing: Vec<&str> = pkgs.iter().copied().filter(|p| !package_installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_debian() || !is_root() {
        bail!(
            "{why} needs these packages, which are missing: {}. This is not a Debian machine \
             or not root, so install them yourself (Debian/Ubuntu: sudo apt-get install {}), \
             then run this command again.",
            missing.join(" "),
            missing.join(" ")
        );
    }
    eprintln!("xtask: installing {} ({why})", missing.join(" "));
    run(Command::new("apt-get").args(["update", "-q"]), "apt-get update")?;
    run(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
        "apt-get install",
    )
}

fn ensure_rust_src() -> Result<()> {
    let installed = output("rustup", &["component", "list", "--toolchain", "nightly", "--installed"]);
    match installed {
        None => bail!(
            "the nightly Rust toolchain is missing (it builds the eBPF object): \
             rustup toolchain install nightly --component rust-src"
        ),
        Some(list) if list.lines().any(|l| l.starts_with("rust-src")) => Ok(()),
        Some(_) => {
            eprintln!("xtask: adding rust-src to the nightly toolchain");
            run(
                Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]),
                "rustup component add rust-src --toolchain nightly",
            )
        }
    }
}

fn ensure_bpf_linker() -> Result<()> {
    if output("bpf-linker", &["--version"]).is_some_and(|v| v.contains(BPF_LINKER_VERSION)) {
        return Ok(());
    }
    apt_install(LINKER_BUILD_PACKAGES, "building bpf-linker against LLVM 22")?;
    eprintln!("xtask: installing bpf-linker {BPF_LINKER_VERSION} (about a minute)");
    let path = format!("{LLVM}/bin:{}", std::env::var("PATH").unwrap_or_default());
    run(
        Command::new("cargo")
            .args(["install", "--locked", &format!("bpf-linker@{BPF_LINKER_VERSION}")])
            .args(["--no-default-features", "--features", "llvm-22"])
            .env("LLVM_PREFIX", LLVM)
            .env("PATH", path)
            .env_remove("RUSTUP_TOOLCHAIN"),
        "cargo install bpf-linker",
    )
    .context("bpf-linker is needed to link the eBPF object")?;
    // cargo installs into ~/.cargo/bin; make sure the nightly build finds it.
    if output("bpf-linker", &["--version"]).is_none() {
        bail!("bpf-linker was installed but is not on PATH: add ~/.cargo/bin to PATH");
    }
    Ok(())
}

/// Everything the build needs, plus (with `for_tests`) what the tests need.
pub fn ensure(for_tests: bool) -> Result<()> {
    ensure_rust_src()?;
    ensure_bpf_linker()?;
    if for_tests {
        let had_prometheus = package_installed("prometheus");
        apt_install(TEST_PACKAGES, "the integration tests")?;
        if !had_prometheus {
            // The tests run their own server on a free loopback port; where systemd started the
            // package's service (on :9090), stop it again.
            let _ = Command::new("systemctl")
                .args(["disable", "--now", "prometheus"])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
    Ok(())
}
