//! Embeds the kernel object built by `cargo xtask build-ebpf` (nightly, bpf-linker).
use std::path::PathBuf;

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
}
