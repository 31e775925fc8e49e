//! The block tracepoints: each one in BTF or not, which argument variant it has, and how the load
//! test attached it.

use crate::kernel::{
    btf::Btf,
    hooks::{HOOKS, Hook, HookStatus},
};

use crate::view::doctor::{Check, Status};

/// What tracerd loses without an optional tracepoint.
fn without(tracepoint: &str) -> &'static str {
    match tracepoint {
        "block_bio_queue" => {
            "no Q: no q2g, q2d, q2c or q2m, and bio-based devices (md, dm, brd) are not timed"
        }
        "block_getrq" => "no G: no q2g, g2i or g2d",
        "block_split" => "the split-off parts of large bios have no Q, so their requests lack q2* stages",
        "block_bio_backmerge" | "block_bio_frontmerge" => {
            "merged bios are not counted (tracerd_io_merged_bios_total, q2m) and are evicted later \
             as stale_bio"
        }
        "block_rq_insert" => "no I: no g2i or i2d; requests through the scheduler look like direct dispatch",
        "block_rq_requeue" => {
            "a requeued request's next issue counts as missed_completion instead of being timed"
        }
        "block_rq_merge" => {
            "a request an elevator merges into another is not counted (tracerd_io_merged_bios_total, \
             q2m): its slot counts as missed_completion when its address is reused, and its bio's \
             as stale_bio if it merged before its insert"
        }
        "block_bio_remap" => "no per-layer split of md/dm IO (tracerd_io_layer_seconds)",
        "block_rq_remap" => "no per-layer split of request-based dm (multipath)",
        "block_bio_complete" => "bio-based devices (md, dm, brd) never complete: no q2c, no per-layer split",
        _ => "nothing can be timed",
    }
}

/// One check per tracepoint hook: in BTF or not, which variant, and (after a load test) how it
/// attached.
pub(super) fn tracepoint_checks(btf: Option<&Btf>, attached: Option<&[HookStatus]>) -> Vec<Check> {
    HOOKS
        .iter()
        .map(|hook| {
            tracepoint_check(hook, btf, attached.and_then(|s| s.iter().find(|s| s.hook == hook.tracepoint)))
        })
        .collect()
}

fn tracepoint_check(hook: &Hook, btf: Option<&Btf>, attached: Option<&HookStatus>) -> Check {
    let name = format!("tracepoint:{}", hook.tracepoint);
    let need = if hook.required { "required" } else { "optional" };
    let Some(btf) = btf else {
        return Check::new(name, Status::Warn, format!("{need}; not checked without BTF (see btf)"));
    };
    let in_kernel = btf.tracepoint_args(hook.tracepoint);
    let missing = |why: String| {
        if !hook.required {
            return Check::new(
                &name,
                Status::Warn,
                format!("{need}; {why}; without it {}", without(hook.tracepoint)),
            );
        }
        let advice = match &in_kernel {
            None => {
                "this kernel lacks a block tracepoint every kernel since 2.6.x has: use one built \
                     with tracepoints and BPF events (CONFIG_BPF_EVENTS=y)"
            }
            Some(_) => {
                "tracerd was not built for this kernel's tracepoint arguments: report it with `uname -r`"
            }
        };
        Check::new(&name, Status::Fail, format!("{need}; {why}: tracerd cannot trace without it"))
            .advice(advice)
    };
    let n = match hook.variant(btf) {
        Ok(n) => n,
        Err(why) => return missing(why),
    };
    let pointer = in_kernel.as_ref().and_then(|a| a.get(n).cloned()).unwrap_or_default();
    let found =
        format!("{need}; btf_trace_{} has struct {pointer} * at argument {n}: variant a{n}", hook.tracepoint);
    match attached.map(|s| (s.attach_type, &s.reason)) {
        None => Check::new(&name, Status::Ok, found),
        Some((Some(how), None)) => Check::new(&name, Status::Ok, format!("{found}; attached as {how}")),
        Some((Some(how), Some(why))) => {
            Check::new(&name, Status::Ok, format!("{found}; attached as {how} ({why})"))
        }
        Some((None, why)) => {
            missing(format!("{found}, but attaching failed: {}", why.as_deref().unwrap_or("unknown reason")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        kernel::btf::tests::Builder,
        view::doctor::{passed, tests::find},
    };

    /// A kernel BTF with the block tracepoints of 5.11+ except `block_split` and `block_getrq`,
    /// and with `block_rq_complete` absent when `complete` is false.
    fn hook_btf(complete: bool) -> Btf {
        let mut b = Builder::new();
        let (q, rq, bio) = (b.fwd("request_queue"), b.fwd("request"), b.fwd("bio"));
        let (qp, rqp, biop) = (b.ptr(q), b.ptr(rq), b.ptr(bio));
        let u32t = b.int("unsigned int", 4);
        b.tracepoint("block_bio_queue", &[biop]);
        b.tracepoint("block_rq_issue", &[rqp]);
        b.tracepoint("block_rq_insert", &[rqp]);
        b.tracepoint("block_bio_backmerge", &[biop]);
        b.tracepoint("block_bio_complete", &[qp, biop]);
        if complete {
            b.tracepoint("block_rq_complete", &[rqp, u32t, u32t]);
        }
        Btf::parse(&b.build()).unwrap()
    }

    #[test]
    fn tracepoint_checks_say_which_variant_and_what_a_missing_one_costs() {
        let btf = hook_btf(true);
        let checks = tracepoint_checks(Some(&btf), None);
        assert_eq!(checks.len(), HOOKS.len());
        let issue = find(&checks, "tracepoint:block_rq_issue");
        assert_eq!(issue.status, Status::Ok);
        assert!(issue.detail.contains("struct request * at argument 0: variant a0"), "{}", issue.detail);
        let complete = find(&checks, "tracepoint:block_bio_complete");
        assert!(complete.detail.contains("struct bio * at argument 1: variant a1"), "{}", complete.detail);
        let split = find(&checks, "tracepoint:block_split");
        assert_eq!(split.status, Status::Warn);
        assert!(
            split.detail.contains("not in this kernel") && split.detail.contains("q2*"),
            "{}",
            split.detail
        );
        assert!(find(&checks, "tracepoint:block_getrq").detail.contains("no q2g"));
        assert!(passed(&checks), "optional hooks only warn");

        let checks = tracepoint_checks(Some(&hook_btf(false)), None);
        let complete = find(&checks, "tracepoint:block_rq_complete");
        assert_eq!(complete.status, Status::Fail, "required");
        assert!(complete.advice.is_some());

        let no_btf = tracepoint_checks(None, None);
        assert!(no_btf.iter().all(|c| c.status == Status::Warn && c.detail.contains("without BTF")));
    }

    #[test]
    fn tracepoint_checks_report_the_load_test_attach_type() {
        let btf = hook_btf(true);
        let status = |hook, how: Option<&'static str>, reason: Option<&str>| HookStatus {
            hook,
            attach_type: how,
            program: None,
            reason: reason.map(str::to_owned),
        };
        let loaded = [
            status("block_rq_issue", Some("tp_btf"), None),
            status("block_rq_insert", Some("raw_tp"), Some("tp_btf failed (EINVAL), using raw_tp")),
            status("block_bio_backmerge", None, Some("raw_tp failed: EBUSY")),
        ];
        let checks = tracepoint_checks(Some(&btf), Some(&loaded));
        assert!(find(&checks, "tracepoint:block_rq_issue").detail.ends_with("attached as tp_btf"));
        let insert = find(&checks, "tracepoint:block_rq_insert");
        assert_eq!(insert.status, Status::Ok);
        assert!(insert.detail.contains("attached as raw_tp (tp_btf failed"), "{}", insert.detail);
        let merge = find(&checks, "tracepoint:block_bio_backmerge");
        assert_eq!(merge.status, Status::Warn);
        assert!(merge.detail.contains("attaching failed: raw_tp failed: EBUSY"), "{}", merge.detail);
        assert!(merge.detail.contains("merged bios are not counted"), "{}", merge.detail);
    }
}
