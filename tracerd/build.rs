//! Embeds the kernel object built by `cargo xtask build-ebpf` (nightly, bpf-linker), and what
//! `tracerd --version` and `tracerd_build_info` say of the build: the commit and the object's
//! SHA-256.
use std::{path::PathBuf, process::Command};

use sha2::{Digest, Sha256};

fn main() {
    println!("cargo:rerun-if-env-changed=TRACERD_EBPF_OBJECT");
    let object = match std::env::var_os("TRACERD_EBPF_OBJECT") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tracer-ebpf/target/bpfel-unknown-none/release/tracer-ebpf"),
    };
    if !object.exists() {
        panic!(
            "tracerd's eBPF object is missing at {}.\n\
             Build it first with `cargo xtask build` (or `cargo xtask build-ebpf`), \
             which installs the nightly toolchain parts and bpf-linker it needs.",
            object.display()
        );
    }
    let object = object.canonicalize().expect("object path");
    println!("cargo:rerun-if-changed={}", object.display());
    println!("cargo:rustc-env=TRACERD_EBPF_OBJECT={}", object.display());
    let bytes = std::fs::read(&object).expect("read the eBPF object");
    let digest = Sha256::digest(&bytes);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    println!("cargo:rustc-env=TRACERD_EBPF_SHA256={hex}");
    println!("cargo:rustc-env=TRACERD_COMMIT={}", commit());
}

/// The commit built: `TRACERD_COMMIT` where a packager sets it (a source tarball has no .git),
/// else git's HEAD, with `-dirty` when tracked files differ from it; `unknown` without either.
fn commit() -> String {
    println!("cargo:rerun-if-env-changed=TRACERD_COMMIT");
    if let Ok(c) = std::env::var("TRACERD_COMMIT") {
        return c;
    }
    let top = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(&top)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let Some(head) = git(&["rev-parse", "HEAD"]) else { return "unknown".into() };
    // Rebuilt when HEAD moves or the index changes (a commit, a checkout, an add).
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        for f in ["HEAD", "index"] {
            println!("cargo:rerun-if-changed={dir}/{f}");
        }
        if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={dir}/{r}");
        }
    }
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    format!("{}{}", &head[..12.min(head.len())], if dirty { "-dirty" } else { "" })
}
