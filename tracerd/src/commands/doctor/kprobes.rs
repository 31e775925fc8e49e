//! The kprobe PMU and the kprobed functions of the stacked drivers: in /proc/kallsyms or not,
//! whether their module is loaded or even built, and how the load test attached them.

use std::collections::HashMap;

use crate::{
    kernel::hooks::{HookStatus, KPROBES},
    kernel::tracer,
    model::topology::Device,
};

use crate::view::doctor::{Check, Status};

pub(super) const KALLSYMS: &str = "/proc/kallsyms";

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
pub(super) enum ModuleState {
    Loaded,
    NotLoaded,
    /// Neither in modules.dep nor in modules.builtin.
    NotBuilt,
    /// No module lists to look in (no /lib/modules/<release>).
    Unknown,
}

pub(super) fn module_state(module: &str) -> ModuleState {
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
pub(super) fn kprobe_checks(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::doctor::{passed, tests::find};

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
}
