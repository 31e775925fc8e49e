//! tracerd's health as a tracer: the events it could not account for, its kernel tables and
//! series, the records it read, its hooks, and the cost of its kernel programs.

use super::{
    State,
    family::{family, labels, number, single},
};
use crate::serve::exposition::{Family, Kind};

/// Lost events, expired series, the in-flight tables, the kernel's series and where reads and
/// writes are aggregated.
pub(super) fn lost_and_kernel_tables(out: &mut Vec<Family>, state: &State) {
    let mut f = family(
        "tracerd_events_lost_total",
        Kind::Counter,
        "Events tracerd could not account for, by reason.",
    );
    for (reason, n) in state.agg.lost.reasons() {
        number(&mut f, labels([("reason", reason)]), n as f64);
    }
    out.push(f);
    single(
        out,
        "tracerd_series_expired_total",
        Kind::Counter,
        "Devices whose series were dropped after the device vanished (config series.expire_after_s).",
        state.agg.expired_devices as f64,
    );
    let mut f = family(
        "tracerd_in_flight_entries",
        Kind::Gauge,
        "Entries in the kernel's in-flight tables (16384 slots each), sampled every 10 s.",
    );
    number(&mut f, labels([("table", "bios")]), state.in_flight.0 as f64);
    number(&mut f, labels([("table", "requests")]), state.in_flight.1 as f64);
    out.push(f);
    let mut f = family(
        "tracerd_kernel_series",
        Kind::Gauge,
        "Devices whose reads and writes the kernel aggregates itself (state=used), of how many \
         it can (state=capacity); other IO crosses the ring buffer as records.",
    );
    number(&mut f, labels([("state", "used")]), state.kernel_series.0 as f64);
    number(&mut f, labels([("state", "capacity")]), state.kernel_series.1 as f64);
    out.push(f);
    if let Some((used, capacity)) = state.kernel_cgroup_series {
        let mut f = family(
            "tracerd_kernel_cgroup_series",
            Kind::Gauge,
            "(cgroup, device, op) series the kernel aggregates itself (state=used), of how many it \
             can (state=capacity); IO of other cgroups crosses the ring buffer as records.",
        );
        number(&mut f, labels([("state", "used")]), used as f64);
        number(&mut f, labels([("state", "capacity")]), capacity as f64);
        out.push(f);
    }
    if !state.aggregation.is_empty() {
        let mut f = family("tracerd_aggregation_info", Kind::Gauge, "Where reads and writes are aggregated.");
        number(&mut f, labels([("mode", state.aggregation)]), 1.0);
        out.push(f);
    }
}

/// Records read, requests counted in the kernel, traced devices, the hooks attached and
/// skipped, and the time and runs of the kernel programs.
pub(super) fn records_hooks_and_programs(out: &mut Vec<Family>, state: &State) {
    single(
        out,
        "tracerd_records_total",
        Kind::Counter,
        "Records read from the kernel ring buffer.",
        state.records as f64,
    );
    single(
        out,
        "tracerd_kernel_requests_total",
        Kind::Counter,
        "Requests counted in the kernel's series, which crossed the ring buffer as no record.",
        state.kernel_requests as f64,
    );
    single(
        out,
        "tracerd_traced_devices",
        Kind::Gauge,
        "Block devices (disks and partitions) traced in the kernel.",
        state.traced_devices as f64,
    );
    let mut f =
        family("tracerd_hook_attached", Kind::Gauge, "1 for each block-layer hook attached, with how.");
    for h in state.hooks.iter().filter(|h| h.attached()) {
        number(&mut f, labels([("hook", h.hook), ("attach_type", h.attach_type.unwrap_or_default())]), 1.0);
    }
    out.push(f);
    let mut f = family(
        "tracerd_hook_skipped",
        Kind::Gauge,
        "1 for each block-layer hook not attached, with why (the kernel lacks or refuses it, or config skip_hooks).",
    );
    for h in state.hooks.iter().filter(|h| !h.attached()) {
        number(&mut f, labels([("hook", h.hook), ("reason", h.reason.as_deref().unwrap_or(""))]), 1.0);
    }
    out.push(f);
    single(
        out,
        "tracerd_bpf_run_seconds_total",
        Kind::Counter,
        "Time spent in tracerd's kernel programs; counted only while sysctl kernel.bpf_stats_enabled=1.",
        state.programs.run_ns as f64 / 1e9,
    );
    single(
        out,
        "tracerd_bpf_runs_total",
        Kind::Counter,
        "Runs of tracerd's kernel programs; counted only while sysctl kernel.bpf_stats_enabled=1.",
        state.programs.runs as f64,
    );
}
