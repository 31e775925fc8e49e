//! The agent (`tracerd run`) on this machine: the memory its in-kernel aggregation takes, and
//! whether one already serves the views.

use anyhow::Result;

use crate::{kernel::cgroup_series, kernel::series, serve::api, units};

use crate::view::doctor::{Check, Status};

/// What `run`'s in-kernel aggregation takes on this machine with `devices` block devices (its
/// per-CPU series are sized at load for the devices traced, whether they do IO or not).
pub(super) fn aggregation_check(cpus: usize, devices: usize) -> Check {
    let capacity = series::capacity(devices);
    let per_cpu = series::bytes_per_device() * capacity as usize;
    let cgroup_per_cpu = cgroup_series::capacity() as usize * std::mem::size_of::<tracer_common::SeriesAgg>();
    Check::new(
        "aggregation",
        Status::Ok,
        format!(
            "`run` tracing all {devices} block devices counts reads and writes in the kernel for up \
             to {capacity} devices (then as records): {} per device and CPU, {} per CPU, {} on this \
             machine's {cpus} CPUs; at most {} per CPU for {} devices. With a cgroup label, \
             {} (cgroup, device, op) series take {} more per CPU, {} here",
            units::bytes(series::bytes_per_device() as f64),
            units::bytes(per_cpu as f64),
            units::bytes((per_cpu * cpus) as f64),
            units::bytes(series::SERIES_BYTES_PER_CPU as f64),
            series::most(),
            cgroup_series::capacity(),
            units::bytes(cgroup_per_cpu as f64),
            units::bytes((cgroup_per_cpu * cpus) as f64),
        ),
    )
}

/// Whether an agent serves the API, which the views then attach to instead of loading programs.
pub(super) fn agent_check(socket: &std::path::Path, status: Result<api::Status, api::AttachError>) -> Check {
    match status {
        Ok(s) => {
            let r = &s.recorder;
            let span = match (r.from_unix_s, r.to_unix_s) {
                (Some(a), Some(b)) => format!("{:.0} s", b - a),
                _ => "nothing yet".into(),
            };
            Check::new(
                "agent",
                Status::Ok,
                format!(
                    "an agent (pid {}, tracerd {}, aggregation {}) serves {}: report, snoop, diff and top \
                     attach to it; its recorder holds {span} in {} of {}",
                    s.pid,
                    s.tracerd_version,
                    s.aggregation,
                    socket.display(),
                    units::bytes(r.bytes as f64),
                    units::bytes(r.max_bytes as f64),
                ),
            )
        }
        Err(api::AttachError::NoAgent(_)) => Check::new(
            "agent",
            Status::Ok,
            format!(
                "no agent serves {}: views load their own programs, and windows of the past \
                 (report --since) need one",
                socket.display()
            ),
        )
        .advice("start the agent (systemctl start tracerd, or sudo tracerd run)"),
        Err(e) => Check::new("agent", Status::Warn, e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_check_says_whether_views_attach() {
        let socket = std::path::Path::new("/run/tracerd/tracerd.sock");
        let none = agent_check(socket, Err(api::AttachError::NoAgent(socket.into())));
        assert_eq!(none.status, Status::Ok);
        assert!(none.detail.contains("no agent serves /run/tracerd/tracerd.sock"), "{}", none.detail);
        assert!(none.advice.as_deref().unwrap_or("").contains("systemctl start tracerd"));
        let mut status = api::Status { pid: 42, aggregation: "kernel".into(), ..Default::default() };
        (status.recorder.from_unix_s, status.recorder.to_unix_s) = (Some(100.0), Some(3700.0));
        status.recorder.max_bytes = 32 << 20;
        let one = agent_check(socket, Ok(status));
        assert!(
            one.detail.contains("an agent (pid 42") && one.detail.contains("holds 3600 s"),
            "{}",
            one.detail
        );
    }

    #[test]
    fn aggregation_states_its_memory_per_cpu_and_here() {
        let c = aggregation_check(2, 5);
        assert_eq!(c.status, Status::Ok);
        // 2,728 bytes per series, a read and a write per device; at least 32 devices.
        assert!(
            c.detail.contains(
                "up to 32 devices (then as records): 5.3KiB per device and CPU, 170.5KiB per CPU, 341.0KiB on"
            ),
            "{}",
            c.detail
        );
        assert!(c.detail.contains("at most 1.0MiB per CPU for 192 devices"), "{}", c.detail);
        let many = aggregation_check(128, 60);
        assert!(
            many.detail.contains("all 60 block devices") && many.detail.contains("up to 90 devices"),
            "{}",
            many.detail
        );
    }
}
