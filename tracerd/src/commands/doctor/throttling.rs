//! The optional stages that time the waits the kernel imposes before a request exists:
//! blk-throttle's holds (H2Q) and the rq-qos policies' waits (Q2G's split).

use crate::{
    kernel::hooks::{HookStatus, RQ_QOS, RQ_QOS_CALLBACKS, THROTTLE},
    view::doctor::{Check, Status},
};

use super::kprobes::KALLSYMS;

/// H2Q: whether blk-throttle's holds can be timed here (`unavailable`: why not), and whether
/// the load test attached its probe.
pub(super) fn throttle_check(unavailable: Option<String>, attached: Option<&[HookStatus]>) -> Check {
    let name = format!("kprobe:{}", THROTTLE.function);
    if let Some(why) = unavailable {
        return Check::new(name, Status::Warn, why).advice(
            "only for hosts that limit IO with io.max or blkio.throttle.*: use a 6.x kernel with \
             CONFIG_BLK_DEV_THROTTLING=y and CONFIG_KPROBES=y (distribution kernels have both)",
        );
    }
    let status = attached.and_then(|hooks| hooks.iter().find(|h| h.hook == THROTTLE.function));
    match status {
        Some(h) if !h.attached() => Check::new(
            name,
            Status::Warn,
            format!(
                "H2Q (blk-throttle's hold before Q) is unavailable: {}",
                h.reason.as_deref().unwrap_or("the probe did not attach")
            ),
        ),
        Some(_) => Check::new(
            name,
            Status::Ok,
            "attached (kprobe): IO that blk-throttle checks (groups with io.max or blkio.throttle.* \
             limits) has H2Q, the time it was held before Q",
        ),
        None => Check::new(
            name,
            Status::Ok,
            "in BTF, kprobe PMU present: H2Q (blk-throttle's hold before Q) can be timed",
        ),
    }
}

/// The Q2G split (config `rq_qos`, off by default): whether this kernel allows it, and whether
/// `/proc/kallsyms` names the callbacks that tell wbt's waits from io.latency's (None: it
/// hides their addresses).
pub(super) fn rq_qos_check(
    (unavailable, partial): (Option<String>, Option<String>),
    callbacks: Option<[u64; 2]>,
) -> Check {
    const NAME: &str = "rq_qos";
    const POLICIES: [&str; 2] = ["wbt (CONFIG_BLK_WBT)", "io.latency (CONFIG_BLK_CGROUP_IOLATENCY)"];
    if let Some(why) = unavailable {
        return Check::new(NAME, Status::Warn, why).advice(
            "only for hosts whose disks use wbt, io.latency or io.cost: use a kernel with \
             CONFIG_KPROBES=y (distribution kernels have it)",
        );
    }
    let mut detail = format!(
        "{} in BTF, kprobe PMU present: with rq_qos = true in the config, Q2G's rq-qos waits are \
         timed and named",
        RQ_QOS.iter().map(|k| k.function).collect::<Vec<_>>().join(" and ")
    );
    match callbacks {
        None => detail.push_str(&format!(
            "; {KALLSYMS} hides addresses here (not root, or kptr_restrict): wbt's and io.latency's \
             waits would be named rq_qos"
        )),
        Some(addresses) => {
            for ((name, policy), _) in
                RQ_QOS_CALLBACKS.iter().zip(POLICIES).zip(addresses).filter(|(_, a)| *a == 0)
            {
                detail.push_str(&format!("; no {name}: this kernel has no {policy}"));
            }
        }
    }
    if let Some(p) = partial {
        detail.push_str(&format!("; {p}"));
    }
    Check::new(NAME, Status::Ok, detail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_throttle_check_says_why_h2q_is_missing_and_never_fails() {
        let why = "H2Q (...) is unavailable: no kprobe PMU".to_string();
        let c = throttle_check(Some(why.clone()), None);
        assert_eq!(
            (c.name.as_str(), c.status, c.detail.as_str()),
            ("kprobe:__blk_throtl_bio", Status::Warn, why.as_str())
        );
        assert!(c.advice.unwrap().contains("CONFIG_BLK_DEV_THROTTLING"));
        let attached = |ok: bool| HookStatus {
            hook: "__blk_throtl_bio",
            attach_type: ok.then_some("kprobe"),
            program: None,
            reason: (!ok).then(|| "kprobe failed".to_string()),
        };
        let c = throttle_check(None, Some(&[attached(true)]));
        assert_eq!(c.status, Status::Ok);
        assert!(c.detail.starts_with("attached (kprobe)"), "{}", c.detail);
        let c = throttle_check(None, Some(&[attached(false)]));
        assert_eq!(c.status, Status::Warn);
        assert!(c.detail.ends_with("unavailable: kprobe failed"), "{}", c.detail);
        assert_eq!(throttle_check(None, None).status, Status::Ok, "not loaded: available");
    }

    #[test]
    fn the_rq_qos_check_says_whether_q2g_splits_and_what_it_names() {
        let c = rq_qos_check(
            (Some("Q2G's split (...) is unavailable: no kprobe PMU".into()), None),
            Some([1, 2]),
        );
        assert_eq!((c.name.as_str(), c.status), ("rq_qos", Status::Warn));
        assert!(c.detail.ends_with("no kprobe PMU") && c.advice.unwrap().contains("CONFIG_KPROBES"));
        let c = rq_qos_check((None, None), Some([1, 2]));
        assert_eq!(c.status, Status::Ok);
        assert!(c.detail.starts_with("rq_qos_wait and ioc_rqos_throttle in BTF") && !c.detail.contains(';'));
        let c = rq_qos_check((None, Some("no ioc_rqos_throttle".into())), None);
        assert!(
            c.detail.contains("named rq_qos") && c.detail.ends_with("; no ioc_rqos_throttle"),
            "{}",
            c.detail
        );
        let c = rq_qos_check((None, None), Some([1, 0]));
        assert!(c.detail.ends_with(
            "no iolat_acquire_inflight: this kernel has no io.latency (CONFIG_BLK_CGROUP_IOLATENCY)"
        ));
    }
}
