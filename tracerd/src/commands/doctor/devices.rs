//! The block devices, which of them are stacked, and how a stacked device's IO is linked (the
//! drivers' module BTF) and split per layer on this kernel.

use crate::{
    kernel::stacking::{self, Chain, ChainState},
    model::topology::{Device, Topology},
};

use crate::view::doctor::{Check, Status};

/// The stacked drivers' module BTF: which lower IOs are linked from any task, which wait for
/// their module, and which cannot be linked on this kernel.
pub(super) fn chain_checks(chains: &[Chain]) -> Vec<Check> {
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

/// At most this many device names in the block devices line.
const NAMES_SHOWN: usize = 16;

pub(super) fn devices_check(topology: std::result::Result<&Topology, &str>, kprobes: bool) -> Check {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::topology::tests::fake_stacked_sysfs;

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
