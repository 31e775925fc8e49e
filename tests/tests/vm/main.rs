//! Assertions on a run of a Debian kernel (6.1, 6.12, 6.12 PREEMPT_RT) under qemu (`cargo xtask
//! vm-test`): md, dm, brd, null_blk and qemu's disks exist only there. The guest runs tracerd
//! against known workloads and prints its output between `VM-RESULT-BEGIN name` /
//! `VM-RESULT-END name` markers on the serial console; xtask hands the console log over in
//! TRACERD_VM_CONSOLE, one kernel at a time.
//!
//! One module per scenario, named like it (xtask/src/vm/scenarios.rs); this file reads the
//! console (through xtask's reader of the guest's console protocol) and holds what several
//! scenarios' tests share.

mod causes;
mod cgroups;
mod dm_copy;
mod dm_deferred;
mod dm_linear;
mod dm_multipath;
mod doctor;
mod host_kernel;
mod md;
mod md_parity;
mod null_blk;
mod nvme_ana;
mod nvme_failover;
mod real_drivers;

use std::collections::BTreeMap;

use serde_json::Value;
use xtask::vm::console as vm_console;

fn console() -> String {
    let path = std::env::var("TRACERD_VM_CONSOLE")
        .expect("TRACERD_VM_CONSOLE is unset: these tests check a VM run; use `cargo xtask vm-test`");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read the VM console log {path}: {e}"))
}

/// `uname -r` of the guest.
fn release() -> String {
    vm_console::release(&console()).expect("no VM-BOOTED line").to_owned()
}

/// Whether scenario `name` ran: false, with a loud SKIPPED line, where the kernel's package
/// lacks a module it needs (the guest says which); a scenario that neither ran nor said why
/// fails the test.
fn ran(name: &str) -> bool {
    match vm_console::outcome(&console(), name) {
        vm_console::Outcome::Ran => true,
        vm_console::Outcome::Skipped(line) => {
            eprintln!("SKIPPED on {}: {line}", release());
            false
        }
        vm_console::Outcome::Silent => {
            panic!("scenario {name} did not run on {} and the guest did not say why", release())
        }
    }
}

/// The lines of result section `name`, each ending in a newline, without the kernel's lines.
fn section(name: &str) -> String {
    match vm_console::section_lines(&console(), name) {
        Ok(lines) => lines.iter().map(|l| format!("{l}\n")).collect(),
        Err(vm_console::SectionError::Missing) => panic!("no section {name} in the VM console log"),
        Err(vm_console::SectionError::Unclosed) => panic!("section {name} is not closed"),
    }
}

fn json_lines(name: &str) -> Vec<Value> {
    section(name)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{name}: not JSON ({e}): {l}")))
        .collect()
}

fn report(name: &str) -> Value {
    let text = section(name);
    let start = text.find('{').unwrap_or_else(|| panic!("{name}: no JSON in\n{text}"));
    serde_json::from_str(&text[start..]).unwrap_or_else(|e| panic!("{name}: bad JSON ({e}):\n{text}"))
}

fn device<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"] == name)
        .unwrap_or_else(|| panic!("device {name} missing from report: {report}"))
}

fn op<'a>(device: &'a Value, op: &str) -> &'a Value {
    device["ops"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["op"] == op)
        .unwrap_or_else(|| panic!("no {op} in {device}"))
}

fn count_by(lines: &[&Value], key: impl Fn(&Value) -> String) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for l in lines {
        *m.entry(key(l)).or_default() += 1;
    }
    m
}

/// Every upper IO's layers add up to its Q2C, exactly.
fn assert_layers_add_up(upper: &Value) {
    let q2c = upper["stages_ns"]["q2c"].as_u64().expect("q2c");
    for l in upper["layers"].as_array().expect("layers") {
        let sum = l["layer_ns"].as_u64().unwrap()
            + l["lower_ns"].as_u64().unwrap()
            + l["completion_ns"].as_u64().unwrap();
        assert_eq!(sum, q2c, "layer + lower + completion != Q2C: {upper}");
    }
}

/// The kernel name of dm device `name`, from a scenario's `dm devices:` line (each scenario that
/// makes dm devices prints one; names are not reused across scenarios, kernel names are).
fn dm_kernel_name(name: &str) -> String {
    let text = console();
    let lines: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("dm devices: ")).collect();
    assert!(!lines.is_empty(), "no `dm devices:` line");
    lines
        .iter()
        .flat_map(|l| l.split_whitespace())
        .find_map(|pair| pair.split_once('=').filter(|(_, n)| *n == name).map(|(dev, _)| dev.to_owned()))
        .unwrap_or_else(|| panic!("no dm device {name} in: {lines:?}"))
}

/// Each of `devices` has as many reads and writes in `report` as /proc/diskstats counted
/// between the two snapshots of `diskstats`.
fn assert_counts_match_diskstats(report: &Value, diskstats: &str, devices: &[&str]) {
    let delta = diskstats_delta(diskstats);
    for &d in devices {
        let dev = device(report, d);
        let traced = |o: &str| {
            dev["ops"]
                .as_array()
                .unwrap()
                .iter()
                .find(|x| x["op"] == o)
                .map_or(0, |x| x["requests"].as_u64().unwrap())
        };
        assert_eq!(
            (traced("read"), traced("write")),
            delta[d],
            "{d}: (reads, writes) traced vs /proc/diskstats"
        );
    }
}

/// Reads and writes completed per device between two /proc/diskstats snapshots.
fn diskstats_delta(name: &str) -> BTreeMap<String, (u64, u64)> {
    diskstats_columns(name, [3, 7])
}

/// Two columns of /proc/diskstats (0-based, as split on whitespace: 3 reads completed, 4 reads
/// merged, 7 writes completed, 8 writes merged), per device, between two snapshots.
fn diskstats_columns(name: &str, [a, b]: [usize; 2]) -> BTreeMap<String, (u64, u64)> {
    let parse = |section_name: String| -> BTreeMap<String, (u64, u64)> {
        section(&section_name)
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                Some((f.get(2)?.to_string(), (f.get(a)?.parse().ok()?, f.get(b)?.parse().ok()?)))
            })
            .collect()
    };
    let (before, after) = (parse(format!("{name}_before")), parse(format!("{name}_after")));
    after.iter().map(|(d, (r, w))| (d.clone(), (r - before[d].0, w - before[d].1))).collect()
}

fn requests(report: &Value, device: &str, o: &str) -> u64 {
    report["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"] == device)
        .and_then(|d| d["ops"].as_array().unwrap().iter().find(|x| x["op"] == o))
        .map_or(0, |x| x["requests"].as_u64().unwrap())
}

/// Walks a snoop of an NVMe head over `paths`: each head record follows every path request its
/// bio took (those naming its id as parent since its last record: bios are reused once
/// complete); exactly one of them served it, the others failed over, and all are lower IOs of
/// it. Returns (head bios, path requests that served one, path requests that failed over).
fn assert_each_head_bio_served_once(lines: &[Value], head: &str, paths: &[&str]) -> (u64, u64, u64) {
    let mut waiting: BTreeMap<&str, Vec<&Value>> = BTreeMap::new();
    let (mut heads, mut served, mut failed_over) = (0, 0, 0);
    for (i, l) in lines.iter().enumerate() {
        if paths.iter().any(|p| l["device"] == *p) {
            assert_eq!(l["kind"], "request", "{l}");
            let parent = l["parent"].as_str().unwrap_or_else(|| panic!("a path request not linked: {l}"));
            waiting.entry(parent).or_default().push(l);
            if l["failed_over"] == true { failed_over += 1 } else { served += 1 }
        } else if l["device"] == head {
            heads += 1;
            let took = waiting.remove(l["id"].as_str().unwrap()).unwrap_or_default();
            let serving: Vec<&&Value> = took.iter().filter(|p| p["failed_over"] != true).collect();
            assert_eq!(serving.len(), 1, "one path request served head bio {l}: {took:?}");
            assert_eq!(
                (&l["op"], &l["sector"]),
                (&serving[0]["op"], &serving[0]["sector"]),
                "the path request that served head bio {l} is another IO's: {took:?}; the last lines with \
                 its id before it: {:?}",
                lines[..i]
                    .iter()
                    .filter(|x| x["id"] == l["id"] || x["parent"] == l["id"])
                    .rev()
                    .take(12)
                    .collect::<Vec<_>>()
            );
            let ios: u64 = l["layers"].as_array().unwrap().iter().map(|x| x["ios"].as_u64().unwrap()).sum();
            assert_eq!(ios, took.len() as u64, "every path request it took is a lower IO of it: {l}");
            assert_layers_add_up(l);
        }
    }
    assert!(waiting.values().all(Vec::is_empty), "path requests with no head bio: {waiting:?}");
    (heads, served, failed_over)
}
