//! The kernel release (and whether it is PREEMPT_RT), and the privileges this process holds.

use crate::kernel::tracer::{self, CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN};

use crate::view::doctor::{Check, Status};

/// Major and minor of a release such as `6.18.44-fc-v857`.
fn parse_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Present, holding 1, on kernels with the PREEMPT_RT patch set (Debian's -rt among them);
/// mainline PREEMPT_RT (6.12+) without those patches lacks it.
pub(super) const REALTIME: &str = "/sys/kernel/realtime";

/// Whether the kernel is PREEMPT_RT: /sys/kernel/realtime holds 1, or `uname -v` (the
/// `version` sysctl) names it, as every PREEMPT_RT build does.
pub(super) fn preempt_rt(realtime: Option<&str>, version: &str) -> bool {
    realtime.is_some_and(|r| r.trim() == "1") || version.split_whitespace().any(|w| w == "PREEMPT_RT")
}

pub(super) fn kernel_check(release: &str, preempt_rt: bool) -> Check {
    match parse_release(release) {
        // Distributions backport, so an old number is a warning; the ring buffer check decides.
        Some(v) if v < (5, 8) => Check::new(
            "kernel",
            Status::Warn,
            format!(
                "{release}: older than 5.8, which brought the BPF ring buffer and CAP_BPF; only \
                 a kernel with both backported can run tracerd (see ring_buffer)"
            ),
        )
        .advice("use kernel 5.8 or later (tracerd is tested on 6.1, 6.12, 6.12 PREEMPT_RT and 6.18)"),
        Some(_) if preempt_rt => Check::new(
            "kernel",
            Status::Ok,
            format!(
                "{release}, PREEMPT_RT: interrupt handlers and softirqs run in threads, so a completion \
                 is traced when its thread runs (D2C includes that thread's scheduling delay)"
            ),
        ),
        Some(_) => Check::new("kernel", Status::Ok, release),
        None => Check::new("kernel", Status::Warn, format!("cannot read the version in release '{release}'")),
    }
}

pub(super) fn privileges_check(caps: u64, euid: u32) -> Check {
    let has = |cap: u32| caps & (1 << cap) != 0;
    let named = [(CAP_SYS_ADMIN, "CAP_SYS_ADMIN"), (CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON")];
    let held: Vec<&str> = named.iter().filter(|(c, _)| has(*c)).map(|(_, n)| *n).collect();
    let held = if held.is_empty() { "none of them".to_owned() } else { held.join(", ") };
    let Some(missing) = tracer::missing_caps(caps) else {
        return Check::new("privileges", Status::Ok, format!("uid {euid}; effective: {held}"));
    };
    Check::new(
        "privileges",
        Status::Fail,
        format!(
            "uid {euid}; of CAP_SYS_ADMIN, CAP_BPF, CAP_PERFMON effective: {held}; tracerd needs \
             {missing} to load its programs"
        ),
    )
    .advice(
        "run as root (sudo tracerd doctor), or grant the capabilities: sudo setcap \
         cap_bpf,cap_perfmon+ep $(command -v tracerd); with them the ring buffer and load checks run too",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn privileges_need_bpf_and_perfmon_or_sys_admin() {
        let caps = |list: &[u32]| list.iter().fold(0u64, |c, n| c | 1 << n);
        assert_eq!(privileges_check(caps(&[CAP_SYS_ADMIN]), 0).status, Status::Ok);
        assert_eq!(privileges_check(caps(&[CAP_BPF, CAP_PERFMON]), 65534).status, Status::Ok);
        let partial = privileges_check(caps(&[CAP_BPF]), 1000);
        assert_eq!(partial.status, Status::Fail);
        assert!(partial.detail.contains("needs CAP_PERFMON"), "{}", partial.detail);
        let perfmon_only = privileges_check(caps(&[CAP_PERFMON]), 1000);
        assert!(perfmon_only.detail.contains("needs CAP_BPF (CAP_PERFMON alone"), "{}", perfmon_only.detail);
        let none = privileges_check(0, 65534);
        assert_eq!(none.status, Status::Fail);
        assert!(none.detail.contains("uid 65534") && none.detail.contains("none of them"), "{}", none.detail);
        assert!(none.advice.unwrap().contains("setcap cap_bpf,cap_perfmon+ep"));
    }

    #[test]
    fn kernel_release_parses_and_old_kernels_warn() {
        assert_eq!(parse_release("6.18.44-fc-v857"), Some((6, 18)));
        assert_eq!(parse_release("5.4.0-150-generic"), Some((5, 4)));
        assert_eq!(parse_release("unknown"), None);
        assert_eq!(kernel_check("6.1.0-40-amd64", false).status, Status::Ok);
        assert_eq!(kernel_check("5.4.0-150-generic", false).status, Status::Warn);
    }

    #[test]
    fn preempt_rt_is_read_from_sysfs_or_uname() {
        // Debian's -rt kernels carry the RT patch set's /sys/kernel/realtime (its BTF has
        // realtime_show); a mainline PREEMPT_RT build without it says so in `uname -v` alone.
        assert!(preempt_rt(Some("1\n"), "#1 SMP PREEMPT_RT Debian 6.12.117-1"));
        assert!(preempt_rt(None, "#1 SMP PREEMPT_RT Thu Jan  1 00:00:00 UTC 2026"));
        assert!(!preempt_rt(None, "#1 SMP PREEMPT_DYNAMIC Debian 6.12.117-1"));
        assert!(!preempt_rt(None, "#1 SMP PREEMPT_DYNAMIC Debian 6.1.158-1"));
        assert!(!preempt_rt(None, "#1 SMP PREEMPT_DYNAMIC @0"));
        assert!(!preempt_rt(Some("0\n"), ""));
        let rt = kernel_check("6.12.117+deb12-rt-amd64", true);
        assert_eq!(rt.status, Status::Ok);
        assert_eq!(
            rt.detail,
            "6.12.117+deb12-rt-amd64, PREEMPT_RT: interrupt handlers and softirqs run in threads, so a \
             completion is traced when its thread runs (D2C includes that thread's scheduling delay)"
        );
        assert_eq!(kernel_check("6.12.117+deb12-amd64", false).detail, "6.12.117+deb12-amd64");
    }
}
