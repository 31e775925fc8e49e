//! What the BPF subsystem gives tracerd here: a ring buffer, the load test's verdict, the counts
//! of program runs and skipped runs, and who may call bpf().

use std::os::fd::{FromRawFd, OwnedFd};

use tracer_common::limits;

use crate::{
    kernel::btf::Btf,
    kernel::hooks::{HOOKS, HookStatus},
    kernel::tracer,
    units,
};

use crate::view::doctor::{Check, Status};

/// What the load test found.
#[derive(Clone, Debug)]
pub(super) enum LoadTest {
    /// `--no-load`.
    Skipped,
    Unprivileged,
    Failed(String),
    /// Every hook's status, tracepoints first (as `Tracer::hooks`), and what the verifier
    /// processed of each loaded program (`Tracer::verified_instructions`).
    Loaded(Vec<HookStatus>, Vec<(String, u32)>),
}

/// The instructions the verifier processes of one program before it gives up
/// (BPF_COMPLEXITY_LIMIT_INSNS, for a privileged loader).
const VERIFIER_LIMIT: u32 = 1_000_000;

/// Share of [`VERIFIER_LIMIT`] from which a program is reported as close to it.
const VERIFIER_WARN_PERCENT: u32 = 80;

/// Creates and closes a BPF ring buffer map of `bytes` (BPF_MAP_CREATE).
pub(super) fn create_ring_buffer(bytes: u32) -> std::io::Result<()> {
    use aya_obj::generated::{bpf_attr, bpf_attr__bindgen_ty_1, bpf_cmd, bpf_map_type};
    tracer::raise_memlock();
    // SAFETY: plain C types, valid when zeroed.
    let (mut attr, mut create): (bpf_attr, bpf_attr__bindgen_ty_1) =
        unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    create.map_type = bpf_map_type::BPF_MAP_TYPE_RINGBUF as u32;
    create.max_entries = bytes;
    for (dst, src) in create.map_name.iter_mut().zip(b"tracerd_doctor") {
        *dst = *src as libc::c_char;
    }
    attr.__bindgen_anon_1 = create;
    // SAFETY: attr is a live bpf_attr of the size given; BPF_MAP_CREATE only reads it.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            bpf_cmd::BPF_MAP_CREATE as libc::c_long,
            &raw mut attr,
            std::mem::size_of::<bpf_attr>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us; dropping it frees the map.
    drop(unsafe { OwnedFd::from_raw_fd(fd as i32) });
    Ok(())
}

pub(super) fn ring_buffer_check(privileged: bool, create: impl FnOnce(u32) -> std::io::Result<()>) -> Check {
    let bytes = limits::RINGBUF_BYTES;
    let size = units::bytes(bytes as f64);
    if !privileged {
        return Check::new(
            "ring_buffer",
            Status::Warn,
            format!("not checked: creating a BPF ring buffer ({size}) needs CAP_BPF"),
        )
        .advice("run as root (sudo tracerd doctor) to check it");
    }
    match create(bytes) {
        Ok(()) => Check::new(
            "ring_buffer",
            Status::Ok,
            format!("created and closed a BPF ring buffer of {size} (tracerd's default size)"),
        ),
        Err(e) => {
            let advice = match e.raw_os_error() {
                Some(libc::EPERM) | Some(libc::EACCES) => {
                    "the kernel refused the bpf() call: in a container allow bpf() (seccomp) and grant \
                     CAP_BPF"
                }
                Some(libc::EINVAL) => {
                    "this kernel has no BPF ring buffer (added in 5.8): use kernel 5.8 or later"
                }
                Some(libc::ENOMEM) => {
                    "not enough locked memory: kernels before 5.11 charge it to RLIMIT_MEMLOCK (grant \
                     CAP_SYS_RESOURCE), or use a smaller --ring-buffer-bytes"
                }
                _ => "the kernel refused a ring buffer: check dmesg",
            };
            Check::new("ring_buffer", Status::Fail, format!("cannot create a BPF ring buffer of {size}: {e}"))
                .advice(advice)
        }
    }
}

pub(super) fn load_check(test: &LoadTest) -> Check {
    match test {
        LoadTest::Skipped => Check::new(
            "load",
            Status::Warn,
            "skipped (--no-load): the checks above read the kernel's description of itself; only \
             loading proves the verifier accepts tracerd's programs",
        )
        .advice("run without --no-load for the definitive check"),
        LoadTest::Unprivileged => Check::new(
            "load",
            Status::Warn,
            "not run: loading and attaching tracerd's programs needs CAP_BPF and CAP_PERFMON",
        )
        .advice("run as root (sudo tracerd doctor) for the definitive check"),
        LoadTest::Failed(e) => {
            Check::new("load", Status::Fail, format!("loading tracerd's programs failed: {e}"))
                .advice("fix what the message says; `tracerd run` would fail the same way")
        }
        LoadTest::Loaded(hooks, _) => {
            let (tps, kps) = hooks.split_at(HOOKS.len().min(hooks.len()));
            let count = |how: &str| tps.iter().filter(|s| s.attach_type == Some(how)).count();
            let tp_ok = tps.iter().filter(|s| s.attached()).count();
            let kp_ok = kps.iter().filter(|s| s.attached()).count();
            Check::new(
                "load",
                Status::Ok,
                format!(
                    "loaded and attached {tp_ok} of {} tracepoints (tp_btf {}, raw_tp {}) and {kp_ok} of {} \
                     kprobes, then detached them",
                    tps.len(),
                    count("tp_btf"),
                    count("raw_tp"),
                    kps.len()
                ),
            )
        }
    }
}

/// How close the loaded programs came to the verifier's limit: the same program is verified
/// anew on every kernel, and a kernel whose verifier explores more paths refuses one that
/// another accepts. None where nothing was loaded (the load check says why).
pub(super) fn verifier_check(test: &LoadTest) -> Option<Check> {
    let LoadTest::Loaded(_, programs) = test else { return None };
    let Some((name, most)) = programs.iter().max_by_key(|(_, n)| *n) else {
        return Some(Check::new(
            "verifier",
            Status::Ok,
            "this kernel does not report how many instructions its verifier processed (before 5.16)",
        ));
    };
    let percent = u64::from(*most) * 100 / u64::from(VERIFIER_LIMIT);
    let detail = format!(
        "the most complex of {} programs, {name}, took {most} of the verifier's {VERIFIER_LIMIT} \
         instructions ({percent} %)",
        programs.len()
    );
    Some(if percent >= u64::from(VERIFIER_WARN_PERCENT) {
        Check::new(
            "verifier",
            Status::Warn,
            format!("{detail}: a kernel whose verifier explores more paths may refuse it"),
        )
        .advice("report it with the output of `tracerd doctor --json`: the program must get simpler")
    } else {
        Check::new("verifier", Status::Ok, detail)
    })
}

pub(super) fn bpf_stats_check(value: Option<&str>) -> Check {
    let name = "kernel.bpf_stats_enabled";
    let metrics = "tracerd_bpf_run_seconds_total and tracerd_bpf_runs_total";
    match value {
        Some("0") => Check::new(name, Status::Ok, format!("0: {metrics} stay 0")).advice(
            "to count tracerd's in-kernel time: sysctl -w kernel.bpf_stats_enabled=1 (a clock read per \
                 program run)",
        ),
        Some(v) => Check::new(name, Status::Ok, format!("{v}: {metrics} count")),
        None => Check::new(name, Status::Ok, format!("absent (kernel before 5.8): {metrics} stay 0")),
    }
}

/// Whether the kernel counts the runs of tracerd's programs it skips (see `ProgramTotals`).
pub(super) fn recursion_check(btf: Option<&Btf>) -> Check {
    let name = "recursion_misses";
    match btf {
        None => Check::new(name, Status::Warn, "not checked without BTF (see btf)"),
        Some(btf) if tracer::counts_recursion_misses(btf) => Check::new(
            name,
            Status::Ok,
            "counted: program runs the kernel skips show as lost{reason=recursion}",
        ),
        Some(_) => Check::new(
            name,
            Status::Warn,
            "this kernel (before 5.12) does not count skipped program runs: lost{reason=recursion} \
             stays 0 even when runs are skipped",
        ),
    }
}

pub(super) fn unprivileged_bpf_check(value: Option<&str>) -> Check {
    let name = "kernel.unprivileged_bpf_disabled";
    let detail = match value {
        Some("0") => "0: any user may call bpf(); tracerd does not need that".to_owned(),
        Some(v @ ("1" | "2")) => {
            format!("{v}: only privileged processes may call bpf(); tracerd is one, so this changes nothing")
        }
        Some(v) => format!("{v}: unknown value; tracerd runs privileged either way"),
        None => "absent: tracerd runs privileged either way".to_owned(),
    };
    Check::new(name, Status::Ok, detail)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::{btf::fixtures::Fixture, hooks::KPROBES};

    #[test]
    fn ring_buffer_check_explains_errnos_and_needs_privileges() {
        assert_eq!(ring_buffer_check(false, |_| unreachable!()).status, Status::Warn);
        let ok = ring_buffer_check(true, |bytes| {
            assert_eq!(bytes, limits::RINGBUF_BYTES);
            Ok(())
        });
        assert_eq!(ok.status, Status::Ok);
        assert!(ok.detail.contains("8.0MiB"), "{}", ok.detail);
        let einval = ring_buffer_check(true, |_| Err(std::io::Error::from_raw_os_error(libc::EINVAL)));
        assert_eq!(einval.status, Status::Fail);
        assert!(einval.advice.unwrap().contains("5.8"));
        let eperm = ring_buffer_check(true, |_| Err(std::io::Error::from_raw_os_error(libc::EPERM)));
        assert!(eperm.advice.unwrap().contains("container"));
    }

    #[test]
    fn load_check_counts_attach_types() {
        let mut hooks: Vec<HookStatus> = HOOKS
            .iter()
            .map(|h| HookStatus {
                hook: h.tracepoint,
                attach_type: Some("tp_btf"),
                program: None,
                reason: None,
            })
            .collect();
        hooks[2].attach_type = Some("raw_tp");
        hooks.extend(KPROBES.iter().map(|k| HookStatus {
            hook: k.function,
            attach_type: None,
            program: None,
            reason: Some("no kprobes".into()),
        }));
        let c = load_check(&LoadTest::Loaded(hooks, Vec::new()));
        assert_eq!(c.status, Status::Ok);
        let n = HOOKS.len();
        assert!(
            c.detail
                .contains(&format!("{n} of {n} tracepoints (tp_btf {}, raw_tp 1) and 0 of 4 kprobes", n - 1)),
            "{}",
            c.detail
        );
        assert_eq!(load_check(&LoadTest::Failed("EPERM".into())).status, Status::Fail);
        assert_eq!(load_check(&LoadTest::Skipped).status, Status::Warn);
        assert_eq!(load_check(&LoadTest::Unprivileged).status, Status::Warn);
    }

    #[test]
    fn before_5_12_skipped_runs_are_not_counted() {
        let mut f = Fixture::load("6.12.117+deb12-amd64");
        f.member("bpf_prog_info", "recursion_misses", None);
        let c = recursion_check(Some(&f.btf()));
        assert_eq!(c.status, Status::Warn);
        assert_eq!(
            c.detail,
            "this kernel (before 5.12) does not count skipped program runs: lost{reason=recursion} stays 0 \
             even when runs are skipped"
        );
        assert_eq!(recursion_check(None).status, Status::Warn);
    }

    #[test]
    fn sysctls_are_informational() {
        assert!(bpf_stats_check(Some("0")).advice.unwrap().contains("bpf_stats_enabled=1"));
        assert!(bpf_stats_check(Some("1")).advice.is_none());
        for v in [Some("0"), Some("1"), Some("2"), None] {
            assert_eq!(unprivileged_bpf_check(v).status, Status::Ok);
            assert_eq!(bpf_stats_check(v).status, Status::Ok);
        }
    }

    #[test]
    fn verifier_check_names_the_program_closest_to_the_limit() {
        let loaded = |counts: &[(&str, u32)]| {
            LoadTest::Loaded(Vec::new(), counts.iter().map(|(n, c)| ((*n).to_owned(), *c)).collect())
        };
        assert!(verifier_check(&LoadTest::Skipped).is_none());
        assert!(verifier_check(&LoadTest::Failed("E2BIG".into())).is_none());
        let c = verifier_check(&loaded(&[
            ("btf_block_rq_issue_a0", 2074),
            ("btf_block_rq_complete_a0", 412_000),
        ]))
        .unwrap();
        assert_eq!(c.status, Status::Ok);
        assert!(c.detail.contains("of 2 programs, btf_block_rq_complete_a0, took 412000 of"), "{}", c.detail);
        assert!(c.detail.ends_with("(41 %)"), "{}", c.detail);
        let c = verifier_check(&loaded(&[("btf_block_rq_complete_a0", 800_000)])).unwrap();
        assert_eq!(c.status, Status::Warn, "{}", c.detail);
        assert!(c.advice.is_some());
        assert_eq!(verifier_check(&loaded(&[])).unwrap().status, Status::Ok);
    }
}
