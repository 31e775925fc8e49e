//! `tracerd doctor`: checks this kernel and this process (BTF, struct layout, hooks, kprobes,
//! ring buffer, a real load) and says what will and will not work here, and why.
//!
//! Every check runs also without privileges: a check that needs them says what root or the
//! capabilities would change instead of stopping the run. Facts are gathered first, then
//! turned into checks by pure functions, so the verdicts are tested without a kernel.
//!
//! This file gathers the facts and runs the checks in the order they print; each group of checks
//! is a file of its own; `view::doctor` is the finding and its text.

mod agent;
mod bpf;
mod btf;
mod devices;
mod host;
mod kprobes;
mod throttling;
mod tracepoints;

use std::io::Write;

use anyhow::Result;

use crate::{
    kernel::btf::VMLINUX,
    kernel::hooks::{
        KPROBES, RQ_QOS_CALLBACKS, kallsyms_addresses, kprobes_available, rq_qos_unavailable,
        throttle_unavailable,
    },
    kernel::stacking,
    kernel::tracer::{self, LoadOptions, Tracer},
    model::topology::{Device, Topology},
    serve::api,
    view::style::Style,
};

pub use crate::view::doctor::{Check, Status, passed, render, summary};
pub use kprobes::kallsyms_lookup;

use agent::{agent_check, aggregation_check};
use bpf::{
    LoadTest, bpf_stats_check, create_ring_buffer, load_check, recursion_check, ring_buffer_check,
    unprivileged_bpf_check, verifier_check,
};
use btf::btf_checks;
use devices::{chain_checks, devices_check};
use host::{REALTIME, kernel_check, preempt_rt, privileges_check};
use kprobes::{KALLSYMS, kprobe_checks, module_state};
use throttling::{rq_qos_check, throttle_check};
use tracepoints::tracepoint_checks;

/// Runs every check, prints them (text in `style`, or JSON); returns whether nothing FAILed.
/// `socket`: where a running agent is looked for (the views' socket).
/// Runs every check and prints them. `load`: the options of the load test (none: skip it).
pub fn doctor(
    json: bool,
    load: Option<&LoadOptions>,
    socket: &std::path::Path,
    style: Style,
) -> Result<bool> {
    let checks = run_checks(load, socket);
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", serde_json::to_string_pretty(&checks)?)?;
    } else {
        write!(out, "{}", render(&checks, style))?;
    }
    out.flush()?;
    Ok(passed(&checks))
}

fn run_checks(load: Option<&LoadOptions>, socket: &std::path::Path) -> Vec<Check> {
    let caps = tracer::effective_caps();
    let privileged = tracer::can_load(caps);
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let release = tracer::kernel_release();
    let rt = preempt_rt(
        std::fs::read_to_string(REALTIME).ok().as_deref(),
        &read_sysctl("version").unwrap_or_default(),
    );
    let mut checks = vec![kernel_check(&release, rt), privileges_check(caps, euid)];

    let (btf_checks, btf) = btf_checks(std::fs::read(VMLINUX), &release);
    checks.extend(btf_checks);

    // The load test first: its per-hook results complete the static hook checks below.
    let load_test = match load {
        None => LoadTest::Skipped,
        Some(_) if !privileged => LoadTest::Unprivileged,
        Some(opts) => match Tracer::load(opts) {
            // Dropping the tracer detaches and unloads everything it attached.
            Ok(t) => LoadTest::Loaded(t.hooks.clone(), t.verified_instructions()),
            Err(e) => LoadTest::Failed(format!("{e:#}")),
        },
    };
    let attached = match &load_test {
        LoadTest::Loaded(hooks, _) => Some(hooks.as_slice()),
        _ => None,
    };
    checks.extend(tracepoint_checks(btf.as_ref(), attached));

    let topology = Topology::scan().map_err(|e| format!("{e:#}"));
    let functions: Vec<&str> = KPROBES.iter().map(|k| k.function).collect();
    let symbols = std::fs::read_to_string(KALLSYMS)
        .map(|text| kallsyms_lookup(&text, &functions))
        .map_err(|e| e.to_string());
    let devices: Vec<Device> = topology.as_ref().map(|t| t.devices().cloned().collect()).unwrap_or_default();
    checks.extend(kprobe_checks(kprobes_available(), &symbols, &devices, &module_state, attached));
    if let Some(btf) = &btf {
        checks.extend(chain_checks(&stacking::resolve(btf, kprobes_available()).1));
        checks.push(throttle_check(throttle_unavailable(btf, true, kprobes_available()), attached));
        // Addresses all zero: kallsyms hides them from this user (kptr_restrict).
        let callbacks = std::fs::read_to_string(KALLSYMS)
            .ok()
            .filter(|t| t.lines().any(|l| l.split(' ').next().is_some_and(|a| a.bytes().any(|b| b != b'0'))))
            .map(|t| kallsyms_addresses(&t, RQ_QOS_CALLBACKS));
        checks.push(rq_qos_check(rq_qos_unavailable(btf, kprobes_available()), callbacks));
    }

    checks.push(ring_buffer_check(privileged, create_ring_buffer));
    checks.push(aggregation_check(aya::util::nr_cpus().map_or(1, |n| n), devices.len()));
    checks.push(agent_check(socket, api::call(socket, &api::Request::Status {}, "status")));
    checks.push(load_check(&load_test));
    checks.extend(verifier_check(&load_test));
    checks.push(bpf_stats_check(read_sysctl("bpf_stats_enabled").as_deref()));
    checks.push(recursion_check(btf.as_ref()));
    checks.push(unprivileged_bpf_check(read_sysctl("unprivileged_bpf_disabled").as_deref()));
    checks.push(devices_check(topology.as_ref().map_err(String::as_str), kprobes_available()));
    checks
}

fn read_sysctl(name: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/sys/kernel/{name}")).ok().map(|s| s.trim().to_owned())
}
