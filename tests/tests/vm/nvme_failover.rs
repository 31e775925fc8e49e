//! The nvme_failover scenario: NVMe multipath under controller resets, and bios merged on a path.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{
    assert_counts_match_diskstats, assert_each_head_bio_served_once, assert_layers_add_up, device,
    diskstats_columns, json_lines, op, ran, release, report, section,
};

#[test]
fn nvme_controller_resets_under_io_count_each_head_bio_once_and_link_every_path_request() {
    if !ran("nvme_failover") {
        return;
    }
    // Shown only if the test fails: what snoop counted as lost, and any change of the devices
    // it traced while the controller reset.
    let log = section("nvme_failover_snoop_log");
    println!("snoop's log:\n{log}");
    let setup = section("nvme_failover_setup");
    let field = |k: &str| {
        setup
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("{setup}"))
    };
    let head = field("head");
    let paths: Vec<&str> = setup
        .lines()
        .next()
        .unwrap()
        .split("paths=")
        .nth(1)
        .unwrap()
        .split(" reset=")
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    let (heads, served, failed_over) =
        assert_each_head_bio_served_once(&json_lines("nvme_failover_snoop"), head, &paths);
    assert_eq!(heads, served, "each head bio served once");
    // A head bio is missing only where the kernel skipped one of tracerd's programs for it (a
    // nested run, `recursion`) or its completion went unseen (`missed_completion`), and snoop
    // counted that: never silently.
    let counted = lost_in_log(&log, "recursion") + lost_in_log(&log, "missed_completion");
    assert!(
        heads <= 3000 && 3000 - heads <= counted,
        "{} of 3000 head bios missing, {counted} losses counted",
        3000 - heads.min(3000)
    );
    // qemu's controller completes the requests in flight before a reset ends, so none fails
    // over here; where one does, it is a lower IO of its bio (checked above) beside the one
    // that served it.
    // The paths count what the kernel counted, failed-over requests included.
    let r = report("nvme_failover_report");
    assert_counts_match_diskstats(&r, "nvme_failover", &paths);
    assert_eq!(op(device(&r, head), "read")["requests"], 3000);
    eprintln!("{}: 3000 head bios, {failed_over} path requests failed over", release());
}

#[test]
fn bios_merged_on_an_nvme_path_are_lower_ios_of_their_head_bios() {
    if !ran("nvme_failover") {
        return;
    }
    let setup = section("nvme_failover_setup");
    let head = setup.split_whitespace().find_map(|w| w.strip_prefix("head=")).unwrap();
    let paths: Vec<&str> =
        setup.split("paths=").nth(1).unwrap().split(" reset=").next().unwrap().split_whitespace().collect();
    let merged = diskstats_columns("nvme_failover_merge", [8, 7]);
    let (merges, requests) = paths.iter().fold((0, 0), |(m, r), p| (m + merged[*p].0, r + merged[*p].1));
    assert!(merges > 0, "{}: the path merged no write ({merged:?}): nothing was tested", release());
    assert_eq!(merges + requests, 512, "{}: every head bio reached a path: {merged:?}", release());
    // Each head bio's one lower IO is the path request it allocated or the merge into one.
    let lines = json_lines("nvme_failover_merge_snoop");
    let mut waiting: BTreeMap<&str, Vec<&Value>> = BTreeMap::new();
    let (mut heads, mut merge_lines, mut request_lines) = (0, 0, 0);
    for l in &lines {
        if paths.iter().any(|p| l["device"] == *p) {
            match l["kind"].as_str() {
                Some("merge") => merge_lines += 1,
                Some("request") => request_lines += 1,
                _ => panic!("{l}"),
            }
            let parent = l["parent"].as_str().unwrap_or_else(|| panic!("a path IO not linked: {l}"));
            waiting.entry(parent).or_default().push(l);
        } else if l["device"] == head {
            heads += 1;
            assert_eq!((&l["kind"], &l["op"]), (&Value::from("bio"), &Value::from("write")), "{l}");
            let took = waiting.remove(l["id"].as_str().unwrap()).unwrap_or_default();
            assert_eq!(took.len(), 1, "one path IO served head bio {l}: {took:?}");
            assert_eq!(l["sector"], took[0]["sector"], "{l}");
            let layers = l["layers"].as_array().unwrap_or_else(|| panic!("a head bio not linked: {l}"));
            assert_eq!(layers.len(), 1, "{l}");
            assert_eq!(
                (&layers[0]["lower"], &layers[0]["ios"]),
                (&took[0]["device"], &Value::from(1)),
                "{l}"
            );
            assert_layers_add_up(l);
        }
    }
    assert!(waiting.values().all(Vec::is_empty), "path IOs with no head bio: {waiting:?}");
    assert_eq!((heads, merge_lines, request_lines), (512, merges, requests), "{}", release());
    let r = report("nvme_failover_merge_report");
    // numa sends it all down one path; a path with no IO is not in the report.
    let used: Vec<&str> = paths.iter().copied().filter(|p| merged[*p] != (0, 0)).collect();
    assert_counts_match_diskstats(&r, "nvme_failover_merge", &used);
    assert_eq!(op(device(&r, head), "write")["requests"], 512);
    let lost = r["lost"].as_object().unwrap();
    assert!(lost.values().all(|v| v == 0), "no head bio left to the stale sweep: {}", r["lost"]);
    eprintln!("{}: 512 head bios: {requests} path requests, {merges} merged into them", release());
}

/// The count of `reason` in snoop's "lost events: [(\"reason\", n), ...]" log line (0 if none).
fn lost_in_log(log: &str, reason: &str) -> u64 {
    let Some(line) = log.lines().find(|l| l.contains("lost events:")) else { return 0 };
    let key = format!("(\"{reason}\", ");
    line.split(&key)
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .map_or(0, |n| n.trim().parse().unwrap_or_else(|e| panic!("{line}: {e}")))
}

#[test]
fn losses_in_snoops_log_are_read_by_reason() {
    let log = "x\n2026-12-07T20:24:16Z  WARN tracerd::commands::snoop: lost events: [(\"missed_completion\", 8), (\"recursion\", 4)]\n";
    assert_eq!(lost_in_log(log, "recursion"), 4);
    assert_eq!(lost_in_log(log, "missed_completion"), 8);
    assert_eq!(lost_in_log(log, "ringbuf_full"), 0);
    assert_eq!(lost_in_log("no losses", "recursion"), 0);
}
