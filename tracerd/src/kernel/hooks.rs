//! The block-layer hooks tracerd attaches, and how each is matched to the running kernel:
//! the tracepoint's argument list in BTF says which compiled variant to load, and tp_btf is
//! tried before raw_tp.

use aya::{
    Btf as AyaBtf, Ebpf,
    programs::{BtfTracePoint, KProbe, RawTracePoint},
};
use serde::Serialize;

use crate::kernel::btf::Btf;

pub struct Hook {
    pub tracepoint: &'static str,
    /// Program name stem in the object (`btf_<stem>_a<N>`, `raw_<stem>_a<N>`).
    stem: &'static str,
    /// The struct whose pointer the program reads.
    pointer: &'static str,
    /// Argument positions compiled into the object.
    variants: &'static [usize],
    /// Without it nothing can be timed.
    pub required: bool,
}

pub const HOOKS: &[Hook] = &[
    Hook {
        tracepoint: "block_bio_queue",
        stem: "bio_queue",
        pointer: "bio",
        variants: &[0, 1],
        required: false,
    },
    Hook { tracepoint: "block_getrq", stem: "getrq", pointer: "bio", variants: &[0, 1], required: false },
    Hook { tracepoint: "block_split", stem: "split", pointer: "bio", variants: &[0, 1], required: false },
    Hook {
        tracepoint: "block_bio_backmerge",
        stem: "backmerge",
        pointer: "bio",
        variants: &[0, 2],
        required: false,
    },
    Hook {
        tracepoint: "block_bio_frontmerge",
        stem: "frontmerge",
        pointer: "bio",
        variants: &[0, 2],
        required: false,
    },
    Hook {
        tracepoint: "block_rq_insert",
        stem: "rq_insert",
        pointer: "request",
        variants: &[0, 1],
        required: false,
    },
    Hook {
        tracepoint: "block_rq_issue",
        stem: "rq_issue",
        pointer: "request",
        variants: &[0, 1],
        required: true,
    },
    Hook {
        tracepoint: "block_rq_requeue",
        stem: "rq_requeue",
        pointer: "request",
        variants: &[0, 1],
        required: false,
    },
    // A request joined to another in the elevator: its first bio's record goes out as a merge.
    Hook {
        tracepoint: "block_rq_merge",
        stem: "rq_merge",
        pointer: "request",
        variants: &[0, 1],
        required: false,
    },
    Hook {
        tracepoint: "block_rq_complete",
        stem: "rq_complete",
        pointer: "request",
        variants: &[0],
        required: true,
    },
    Hook {
        tracepoint: "block_bio_remap",
        stem: "bio_remap",
        pointer: "bio",
        variants: &[0, 1],
        required: false,
    },
    Hook {
        tracepoint: "block_rq_remap",
        stem: "rq_remap",
        pointer: "request",
        variants: &[0, 1],
        required: false,
    },
    Hook {
        tracepoint: "block_bio_complete",
        stem: "bio_complete",
        pointer: "bio",
        variants: &[1],
        required: false,
    },
];

/// A kernel function probed at entry, and at return where `ret` names a program.
pub struct KprobeHook {
    pub function: &'static str,
    entry: &'static str,
    ret: Option<&'static str>,
}

/// Submit paths of stacked devices: kprobe + kretprobe pairs on module functions.
pub const KPROBES: &[KprobeHook] = &[
    KprobeHook { function: "md_submit_bio", entry: "kp_submit_bio", ret: Some("kr_submit_bio") },
    KprobeHook { function: "dm_submit_bio", entry: "kp_submit_bio", ret: Some("kr_submit_bio") },
    KprobeHook { function: "raid1_make_request", entry: "kp_personality", ret: Some("kr_personality") },
    // Request-based dm (multipath): the upper request being dispatched.
    KprobeHook { function: "dm_mq_queue_rq", entry: "kp_queue_rq", ret: Some("kr_queue_rq") },
];

/// H, blk-throttle's check of a bio whose group has limits (6.0 and later; before, every bio
/// went through `blk_throtl_bio`, and probing it would cost every IO). Built in, so it is in
/// vmlinux's BTF wherever the kernel has blk-throttle and did not inline it.
pub const THROTTLE: KprobeHook = KprobeHook { function: "__blk_throtl_bio", entry: "kp_throttle", ret: None };

/// Why H (and so H2Q) cannot be traced on this kernel, or None when it can: blk-throttle's
/// check must exist as a function in BTF, and kprobes must be on.
pub fn throttle_unavailable(btf: &Btf, kprobes_on: bool, kprobe_pmu: bool) -> Option<String> {
    let what = "H2Q (the time blk-throttle, io.max or blkio.throttle.*, holds a bio before its Q)";
    if btf.find(THROTTLE.function, crate::kernel::btf::Kind::Func).is_none() {
        return Some(format!(
            "{what} is unavailable: this kernel has no {} function (no CONFIG_BLK_DEV_THROTTLING, \
             or a kernel before 6.0, which checks every bio in blk_throtl_bio); held time is \
             outside Q2C and not measured",
            THROTTLE.function
        ));
    }
    if !kprobe_pmu {
        return Some(format!(
            "{what} is unavailable: {} needs a kprobe, and this kernel has no kprobe PMU \
             (CONFIG_KPROBES, CONFIG_KPROBE_EVENTS); held time is outside Q2C and not measured",
            THROTTLE.function
        ));
    }
    if !kprobes_on {
        return Some(format!("{what} is off with kprobes (config kprobes = false, or --no-kprobes)"));
    }
    None
}

/// rq-qos waits between Q and G (config `rq_qos`): `rq_qos_wait`, where wbt and io.latency
/// wait (its third argument names which), and `ioc_rqos_throttle`, where io.cost waits.
pub const RQ_QOS: &[KprobeHook] = &[
    KprobeHook { function: "rq_qos_wait", entry: "kp_rq_qos_wait", ret: Some("kr_rq_qos_wait") },
    KprobeHook { function: "ioc_rqos_throttle", entry: "kp_ioc_throttle", ret: Some("kr_ioc_throttle") },
];

/// The callbacks through which wbt and io.latency call `rq_qos_wait`, in this order in
/// `Settings`: static functions, so their addresses come from `/proc/kallsyms`.
pub const RQ_QOS_CALLBACKS: [&str; 2] = ["wbt_inflight_cb", "iolat_acquire_inflight"];

/// Why Q2G cannot be split into rq-qos waits and the rest on this kernel (None: it can, with
/// config `rq_qos`). A kernel without `ioc_rqos_throttle` (no io.cost) still splits wbt's and
/// io.latency's waits: `partial` says so.
pub fn rq_qos_unavailable(btf: &Btf, kprobe_pmu: bool) -> (Option<String>, Option<String>) {
    let has = |f: &str| btf.find(f, crate::kernel::btf::Kind::Func).is_some();
    let what = "Q2G's split (rq-qos policies' waits apart from the wait for a request)";
    if !has(RQ_QOS[0].function) {
        let why = format!(
            "{what} is unavailable: this kernel has no {} function (no CONFIG_BLK_WBT, \
             CONFIG_BLK_CGROUP_IOLATENCY or CONFIG_BLK_CGROUP_IOCOST); Q2G stays whole",
            RQ_QOS[0].function
        );
        return (Some(why), None);
    }
    if !kprobe_pmu {
        let why = format!(
            "{what} is unavailable: no tracepoint marks these waits and this kernel has no kprobe \
             PMU (CONFIG_KPROBES, CONFIG_KPROBE_EVENTS); Q2G stays whole"
        );
        return (Some(why), None);
    }
    let partial = (!has(RQ_QOS[1].function)).then(|| {
        format!("no {} (no CONFIG_BLK_CGROUP_IOCOST): io.cost's waits are not split", RQ_QOS[1].function)
    });
    (None, partial)
}

/// Addresses of `names` in a `/proc/kallsyms` text (0 where absent or hidden).
pub fn kallsyms_addresses<const N: usize>(text: &str, names: [&str; N]) -> [u64; N] {
    let mut out = [0; N];
    for line in text.lines() {
        let mut f = line.split_whitespace();
        let (Some(addr), Some(_), Some(name)) = (f.next(), f.next(), f.next()) else { continue };
        if let Some(i) = names.iter().position(|n| *n == name) {
            out[i] = u64::from_str_radix(addr, 16).unwrap_or(0);
        }
    }
    out
}

const KPROBE_PMU: &str = "/sys/bus/event_source/devices/kprobe/type";

/// Whether this kernel can attach kprobes at all.
pub fn kprobes_available() -> bool {
    std::path::Path::new(KPROBE_PMU).exists()
}

fn kprobe<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut KProbe, String> {
    let prog = ebpf.program_mut(name).ok_or_else(|| format!("program {name} missing from the object"))?;
    prog.try_into().map_err(|e| error_chain(&e))
}

/// Loads the kprobe programs once (each attaches to several functions).
pub fn load_kprobe_programs(ebpf: &mut Ebpf) -> Result<(), String> {
    for name in [
        "kp_submit_bio",
        "kr_submit_bio",
        "kp_personality",
        "kr_personality",
        "kp_queue_rq",
        "kr_queue_rq",
        "kp_throttle",
        "kp_rq_qos_wait",
        "kr_rq_qos_wait",
        "kp_ioc_throttle",
        "kr_ioc_throttle",
    ] {
        kprobe(ebpf, name)?.load().map_err(|e| format!("{name}: {}", error_chain(&e)))?;
    }
    Ok(())
}

impl KprobeHook {
    pub fn skipped(&self, reason: String) -> HookStatus {
        HookStatus { hook: self.function, attach_type: None, program: None, reason: Some(reason) }
    }

    /// Attaches the entry and the return probe (if any): both or neither.
    pub fn attach(&self, ebpf: &mut Ebpf) -> HookStatus {
        let entry = match kprobe(ebpf, self.entry)
            .and_then(|p| p.attach(self.function, 0).map_err(|e| error_chain(&e)))
        {
            Ok(link) => link,
            Err(e) => {
                return self
                    .skipped(format!("{} cannot be probed ({e}); is its module loaded?", self.function));
            }
        };
        let attached = HookStatus {
            hook: self.function,
            attach_type: Some("kprobe"),
            program: Some(self.entry.to_owned()),
            reason: None,
        };
        let Some(ret) = self.ret else { return attached };
        match kprobe(ebpf, ret).and_then(|p| p.attach(self.function, 0).map_err(|e| error_chain(&e))) {
            Ok(_) => attached,
            Err(e) => {
                if let Ok(p) = kprobe(ebpf, self.entry) {
                    let _ = p.detach(entry);
                }
                self.skipped(format!("kretprobe on {} failed: {e}", self.function))
            }
        }
    }
}

/// How a hook ended up: attached (and how), or skipped (and why).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct HookStatus {
    pub hook: &'static str,
    /// "tp_btf" or "raw_tp" when attached.
    pub attach_type: Option<&'static str>,
    /// Program name in the kernel (for finding it in `bpftool prog`).
    pub program: Option<String>,
    /// Why it was skipped, or why tp_btf fell back to raw_tp.
    pub reason: Option<String>,
}

impl HookStatus {
    pub fn attached(&self) -> bool {
        self.attach_type.is_some()
    }
}

impl Hook {
    /// Which compiled variant fits this kernel's tracepoint arguments.
    pub fn variant(&self, btf: &Btf) -> Result<usize, String> {
        let tp = self.tracepoint;
        let args = btf.tracepoint_args(tp).ok_or_else(|| format!("tracepoint {tp} is not in this kernel"))?;
        let pos = args.iter().position(|a| a == self.pointer).ok_or_else(|| {
            let found: Vec<String> = args
                .iter()
                .map(|a| if a.is_empty() { "other".into() } else { format!("struct {a} *") })
                .collect();
            format!(
                "tracepoint {tp} has no struct {} * argument (it has: {})",
                self.pointer,
                found.join(", ")
            )
        })?;
        if self.variants.contains(&pos) {
            return Ok(pos);
        }
        let built: Vec<String> = self.variants.iter().map(usize::to_string).collect();
        Err(format!(
            "tracepoint {tp} has struct {} * at argument {pos}, which tracerd was not built for \
             (only {})",
            self.pointer,
            built.join(" or ")
        ))
    }

    /// Loads and attaches this hook; the link lives as long as `ebpf`.
    pub fn attach(&self, ebpf: &mut Ebpf, btf: &Btf, aya_btf: Option<&AyaBtf>) -> HookStatus {
        let mut status = HookStatus { hook: self.tracepoint, attach_type: None, program: None, reason: None };
        let n = match self.variant(btf) {
            Ok(n) => n,
            Err(reason) => {
                status.reason = Some(reason);
                return status;
            }
        };
        let mut tp_btf_error = None;
        if let Some(aya_btf) = aya_btf {
            let name = format!("btf_{}_a{n}", self.stem);
            match attach_tp_btf(ebpf, &name, self.tracepoint, aya_btf) {
                Ok(()) => {
                    status.attach_type = Some("tp_btf");
                    status.program = Some(name);
                    return status;
                }
                Err(e) => tp_btf_error = Some(format!("tp_btf failed ({e}), using raw_tp")),
            }
        }
        let name = format!("raw_{}_a{n}", self.stem);
        match attach_raw_tp(ebpf, &name, self.tracepoint) {
            Ok(()) => {
                status.attach_type = Some("raw_tp");
                status.program = Some(name);
                status.reason = tp_btf_error;
            }
            Err(e) => {
                status.reason = Some(match tp_btf_error {
                    Some(t) => format!("{t}; raw_tp failed too: {e}"),
                    None => format!("raw_tp failed: {e}"),
                })
            }
        }
        status
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

fn attach_tp_btf(ebpf: &mut Ebpf, name: &str, tp: &str, btf: &AyaBtf) -> Result<(), String> {
    let prog = ebpf.program_mut(name).ok_or_else(|| format!("program {name} missing from the object"))?;
    let prog: &mut BtfTracePoint = prog.try_into().map_err(|e| error_chain(&e))?;
    prog.load(tp, btf).map_err(|e| error_chain(&e))?;
    prog.attach().map_err(|e| error_chain(&e))?;
    Ok(())
}

fn attach_raw_tp(ebpf: &mut Ebpf, name: &str, tp: &str) -> Result<(), String> {
    let prog = ebpf.program_mut(name).ok_or_else(|| format!("program {name} missing from the object"))?;
    let prog: &mut RawTracePoint = prog.try_into().map_err(|e| error_chain(&e))?;
    prog.load().map_err(|e| error_chain(&e))?;
    prog.attach(tp).map_err(|e| error_chain(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::btf::fixtures::Fixture;

    fn hook(tp: &str) -> &'static Hook {
        HOOKS.iter().find(|h| h.tracepoint == tp).unwrap()
    }

    fn variants(f: &Fixture) -> Vec<(&'static str, Result<usize, String>)> {
        let btf = f.btf();
        HOOKS.iter().map(|h| (h.tracepoint, h.variant(&btf))).collect()
    }

    #[test]
    fn real_kernels_take_argument_0_except_bio_complete() {
        // 5.11+: block_bio_complete alone still passes the queue first.
        let expected: Vec<(&str, Result<usize, String>)> = HOOKS
            .iter()
            .map(|h| (h.tracepoint, Ok(if h.tracepoint == "block_bio_complete" { 1 } else { 0 })))
            .collect();
        for f in Fixture::all() {
            assert_eq!(variants(&f), expected, "{}", f.kernel);
            assert_eq!(f.args("block_rq_complete"), ["request", "", ""], "{}", f.kernel);
        }
    }

    #[test]
    fn before_5_11_the_queue_came_first() {
        let mut f = Fixture::load("6.1.0-57-amd64");
        for h in HOOKS {
            let dropped_in_5_11: &[&str] = match h.tracepoint {
                // Unchanged in 5.11.
                "block_rq_complete" | "block_bio_complete" => &[],
                "block_bio_backmerge" | "block_bio_frontmerge" => &["request_queue", "request"],
                _ => &["request_queue"],
            };
            let now = f.args(h.tracepoint);
            let args: Vec<&str> =
                dropped_in_5_11.iter().copied().chain(now.iter().map(String::as_str)).collect();
            f.tracepoint(h.tracepoint, Some(&args));
        }
        let btf = f.btf();
        for h in HOOKS {
            let expected = match h.tracepoint {
                "block_rq_complete" => 0,
                "block_bio_backmerge" | "block_bio_frontmerge" => 2,
                _ => 1,
            };
            assert_eq!(h.variant(&btf), Ok(expected), "{}", h.tracepoint);
        }
    }

    #[test]
    fn a_tracepoint_the_kernel_lacks_is_not_in_this_kernel() {
        let mut f = Fixture::load("6.12.117+deb12-rt-amd64");
        f.tracepoint("block_split", None);
        let btf = f.btf();
        assert_eq!(
            hook("block_split").variant(&btf),
            Err("tracepoint block_split is not in this kernel".into())
        );
        assert_eq!(hook("block_getrq").variant(&btf), Ok(0), "the others stay");
    }

    #[test]
    fn an_argument_tracerd_was_not_built_for_is_named() {
        let mut f = Fixture::load("6.18.44-fc-v595");
        f.tracepoint("block_bio_queue", Some(&["request_queue", "", "bio"]));
        f.tracepoint("block_rq_complete", Some(&["", "request"]));
        f.tracepoint("block_getrq", Some(&["request_queue", ""]));
        let btf = f.btf();
        assert_eq!(
            hook("block_bio_queue").variant(&btf).unwrap_err(),
            "tracepoint block_bio_queue has struct bio * at argument 2, which tracerd was not built for \
             (only 0 or 1)"
        );
        assert_eq!(
            hook("block_rq_complete").variant(&btf).unwrap_err(),
            "tracepoint block_rq_complete has struct request * at argument 1, which tracerd was not built \
             for (only 0)"
        );
        assert_eq!(
            hook("block_getrq").variant(&btf).unwrap_err(),
            "tracepoint block_getrq has no struct bio * argument (it has: struct request_queue *, other)"
        );
    }
}
