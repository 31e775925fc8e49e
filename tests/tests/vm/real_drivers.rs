//! The real_drivers scenario: qemu's NVMe, virtio-scsi and virtio-blk disks behind four schedulers,
//! and NVMe native multipath: counts as /proc/diskstats counts them, head bios linked to path
//! requests.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{
    assert_layers_add_up, device, diskstats_delta, json_lines, op, ran, release, report, requests, section,
};

/// A round of the real_drivers scenario: its scheduler, policy, and disk names.
struct DriversRound {
    name: String,
    scheduler: String,
    policy: String,
    /// The head's `queue/iostats`: whether the kernel counts its IO in /proc/diskstats.
    head_iostats: bool,
    plain: String,
    head: String,
    paths: Vec<String>,
}

fn drivers_rounds() -> Vec<DriversRound> {
    (1..=4)
        .map(|i| {
            let name = format!("real_drivers_{i}");
            let setup = section(&format!("{name}_setup"));
            let field = |k: &str| {
                setup
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix(&format!("{k}=")))
                    .unwrap_or_else(|| panic!("{name}: no {k} in {setup}"))
                    .to_owned()
            };
            let paths: Vec<String> = setup
                .split_once("paths=")
                .map(|(_, p)| p.split_whitespace().map(str::to_owned).collect())
                .unwrap_or_default();
            assert_eq!(paths.len(), 2, "{name}: two paths in {setup}");
            DriversRound {
                scheduler: field("scheduler"),
                policy: field("policy"),
                head_iostats: field("head_iostats") == "1",
                plain: field("plain"),
                head: field("head"),
                paths,
                name,
            }
        })
        .collect()
}

#[test]
fn real_drivers_count_what_diskstats_counts_behind_every_scheduler() {
    if !ran("real_drivers") {
        return;
    }
    for r in drivers_rounds() {
        let delta = diskstats_delta(&r.name);
        let report = report(&format!("{}_report", r.name));
        let what = format!("{} (scheduler {}, policy {}) on {}", r.name, r.scheduler, r.policy, release());
        // The workload: 60 reads and 40 writes on each disk the scenario writes to. The kernel
        // counts a multipath head's IO only where its `queue/iostats` is on (not on 6.1).
        let mut disks = vec![r.plain.as_str(), "sda", "vda"];
        if r.head_iostats {
            disks.push(&r.head);
        } else {
            assert_eq!(delta[&r.head], (0, 0), "{what}: the head counts nothing with iostats off");
            let traced = (requests(&report, &r.head, "read"), requests(&report, &r.head, "write"));
            assert_eq!(traced, (60, 40), "{what}: {} traced against the workload", r.head);
        }
        for d in &disks {
            assert_eq!(delta[*d], (60, 40), "{what}: /proc/diskstats of {d}");
        }
        let on_paths = r.paths.iter().fold((0, 0), |(a, b), p| (a + delta[p].0, b + delta[p].1));
        assert_eq!(on_paths, (60, 40), "{what}: the paths carried the head's IO");
        disks.extend(r.paths.iter().map(String::as_str));
        for d in disks {
            let traced = (requests(&report, d, "read"), requests(&report, d, "write"));
            assert_eq!(traced, delta[d], "{what}: {d} traced against /proc/diskstats");
        }
        let lost = report["lost"].as_object().unwrap();
        assert!(lost.values().all(|v| v == 0), "{what}: {}", report["lost"]);
        eprintln!(
            "{what}: every count equals /proc/diskstats; paths {:?}",
            r.paths.iter().map(|p| delta[p]).collect::<Vec<_>>()
        );
    }
}

#[test]
fn multipath_head_bios_are_linked_one_to_one_to_the_path_requests_that_served_them() {
    if !ran("real_drivers") {
        return;
    }
    for r in drivers_rounds() {
        let what = format!("{} (policy {}) on {}", r.name, r.policy, release());
        let lines = json_lines(&format!("{}_snoop", r.name));
        let heads: Vec<&Value> = lines.iter().filter(|l| l["device"] == r.head).collect();
        assert_eq!(heads.len(), 100, "{what}: head IOs");
        let mut served = BTreeMap::new();
        for h in &heads {
            assert_eq!(h["kind"], "bio", "{h}");
            let layers =
                h["layers"].as_array().unwrap_or_else(|| panic!("{what}: a head bio not linked: {h}"));
            assert_eq!(layers.len(), 1, "{what}: one path per bio: {h}");
            assert_eq!(layers[0]["ios"], 1, "{what}: one request per bio: {h}");
            let path = layers[0]["lower"].as_str().unwrap();
            assert!(r.paths.iter().any(|p| p == path), "{what}: {path} is not a path: {h}");
            assert_layers_add_up(h);
            *served.entry(path.to_owned()).or_insert(0u64) += 1;
        }
        // Bios are reused, so a head bio's id names it only until it completes: each path
        // request is matched with the first head record of its parent that follows it (the
        // kernel side sends the head's record after its path request's).
        let mut waiting: BTreeMap<&str, Vec<&Value>> = BTreeMap::new();
        let mut paths = 0;
        for l in &lines {
            if r.paths.iter().any(|p| l["device"] == *p) {
                paths += 1;
                assert_eq!(l["kind"], "request", "{l}");
                let parent =
                    l["parent"].as_str().unwrap_or_else(|| panic!("{what}: a path request not linked: {l}"));
                // Every request stage is there: the path's own Q is the bio's move to it.
                assert!(l["path"].as_str().unwrap().starts_with('Q'), "{l}");
                assert!(l["stages_ns"]["d2c"].is_u64(), "{l}");
                waiting.entry(parent).or_default().push(l);
            } else if l["device"] == r.head {
                let id = l["id"].as_str().unwrap();
                let served = waiting.get_mut(id).filter(|w| !w.is_empty());
                let p =
                    served.unwrap_or_else(|| panic!("{what}: no path request before head bio {l}")).remove(0);
                assert_eq!((&l["op"], &l["sector"]), (&p["op"], &p["sector"]), "{what}: {p}");
                assert_eq!(l["layers"][0]["lower"], p["device"], "{what}: {l}");
            }
        }
        assert_eq!(paths, 100, "{what}: path requests");
        assert!(waiting.values().all(Vec::is_empty), "{what}: path requests with no head bio: {waiting:?}");
        if r.policy == "round-robin" {
            assert_eq!(served.len(), 2, "{what}: round-robin uses both paths: {served:?}");
        }
        eprintln!("{what}: 100 head bios, each linked to its path request: {served:?}");
    }
}

#[test]
fn a_multipath_head_named_alone_brings_its_paths() {
    if !ran("real_drivers") {
        return;
    }
    for r in drivers_rounds() {
        let report = report(&format!("{}_head", r.name));
        let names: Vec<&str> =
            report["devices"].as_array().unwrap().iter().map(|d| d["device"].as_str().unwrap()).collect();
        // The head and its paths, and nothing else; a path the policy left idle has no IO.
        assert!(names.contains(&r.head.as_str()), "{}: {names:?}", r.name);
        for d in &names {
            assert!(
                *d == r.head || r.paths.iter().any(|p| p == d),
                "{}: {d} traced for --device {}",
                r.name,
                r.head
            );
        }
        assert_eq!((requests(&report, &r.head, "read"), requests(&report, &r.head, "write")), (60, 40));
        let paths = r
            .paths
            .iter()
            .fold((0, 0), |(a, b), p| (a + requests(&report, p, "read"), b + requests(&report, p, "write")));
        assert_eq!(paths, (60, 40), "{}: the paths' requests", r.name);
        let head = device(&report, &r.head);
        let read = op(head, "read");
        let lowers: u64 = read["layers"]
            .as_array()
            .unwrap_or_else(|| panic!("no layers: {read}"))
            .iter()
            .map(|l| l["ios"].as_u64().unwrap())
            .sum();
        assert_eq!(lowers, 60, "{}: every head read split over its paths: {read}", r.name);
    }
}
