//! The process's families: the `process_*` every Prometheus client exports, and the build
//! and kernel tracerd runs as.

use super::family::{family, labels, number, single};
use crate::{
    build_info,
    serve::exposition::{Family, Kind},
    serve::process::ProcessStats,
};

/// CPU, memory, open files and start time (where /proc tells them), then `tracerd_build_info`.
pub(super) fn families(out: &mut Vec<Family>, kernel: &str) {
    if let Some(p) = ProcessStats::read() {
        single(
            out,
            "process_cpu_seconds_total",
            Kind::Counter,
            "User and system CPU time of tracerd.",
            p.cpu_seconds,
        );
        single(
            out,
            "process_resident_memory_bytes",
            Kind::Gauge,
            "Resident memory of tracerd.",
            p.resident_bytes as f64,
        );
        single(out, "process_open_fds", Kind::Gauge, "Open file descriptors of tracerd.", p.open_fds as f64);
        single(
            out,
            "process_start_time_seconds",
            Kind::Gauge,
            "Start time of tracerd, seconds since the Unix epoch.",
            p.start_time_seconds,
        );
    }
    let mut f = family(
        "tracerd_build_info",
        Kind::Gauge,
        "tracerd version, commit and eBPF object, and the kernel it runs on.",
    );
    number(
        &mut f,
        labels([
            ("version", build_info::VERSION),
            ("commit", build_info::COMMIT),
            ("ebpf_sha256", build_info::EBPF_SHA256),
            ("kernel", kernel),
        ]),
        1.0,
    );
    out.push(f);
}
