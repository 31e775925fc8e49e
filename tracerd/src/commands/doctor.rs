//! `tracerd doctor`: checks this kernel and this process (BTF, struct layout, hooks, kprobes,
//! ring buffer, a real load) and says what will and will not work here, and why.
//!
//! Every check runs also without privileges: a check that needs them says what root or the
//! capabilities would change instead of stopping the run. Facts are gathered first, then
//! turned into checks by pure functions, so the verdicts are tested without a kernel.

use std::{
    collections::HashMap,
    io::{IsTerminal, Write},
    os::fd::{FromRawFd, OwnedFd},
};

use anyhow::Result;
use serde::Serialize;
use tracer_common::limits;

use crate::{
    kernel::btf::{Btf, VMLINUX},
    kernel::cgroup_series,
    kernel::hooks::{
        HOOKS, Hook, HookStatus, KPROBES, RQ_QOS, RQ_QOS_CALLBACKS, THROTTLE, kallsyms_addresses,
        kprobes_available, rq_qos_unavailable, throttle_unavailable,
    },
    kernel::layout,
    kernel::series,
    kernel::stacking::{self, Chain, ChainState},
    kernel::tracer::{self, CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN, LoadOptions, Tracer},
    model::topology::{Device, Topology},
    serve::api,
    units,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    /// Works, with something missing or unverified.
    Warn,
    /// tracerd cannot run here.
    Fail,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "FAIL",
        }
    }

    fn colour(self) -> &'static str {
        match self {
            Status::Ok => "\x1b[32m",
            Status::Warn => "\x1b[33m",
            Status::Fail => "\x1b[1;31m",
        }
    }
}

/// One line of the report; the JSON output is an array of these.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Stable identifier for scripts: `btf`, `tracepoint:block_rq_issue`, `kprobe:md_submit_bio`.
    pub name: String,
    pub status: Status,
    /// What was found, and for a warn or FAIL what that costs.
    pub detail: String,
    /// What to do about it, where something can be done.
    pub advice: Option<String>,
}

impl Check {
    fn new(name: impl Into<String>, status: Status, detail: impl Into<String>) -> Check {
        Check { name: name.into(), status, detail: detail.into(), advice: None }
    }

    fn advice(mut self, advice: impl Into<String>) -> Check {
        self.advice = Some(advice.into());
        self
    }
}

/// Runs every check, prints them (text or JSON); returns whether nothing FAILed.
/// `socket`: where a running agent is looked for (the views' socket).
pub fn doctor(json: bool, load: bool, socket: &std::path::Path) -> Result<bool> {
    let checks = run_checks(load, socket);
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", serde_json::to_string_pretty(&checks)?)?;
    } else {
        let colour = std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
        write!(out, "{}", render(&checks, colour))?;
    }
    out.flush()?;
    Ok(passed(&checks))
}

/// What the load test found.
#[derive(Clone, Debug)]
enum LoadTest {
    /// `--no-load`.
    Skipped,
    Unprivileged,
    Failed(String),
    /// Every hook's status, tracepoints first (as `Tracer::hooks`).
    Loaded(Vec<HookStatus>),
}

fn run_checks(load: bool, socket: &std::path::Path) -> Vec<Check> {
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
    let load_test = if !load {
        LoadTest::Skipped
    } else if !privileged {
        LoadTest::Unprivileged
    } else {
        match Tracer::load(&LoadOptions::default()) {
            // Dropping the tracer detaches and unloads everything it attached.
            Ok(t) => LoadTest::Loaded(t.hooks.clone()),
            Err(e) => LoadTest::Failed(format!("{e:#}")),
        }
    };
    let attached = match &load_test {
        LoadTest::Loaded(hooks) => Some(hooks.as_slice()),
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
    checks.push(bpf_stats_check(read_sysctl("bpf_stats_enabled").as_deref()));
    checks.push(recursion_check(btf.as_ref()));
    checks.push(unprivileged_bpf_check(read_sysctl("unprivileged_bpf_disabled").as_deref()));
    checks.push(devices_check(topology.as_ref().map_err(String::as_str), kprobes_available()));
    checks
}

/// The stacked drivers' module BTF: which lower IOs are linked from any task, which wait for
/// their module, and which cannot be linked on this kernel.
fn chain_checks(chains: &[Chain]) -> Vec<Check> {
    chains
        .iter()
        .map(|c| {
            let name = format!("module_btf:{}", c.name);
            let detail = stacking::describe(c);
            match c.state {
                ChainState::Linked(_) | ChainState::NotLoaded => Check::new(name, Status::Ok, detail),
                ChainState::Off(_) => Check::new(name, Status::Warn, detail).advice(
                    "use a kernel built with CONFIG_DEBUG_INFO_BTF_MODULES=y (distribution kernels are)",
                ),
            }
        })
        .collect()
}

/// H2Q: whether blk-throttle's holds can be timed here (`unavailable`: why not), and whether
/// the load test attached its probe.
fn throttle_check(unavailable: Option<String>, attached: Option<&[HookStatus]>) -> Check {
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
fn rq_qos_check(
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

fn read_sysctl(name: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/sys/kernel/{name}")).ok().map(|s| s.trim().to_owned())
}

/// Major and minor of a release such as `6.18.44-fc-v857`.
fn parse_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Present, holding 1, on kernels with the PREEMPT_RT patch set (Debian's -rt among them);
/// mainline PREEMPT_RT (6.12+) without those patches lacks it.
const REALTIME: &str = "/sys/kernel/realtime";

/// Whether the kernel is PREEMPT_RT: /sys/kernel/realtime holds 1, or `uname -v` (the
/// `version` sysctl) names it, as every PREEMPT_RT build does.
fn preempt_rt(realtime: Option<&str>, version: &str) -> bool {
    realtime.is_some_and(|r| r.trim() == "1") || version.split_whitespace().any(|w| w == "PREEMPT_RT")
}

fn kernel_check(release: &str, preempt_rt: bool) -> Check {
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

fn privileges_check(caps: u64, euid: u32) -> Check {
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

/// The BTF check, then the two that need BTF: struct layout and op enums. Returns the parsed
/// BTF for the hook checks.
fn btf_checks(read: std::io::Result<Vec<u8>>, kernel: &str) -> (Vec<Check>, Option<Btf>) {
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
        "block_bio_remap" => "no per-layer split of md/dm IO (tracerd_io_layer_seconds)",
        "block_rq_remap" => "no per-layer split of request-based dm (multipath)",
        "block_bio_complete" => "bio-based devices (md, dm, brd) never complete: no q2c, no per-layer split",
        _ => "nothing can be timed",
    }
}

/// One check per tracepoint hook: in BTF or not, which variant, and (after a load test) how it
/// attached.
fn tracepoint_checks(btf: Option<&Btf>, attached: Option<&[HookStatus]>) -> Vec<Check> {
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

const KALLSYMS: &str = "/proc/kallsyms";

/// The functions of `wanted` that /proc/kallsyms lists as code (`t`/`T`), each with its module
/// (None: built into the kernel). Lines are `address type name [module]`.
pub fn kallsyms_lookup(text: &str, wanted: &[&str]) -> HashMap<String, Option<String>> {
    let mut found = HashMap::new();
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let (Some(_), Some(kind), Some(name)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        if matches!(kind, "t" | "T") && wanted.contains(&name) {
            let module = fields.next().map(|m| m.trim_start_matches('[').trim_end_matches(']').to_owned());
            found.entry(name.to_owned()).or_insert(module);
        }
    }
    found
}

/// For a kprobed function: its module, the devices it serves, and whether a device is one.
fn owner(function: &str) -> (&'static str, &'static str, fn(&Device) -> bool) {
    match function {
        "md_submit_bio" => ("md_mod", "md", |d| d.md_level.is_some()),
        "raid1_make_request" => ("raid1", "md raid1", |d| d.md_level.as_deref() == Some("raid1")),
        "dm_mq_queue_rq" => {
            ("dm_mod", "request-based dm (multipath)", |d| d.dm_name.is_some() && d.request_based)
        }
        _ => ("dm_mod", "dm", |d| d.dm_name.is_some()),
    }
}

/// Whether a kernel module is loaded, could be, or does not exist for this kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ModuleState {
    Loaded,
    NotLoaded,
    /// Neither in modules.dep nor in modules.builtin.
    NotBuilt,
    /// No module lists to look in (no /lib/modules/<release>).
    Unknown,
}

fn module_state(module: &str) -> ModuleState {
    if std::path::Path::new("/sys/module").join(module).exists() {
        return ModuleState::Loaded;
    }
    let dir = format!("/lib/modules/{}", tracer::kernel_release());
    let lists: Vec<String> = ["modules.dep", "modules.builtin"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(format!("{dir}/{f}")).ok())
        .collect();
    match lists.is_empty() {
        true => ModuleState::Unknown,
        false if lists.iter().any(|l| module_listed(l, module)) => ModuleState::NotLoaded,
        false => ModuleState::NotBuilt,
    }
}

/// Whether modules.dep or modules.builtin (`kernel/drivers/md/md-mod.ko.xz: ...`) lists
/// `module` (`md_mod`: file names use either `-` or `_`).
fn module_listed(list: &str, module: &str) -> bool {
    list.lines().any(|line| {
        let path = line.split(':').next().unwrap_or_default();
        let file = path.rsplit('/').next().unwrap_or_default();
        file.split(".ko").next().is_some_and(|stem| stem.replace('-', "_") == module)
    })
}

/// The kprobe PMU, then one check per kprobed function.
fn kprobe_checks(
    pmu: bool,
    symbols: &std::result::Result<HashMap<String, Option<String>>, String>,
    devices: &[Device],
    modules: &dyn Fn(&str) -> ModuleState,
    attached: Option<&[HookStatus]>,
) -> Vec<Check> {
    let mut checks = vec![if pmu {
        Check::new(
            "kprobes",
            Status::Ok,
            "kprobe PMU present: md/dm submit-path time and per-layer attribution are available",
        )
    } else {
        Check::new(
            "kprobes",
            Status::Warn,
            "no kprobe PMU (/sys/bus/event_source/devices/kprobe is missing: the kernel lacks \
             CONFIG_KPROBE_EVENTS): md/dm submit-path time (tracerd_io_submit_seconds) and per-layer \
             attribution (tracerd_io_layer_seconds) are off; Q2C of md/dm devices is still measured",
        )
        .advice("only for stacked devices: use a kernel with CONFIG_KPROBES=y and CONFIG_KPROBE_EVENTS=y")
    }];
    for k in KPROBES {
        let name = format!("kprobe:{}", k.function);
        let symbols = match symbols {
            Ok(s) => s,
            Err(e) => {
                checks.push(Check::new(&name, Status::Warn, format!("cannot read {KALLSYMS}: {e}")));
                continue;
            }
        };
        let (module, kind, serves) = owner(k.function);
        let users: Vec<&str> = devices.iter().filter(|d| serves(d)).map(|d| d.name.as_str()).collect();
        let listed = symbols.get(k.function);
        let state = modules(module);
        let place = match (listed, state) {
            (Some(Some(m)), _) => format!("in {KALLSYMS} (module {m})"),
            (Some(None), _) => format!("in {KALLSYMS} (built in)"),
            (None, ModuleState::Loaded) => format!("not in {KALLSYMS} although {module} is loaded"),
            (None, ModuleState::NotLoaded) => format!("not in {KALLSYMS}: {module} is not loaded"),
            (None, ModuleState::NotBuilt) => {
                format!("not in {KALLSYMS}: this kernel has no {module} module, so no {kind} devices")
            }
            (None, ModuleState::Unknown) => {
                format!("not in {KALLSYMS}: {module} is not loaded (or not built for this kernel)")
            }
        };
        let check = if listed.is_none() && users.is_empty() && state == ModuleState::NotBuilt {
            Check::new(&name, Status::Ok, format!("{place}: nothing to probe"))
        } else if !pmu {
            Check::new(
                &name,
                Status::Warn,
                format!("{place}; cannot be probed without the kprobe PMU (see kprobes)"),
            )
        } else if listed.is_none() && !users.is_empty() {
            Check::new(
                &name,
                Status::Warn,
                format!(
                    "{place}, yet {kind} devices exist ({}): their submit-path time and per-layer split \
                     are off",
                    users.join(", ")
                ),
            )
            .advice(format!(
                "this kernel's {module} has no {} (renamed or inlined): report it with `uname -r`",
                k.function
            ))
        } else if listed.is_none() && state == ModuleState::Loaded {
            Check::new(
                &name,
                Status::Warn,
                format!(
                    "{place}: this kernel's {module} has no such function (renamed or inlined); {kind} \
                     devices will lack their per-layer split"
                ),
            )
        } else if listed.is_none() {
            // Nothing is lost now: no such device can exist until the module is loaded.
            Check::new(
                &name,
                Status::Ok,
                format!("{place} (no {kind} devices); attach when {module} is loaded; tracerd retries"),
            )
        } else {
            match attached.and_then(|hooks| hooks.iter().find(|s| s.hook == k.function)) {
                None => Check::new(&name, Status::Ok, place),
                Some(s) if s.attached() => {
                    Check::new(&name, Status::Ok, format!("{place}; attached (kprobe and kretprobe)"))
                }
                Some(s) => Check::new(
                    &name,
                    Status::Warn,
                    format!(
                        "{place}, but attaching failed: {}",
                        s.reason.as_deref().unwrap_or("unknown reason")
                    ),
                )
                .advice("see /sys/kernel/debug/kprobes/blacklist: a function there cannot be probed"),
            }
        };
        checks.push(check);
    }
    checks
}

/// Creates and closes a BPF ring buffer map of `bytes` (BPF_MAP_CREATE).
fn create_ring_buffer(bytes: u32) -> std::io::Result<()> {
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

fn ring_buffer_check(privileged: bool, create: impl FnOnce(u32) -> std::io::Result<()>) -> Check {
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

/// What `run`'s in-kernel aggregation takes on this machine with `devices` block devices (its
/// per-CPU series are sized at load for the devices traced, whether they do IO or not).
fn aggregation_check(cpus: usize, devices: usize) -> Check {
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
fn agent_check(socket: &std::path::Path, status: Result<api::Status, api::AttachError>) -> Check {
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

fn load_check(test: &LoadTest) -> Check {
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
        LoadTest::Loaded(hooks) => {
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

fn bpf_stats_check(value: Option<&str>) -> Check {
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
fn recursion_check(btf: Option<&Btf>) -> Check {
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

fn unprivileged_bpf_check(value: Option<&str>) -> Check {
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

/// At most this many device names in the block devices line.
const NAMES_SHOWN: usize = 16;

fn devices_check(topology: std::result::Result<&Topology, &str>, kprobes: bool) -> Check {
    let name = "block_devices";
    let topo = match topology {
        Ok(t) => t,
        Err(e) => {
            return Check::new(name, Status::Fail, e.to_owned())
                .advice("mount sysfs at /sys (in a container, bind-mount the host's /sys read-only)");
        }
    };
    let names = topo.names();
    if names.is_empty() {
        return Check::new(name, Status::Warn, "no block devices in /sys/class/block: nothing to trace yet")
            .advice("tracerd picks up new devices every second; nothing to do");
    }
    let mut listed = names.iter().take(NAMES_SHOWN).cloned().collect::<Vec<_>>().join(", ");
    if names.len() > NAMES_SHOWN {
        listed.push_str(&format!(" and {} more", names.len() - NAMES_SHOWN));
    }
    let mut stacked: Vec<&Device> = topo
        .devices()
        .filter(|d| !d.partition && (d.md_level.is_some() || d.dm_name.is_some() || !d.lowers.is_empty()))
        .collect();
    stacked.sort_by(|a, b| a.name.cmp(&b.name));
    let found = format!("{} in /sys/class/block: {listed}", names.len());
    if stacked.is_empty() {
        return Check::new(name, Status::Ok, format!("{found}; none stacked (md/dm)"));
    }
    let split: Vec<(String, Option<&str>)> =
        stacked.iter().map(|d| (d.label(), split_by(topo, d, kprobes))).collect();
    let labels = split
        .iter()
        .map(|(label, how)| format!("{label} (split {})", how.unwrap_or("only with kprobes")))
        .collect::<Vec<_>>()
        .join(", ");
    let check = Check::new(name, Status::Ok, format!("{found}; stacked: {labels}"));
    if split.iter().all(|(_, how)| how.is_some()) {
        check
    } else {
        Check { status: Status::Warn, ..check }
            .advice("their Q2C is measured; the per-layer split of these needs kprobes (see kprobes)")
    }
}

/// How a stacked device's IO is split per layer on this kernel (see the stacking guide), or None
/// where that needs the kprobes it lacks. dm's, md raid1's and raid10's chains also need their
/// module's BTF: the `module_btf:*` checks say whether they have it.
fn split_by(topo: &Topology, d: &Device, kprobes: bool) -> Option<&'static str> {
    let paths = d.lowers.iter().filter_map(|l| topo.by_name(l)).any(Device::is_path);
    match d.md_level.as_deref() {
        _ if paths => Some("from the head's remaps"),
        _ if d.dm_name.is_some() => Some("from dm's structs"),
        Some("raid1" | "raid10") => Some("from md's structs"),
        Some("raid4" | "raid5" | "raid6") => Some("not yet: stripes are not followed"),
        _ if kprobes => Some("through kprobes"),
        _ => None,
    }
}

/// Nothing FAILed (warnings pass).
pub fn passed(checks: &[Check]) -> bool {
    checks.iter().all(|c| c.status != Status::Fail)
}

/// The closing line: the verdict, and the first failure or the warnings.
pub fn summary(checks: &[Check]) -> String {
    let failed: Vec<&Check> = checks.iter().filter(|c| c.status == Status::Fail).collect();
    if let Some(first) = failed.first() {
        let more = match failed.len() {
            1 => String::new(),
            n => format!(" ({n} checks failed)"),
        };
        return format!("tracerd cannot run here: {}: {}{more}", first.name, first.detail);
    }
    let warned: Vec<&str> =
        checks.iter().filter(|c| c.status == Status::Warn).map(|c| c.name.as_str()).collect();
    match warned.len() {
        0 => "tracerd will work here: every check passed".to_owned(),
        n => format!(
            "tracerd will work here: {n} warning{} ({}), see above",
            if n == 1 { "" } else { "s" },
            warned.join(", ")
        ),
    }
}

/// One line per check (`status  name  detail -> advice`), then the summary.
pub fn render(checks: &[Check], colour: bool) -> String {
    let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    let paint = |text: &str, status: Status| {
        if colour { format!("{}{text}\x1b[0m", status.colour()) } else { text.to_owned() }
    };
    let mut out = String::new();
    for c in checks {
        let label = paint(&format!("{:<4}", c.status.label()), c.status);
        out.push_str(&format!("{label}  {:<width$}  {}", c.name, c.detail));
        if let Some(advice) = &c.advice {
            out.push_str(" -> ");
            out.push_str(advice);
        }
        out.push('\n');
    }
    let verdict = if passed(checks) { Status::Ok } else { Status::Fail };
    out.push('\n');
    out.push_str(&paint(&summary(checks), verdict));
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        kernel::btf::{fixtures::Fixture, tests::Builder},
        model::topology::tests::fake_stacked_sysfs,
    };

    fn check(name: &str, status: Status) -> Check {
        Check::new(name, status, format!("{name} detail"))
    }

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

    #[test]
    fn render_aligns_names_appends_advice_and_colours_only_when_asked() {
        let checks = vec![
            check("kernel", Status::Ok),
            check("kprobes", Status::Warn).advice("use another kernel"),
            check("tracepoint:block_rq_issue", Status::Ok),
        ];
        let plain = render(&checks, false);
        let lines: Vec<&str> = plain.lines().collect();
        assert_eq!(lines[0], "ok    kernel                     kernel detail");
        assert_eq!(lines[1], "warn  kprobes                    kprobes detail -> use another kernel");
        assert_eq!(lines[2], "ok    tracepoint:block_rq_issue  tracepoint:block_rq_issue detail");
        assert_eq!(lines[3], "");
        assert!(lines[4].starts_with("tracerd will work here"), "{}", lines[4]);
        assert!(!plain.contains('\x1b'), "no escapes without colour");
        let coloured = render(&checks, true);
        assert!(coloured.contains("\x1b[33mwarn\x1b[0m  kprobes "), "{coloured:?}");
        assert_eq!(coloured.lines().count(), lines.len());
    }

    #[test]
    fn fail_label_is_upper_case_and_json_has_the_four_fields() {
        let c = check("privileges", Status::Fail).advice("sudo");
        assert!(render(std::slice::from_ref(&c), false).starts_with("FAIL  privileges"));
        let v: serde_json::Value = serde_json::to_value([c, check("kernel", Status::Ok)]).unwrap();
        assert_eq!(v[0]["name"], "privileges");
        assert_eq!(v[0]["status"], "fail");
        assert_eq!(v[0]["detail"], "privileges detail");
        assert_eq!(v[0]["advice"], "sudo");
        assert_eq!(v[1]["status"], "ok");
        assert!(v[1]["advice"].is_null());
    }

    #[test]
    fn summary_names_the_first_failure_and_warnings_keep_it_passing() {
        let all_ok = [check("kernel", Status::Ok), check("btf", Status::Ok)];
        assert!(passed(&all_ok));
        assert_eq!(summary(&all_ok), "tracerd will work here: every check passed");

        let warned =
            [check("kernel", Status::Ok), check("kprobes", Status::Warn), check("load", Status::Warn)];
        assert!(passed(&warned));
        assert_eq!(summary(&warned), "tracerd will work here: 2 warnings (kprobes, load), see above");

        let failed = [
            check("kernel", Status::Ok),
            check("privileges", Status::Fail),
            check("kprobes", Status::Warn),
            check("load", Status::Fail),
        ];
        assert!(!passed(&failed));
        assert_eq!(
            summary(&failed),
            "tracerd cannot run here: privileges: privileges detail (2 checks failed)"
        );
        assert!(render(&failed, true).ends_with(
            "\x1b[1;31mtracerd cannot run here: privileges: privileges detail (2 checks failed)\x1b[0m\n"
        ));
    }

    #[test]
    fn kallsyms_lookup_finds_code_symbols_and_their_modules() {
        let text = "\
0000000000000000 T _stext
0000000000000000 t md_submit_bio\t[md_mod]
0000000000000000 T dm_submit_bio [dm_mod]
0000000000000000 d raid1_make_request [raid1]
ffffffff81000000 T dm_mq_queue_rq
ffffffff81000010 t md_submit_bio.cold [md_mod]
garbage
";
        let found = kallsyms_lookup(
            text,
            &["md_submit_bio", "dm_submit_bio", "raid1_make_request", "dm_mq_queue_rq"],
        );
        assert_eq!(found.get("md_submit_bio"), Some(&Some("md_mod".to_owned())));
        assert_eq!(found.get("dm_submit_bio"), Some(&Some("dm_mod".to_owned())));
        assert_eq!(found.get("dm_mq_queue_rq"), Some(&None), "built in");
        assert_eq!(found.get("raid1_make_request"), None, "a data symbol is not a function");
        assert_eq!(found.len(), 3);
    }

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

    fn find<'a>(checks: &'a [Check], name: &str) -> &'a Check {
        checks.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no {name} in {checks:?}"))
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

    fn device(name: &str, md_level: Option<&str>, dm_name: Option<&str>, request_based: bool) -> Device {
        Device {
            name: name.into(),
            dev: 0,
            disk: name.into(),
            partition: false,
            request_based,
            lowers: vec![],
            uppers: vec![],
            dm_name: dm_name.map(Into::into),
            md_level: md_level.map(Into::into),
            hidden: false,
        }
    }

    #[test]
    fn module_lists_match_either_spelling() {
        let dep = "kernel/drivers/md/md-mod.ko.xz:\n\
                   kernel/drivers/md/raid1.ko.zst: kernel/drivers/md/md-mod.ko.xz\n";
        assert!(module_listed(dep, "md_mod"));
        assert!(module_listed(dep, "raid1"));
        assert!(!module_listed(dep, "dm_mod"));
        assert!(module_listed("kernel/drivers/md/dm-mod.ko\n", "dm_mod"), "modules.builtin lines");
    }

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

    #[test]
    fn kprobe_checks_tell_a_missing_module_from_a_missing_pmu() {
        use ModuleState::*;
        let symbols: std::result::Result<_, String> =
            Ok(kallsyms_lookup("0 T dm_submit_bio [dm_mod]\n", &["dm_submit_bio"]));
        let not_loaded = |m: &str| if m == "dm_mod" { Loaded } else { NotLoaded };
        let no_devices = kprobe_checks(true, &symbols, &[], &not_loaded, None);
        assert_eq!(no_devices.len(), 1 + KPROBES.len());
        assert_eq!(find(&no_devices, "kprobes").status, Status::Ok);
        let md = find(&no_devices, "kprobe:md_submit_bio");
        assert_eq!(md.status, Status::Ok, "md not loaded: nothing lost yet");
        assert!(md.detail.contains("attach when md_mod is loaded; tracerd retries"), "{}", md.detail);
        assert!(find(&no_devices, "kprobe:dm_submit_bio").detail.contains("(module dm_mod)"));
        // dm_mod is loaded, but this function is not in it.
        assert_eq!(find(&no_devices, "kprobe:dm_mq_queue_rq").status, Status::Warn);

        // An md array exists, but its submit function is not there to probe.
        let md0 = [device("md0", Some("raid1"), None, false)];
        let checks = kprobe_checks(true, &symbols, &md0, &not_loaded, None);
        let md = find(&checks, "kprobe:md_submit_bio");
        assert_eq!(md.status, Status::Warn);
        assert!(md.detail.contains("md devices exist (md0)"), "{}", md.detail);

        let unknown = |_: &str| Unknown;
        let no_pmu = kprobe_checks(false, &symbols, &[], &unknown, None);
        assert_eq!(find(&no_pmu, "kprobes").status, Status::Warn);
        assert!(find(&no_pmu, "kprobes").detail.contains("no kprobe PMU"));
        assert!(no_pmu[1..].iter().all(|c| c.status == Status::Warn && c.detail.contains("kprobe PMU")));
        assert!(passed(&no_pmu), "kprobes are optional");
        // A module this kernel does not have: nothing to probe, with or without kprobes.
        let not_built = kprobe_checks(false, &symbols, &[], &|_: &str| NotBuilt, None);
        let raid1 = find(&not_built, "kprobe:raid1_make_request");
        assert_eq!(raid1.status, Status::Ok);
        assert!(raid1.detail.contains("no raid1 module"), "{}", raid1.detail);

        let attached =
            [HookStatus { hook: "dm_submit_bio", attach_type: Some("kprobe"), program: None, reason: None }];
        let checks = kprobe_checks(true, &symbols, &[], &not_loaded, Some(&attached));
        assert!(find(&checks, "kprobe:dm_submit_bio").detail.ends_with("attached (kprobe and kretprobe)"));

        let unreadable: std::result::Result<_, String> = Err("permission denied".into());
        let checks = kprobe_checks(true, &unreadable, &[], &unknown, None);
        assert!(
            checks[1..].iter().all(|c| c.status == Status::Warn && c.detail.contains("permission denied"))
        );
    }

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
        let c = load_check(&LoadTest::Loaded(hooks));
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
    fn devices_check_lists_devices_and_flags_stacks_without_kprobes() {
        let dir = fake_stacked_sysfs(
            &[("ram0", "1:0", None, false), ("ram1", "1:1", None, false), ("vda", "254:0", None, true)],
            &[("md0", "9:0", &["ram0", "ram1"], None, Some("raid1"))],
        );
        let topo = Topology::scan_root(&dir.0, &dir.0.join("diskstats")).unwrap();
        let with = devices_check(Ok(&topo), true);
        assert_eq!(with.status, Status::Ok);
        assert!(with.detail.starts_with("4 in /sys/class/block: md0, ram0, ram1, vda"), "{}", with.detail);
        assert!(with.detail.contains("stacked: md0 (raid1) (split from md's structs)"), "{}", with.detail);
        assert_eq!(devices_check(Ok(&topo), false).status, Status::Ok, "raid1 needs no kprobes");

        let raid0 = fake_stacked_sysfs(
            &[("ram0", "1:0", None, false), ("ram1", "1:1", None, false)],
            &[("md0", "9:0", &["ram0", "ram1"], None, Some("raid0"))],
        );
        let topo = Topology::scan_root(&raid0.0, &raid0.0.join("diskstats")).unwrap();
        assert!(devices_check(Ok(&topo), true).detail.contains("md0 (raid0) (split through kprobes)"));
        let without = devices_check(Ok(&topo), false);
        assert_eq!(without.status, Status::Warn);
        assert!(without.detail.contains("md0 (raid0) (split only with kprobes)"), "{}", without.detail);

        let plain = fake_stacked_sysfs(&[("vda", "254:0", None, true)], &[]);
        let topo = Topology::scan_root(&plain.0, &plain.0.join("diskstats")).unwrap();
        assert!(devices_check(Ok(&topo), false).detail.ends_with("none stacked (md/dm)"));
        assert_eq!(devices_check(Err("cannot list block devices"), true).status, Status::Fail);
    }
}
