//! What this build is (from build.rs): `tracerd --version` and `tracerd_build_info` say it,
//! so a fleet can tell which agent, and which kernel programs, each host runs.

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The commit built (12 hex digits, `-dirty` if the tree differed), or what the packager set.
pub const COMMIT: &str = env!("TRACERD_COMMIT");
/// SHA-256 of the embedded eBPF object, in hex.
pub const EBPF_SHA256: &str = env!("TRACERD_EBPF_SHA256");
/// `tracerd --version`'s line after the name.
pub const VERSION_LINE: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("TRACERD_COMMIT"),
    ", eBPF object sha256:",
    env!("TRACERD_EBPF_SHA256"),
    ")"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_line_names_the_commit_and_the_objects_hash() {
        assert_eq!(EBPF_SHA256.len(), 64);
        assert!(EBPF_SHA256.bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(!COMMIT.is_empty());
        assert!(VERSION_LINE.starts_with(VERSION) && VERSION_LINE.contains(EBPF_SHA256));
    }
}
