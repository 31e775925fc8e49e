//! The kernel's BTF, and the two things tracerd reads from it before anything else: the block
//! structs' layout and the op enums.

use crate::{
    kernel::btf::{Btf, VMLINUX},
    kernel::layout,
    units,
};

use crate::view::doctor::{Check, Status};

/// The BTF check, then the two that need BTF: struct layout and op enums. Returns the parsed
/// BTF for the hook checks.
pub(super) fn btf_checks(read: std::io::Result<Vec<u8>>, kernel: &str) -> (Vec<Check>, Option<Btf>) {
    let without_btf = |name: &str| Check::new(name, Status::Fail, "not checked: no usable BTF (see btf)");
    let failed = |btf: Check| (vec![btf, without_btf("layout"), without_btf("op_enums")], None);
    let data = match read {
        Ok(data) => data,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return failed(
                Check::new("btf", Status::Fail, format!("{VMLINUX} is missing: this kernel exposes no BTF"))
                    .advice(
                        "use a kernel built with CONFIG_DEBUG_INFO_BTF=y (most distribution kernels \
                         since 5.4 are); tracerd reads struct layouts from it",
                    ),
            );
        }
        Err(e) => {
            return failed(
                Check::new("btf", Status::Fail, format!("cannot read {VMLINUX}: {e}"))
                    .advice("run as root (sudo tracerd doctor)"),
            );
        }
    };
    let btf = match Btf::parse(&data) {
        Ok(btf) => btf,
        Err(e) => {
            return failed(Check::new("btf", Status::Fail, format!("{VMLINUX}: {e}")).advice(
                "tracerd's BTF reader cannot parse this kernel's BTF: report it with `uname -r` \
                 and the kernel's origin",
            ));
        }
    };
    let mut checks =
        vec![Check::new("btf", Status::Ok, format!("{VMLINUX}: {} parsed", units::bytes(data.len() as f64)))];
    checks.push(match layout::resolve(&btf, kernel) {
        Ok(l) => Check::new(
            "layout",
            Status::Ok,
            format!("every struct offset tracerd reads resolves; variants: {}", layout::describe(&l)),
        ),
        Err(e) => Check::new("layout", Status::Fail, format!("{e:#}")).advice(
            "this kernel's block structs differ from every layout tracerd knows: report it with `uname -r`",
        ),
    });
    checks.push(match crate::kernel::ops::op_decoder(&btf) {
        Ok(_) => {
            let op = |n: &str| btf.enumerator(n).map_or("?".into(), |v| v.to_string());
            Check::new(
                "op_enums",
                Status::Ok,
                format!(
                    "REQ_OP_READ={} WRITE={} FLUSH={} DISCARD={}; flag bits from __REQ_*",
                    op("REQ_OP_READ"),
                    op("REQ_OP_WRITE"),
                    op("REQ_OP_FLUSH"),
                    op("REQ_OP_DISCARD")
                ),
            )
        }
        Err(e) => Check::new("op_enums", Status::Fail, format!("{e:#}"))
            .advice("tracerd cannot tell reads from writes on this kernel: report it with `uname -r`"),
    });
    (checks, Some(btf))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        commands::doctor::{bpf::recursion_check, tracepoints::tracepoint_checks},
        kernel::btf::{fixtures::Fixture, tests::Builder},
        view::doctor::tests::find,
    };

    #[test]
    fn btf_checks_fail_clearly_without_btf() {
        let (checks, btf) = btf_checks(Err(std::io::ErrorKind::NotFound.into()), "6.1.0-57-amd64");
        assert!(btf.is_none());
        assert_eq!(checks.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["btf", "layout", "op_enums"]);
        assert!(checks.iter().all(|c| c.status == Status::Fail));
        assert!(checks[0].advice.as_deref().unwrap().contains("CONFIG_DEBUG_INFO_BTF"));
        let (checks, _) = btf_checks(Ok(b"not btf".to_vec()), "6.1.0-57-amd64");
        assert!(checks[0].detail.contains("malformed"), "{}", checks[0].detail);
        // Parseable, but without the block structs.
        let (checks, btf) = btf_checks(Ok(Builder::new().build()), "6.1.0-57-amd64");
        assert!(btf.is_some());
        assert_eq!(find(&checks, "btf").status, Status::Ok);
        assert_eq!(find(&checks, "layout").status, Status::Fail);
        assert!(find(&checks, "op_enums").detail.contains("no enumerator"));
    }

    /// `tracerd doctor`'s layout detail on every kernel at hand.
    const LAYOUT_OF_6_X: &str = "every struct offset tracerd reads resolves; variants: bio->bi_bdev (5.12+), \
                                 rq->q->disk (5.17+), cgroup: bio->bi_blkg (CONFIG_BLK_CGROUP), request \
                                 timestamps: start_time_ns+io_start_time_ns";

    #[test]
    fn real_kernels_pass_the_btf_checks_with_every_choice_named() {
        for f in Fixture::all() {
            let (checks, btf) = btf_checks(Ok(f.bytes()), &f.kernel);
            assert!(checks.iter().all(|c| c.status == Status::Ok), "{}: {checks:?}", f.kernel);
            assert_eq!(find(&checks, "layout").detail, LAYOUT_OF_6_X, "{}", f.kernel);
            let ops = &find(&checks, "op_enums").detail;
            assert_eq!(
                ops, "REQ_OP_READ=0 WRITE=1 FLUSH=2 DISCARD=3; flag bits from __REQ_*",
                "{}",
                f.kernel
            );
            let hooks = tracepoint_checks(btf.as_ref(), None);
            assert!(hooks.iter().all(|c| c.status == Status::Ok), "{}: {hooks:?}", f.kernel);
            let complete = &find(&hooks, "tracepoint:block_bio_complete").detail;
            assert!(complete.ends_with("has struct bio * at argument 1: variant a1"), "{complete}");
            let counted = recursion_check(btf.as_ref());
            assert_eq!((counted.status, counted.name.as_str()), (Status::Ok, "recursion_misses"));
            assert_eq!(
                counted.detail,
                "counted: program runs the kernel skips show as lost{reason=recursion}"
            );
        }
    }

    #[test]
    fn an_old_kernel_s_layout_is_named_and_a_missing_path_names_the_kernel() {
        let mut f = Fixture::load("6.1.0-57-amd64");
        f.member("bio", "bi_bdev", None).member("bio", "bi_disk", Some(8));
        f.member("bio", "bi_partno", Some(27)).member("bio", "bi_blkg", None);
        f.member("request", "rq_disk", Some(160)).member("request", "start_time_ns", None);
        f.member("request", "io_start_time_ns", None);
        let (checks, _) = btf_checks(Ok(f.bytes()), &f.kernel);
        assert_eq!(
            find(&checks, "layout").detail,
            "every struct offset tracerd reads resolves; variants: bio->bi_disk + bi_partno (before 5.12), \
             rq->rq_disk (before 5.17), cgroup: the submitting task's (no CONFIG_BLK_CGROUP), request \
             timestamps: none"
        );
        f.member("bio", "bi_disk", None);
        let (checks, _) = btf_checks(Ok(f.bytes()), &f.kernel);
        let layout = find(&checks, "layout");
        assert_eq!(layout.status, Status::Fail);
        assert_eq!(
            layout.detail,
            "kernel 6.1.0-57-amd64: cannot trace: struct bio has neither bi_bdev (5.12+) nor bi_disk \
             (before 5.12) in its BTF"
        );
    }
}
