//! The md scenario: md raid1 and raid10 (with the kprobes, and from md's own structs) and raid0
//! (each member bio and each split part).

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{
    assert_counts_match_diskstats, assert_layers_add_up, count_by, device, json_lines, op, ran, report,
    section,
};

/// A mirrored md array's 200 writes (qd 1) and 100 reads (qd 2) in `lines`: each write linked
/// to both members, each read to one, and the member IOs linked to it are exactly those. Returns
/// the array's writes.
fn assert_mirror_links<'a>(lines: &'a [Value], md: &str, members: [&str; 2]) -> Vec<&'a Value> {
    let uppers: Vec<&Value> = lines.iter().filter(|l| l["device"] == md).collect();
    let writes: Vec<&Value> = uppers.iter().copied().filter(|l| l["op"] == "write").collect();
    let reads: Vec<&Value> = uppers.iter().copied().filter(|l| l["op"] == "read").collect();
    assert_eq!((writes.len(), reads.len()), (200, 100), "{md} IOs");
    for w in &writes {
        let layers = w["layers"].as_array().unwrap_or_else(|| panic!("{md}: a write not linked: {w}"));
        let lowers: Vec<&str> = layers.iter().map(|l| l["lower"].as_str().unwrap()).collect();
        assert_eq!(lowers, members, "{md}: a write goes to both mirrors: {w}");
        assert!(layers.iter().all(|l| l["ios"] == 1), "{w}");
        assert_layers_add_up(w);
    }
    for r in &reads {
        let layers = r["layers"].as_array().unwrap_or_else(|| panic!("{md}: a read not linked: {r}"));
        assert_eq!(layers.len(), 1, "{md}: a read goes to one mirror: {r}");
        assert_eq!(layers[0]["ios"], 1);
        assert_layers_add_up(r);
    }
    // Member IOs linked to the array equal what it was asked to do.
    let linked: Vec<&Value> = lines
        .iter()
        .filter(|l| l["parent"].is_string() && members.iter().any(|m| l["device"] == *m))
        .collect();
    let by =
        count_by(&linked, |l| format!("{} {}", l["device"].as_str().unwrap(), l["op"].as_str().unwrap()));
    let [a, b] = members;
    assert_eq!(by.get(&format!("{a} write")), Some(&200), "{md}: {by:?}");
    assert_eq!(by.get(&format!("{b} write")), Some(&200), "{md}: {by:?}");
    assert_eq!(by.get(&format!("{a} read")).unwrap_or(&0) + by.get(&format!("{b} read")).unwrap_or(&0), 100);
    writes
}

#[test]
fn md_raid1_writes_link_to_both_members_reads_to_one() {
    if !ran("md") {
        return;
    }
    let lines = json_lines("md_snoop");
    for w in assert_mirror_links(&lines, "md0", ["ram0", "ram1"]) {
        assert!(
            w["submit_ns"].as_u64().unwrap_or(0) > 0 && w["personality_ns"].as_u64().unwrap_or(0) > 0,
            "{w}"
        );
    }

    let r = report("md_report_json");
    let md = device(&r, "md0");
    assert_eq!(md["label"], "md0 (raid1)");
    assert_eq!(md["lowers"], serde_json::json!(["ram0", "ram1"]));
    assert_eq!(device(&r, "ram0")["uppers"], serde_json::json!(["md0"]), "holders/");
    let w = op(md, "write");
    assert_eq!(w["requests"], 200);
    let per_member: BTreeMap<String, u64> = w["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["lower"].as_str().unwrap().to_owned(), l["ios"].as_u64().unwrap()))
        .collect();
    assert_eq!(per_member, BTreeMap::from([("ram0".into(), 200), ("ram1".into(), 200)]));
    assert_eq!(w["submit_path"]["submit_bio"]["count"], 200, "md_submit_bio timed for every write");
    assert_eq!(w["submit_path"]["personality"]["count"], 200, "raid1_make_request timed for every write");
    assert_eq!(op(md, "read")["requests"], 100);
    let text = section("md_report_text");
    assert!(text.contains("md0 (raid1)\n  ├─ ram0\n  └─ ram1"), "stack tree:\n{text}");
}

#[test]
fn md_raid1_and_raid10_link_from_their_own_structs_without_kprobes() {
    if !ran("md") {
        return;
    }
    // Each member bio names its r1bio/r10bio, whose master_bio is the upper bio: read from the
    // modules' BTF, with no kprobe loaded, so also where the kernel has no kprobes.
    let lines = json_lines("md_snoop_btf");
    for (md, members) in [("md0", ["ram0", "ram1"]), ("md1", ["ram7", "ram8"])] {
        for w in assert_mirror_links(&lines, md, members) {
            assert!(w["submit_ns"].is_null(), "no kprobe timed the submit path: {w}");
        }
    }
}

#[test]
fn md_raid0_links_each_member_bio_and_each_split_part_without_kprobes() {
    if !ran("md") {
        return;
    }
    // raid0 sends md's accounting clone of the bio (or of the part it split off) to a member:
    // the clone names the bio md got, so no kprobe is needed. A 128 KiB write spans two 64 KiB
    // chunks: each part is one IO of md4 on one member.
    let lines = json_lines("md_raid0_snoop");
    let members = ["ram16", "ram17"];
    let uppers: Vec<&Value> = lines.iter().filter(|l| l["device"] == "md4").collect();
    let by =
        count_by(&uppers, |l| format!("{} {} split={}", l["op"].as_str().unwrap(), l["bytes"], l["split"]));
    let want = BTreeMap::from([
        ("read 4096 split=false".into(), 100),
        ("write 4096 split=false".into(), 100),
        ("write 65536 split=false".into(), 40),
        ("write 65536 split=true".into(), 40),
    ]);
    assert_eq!(by, want, "md4's IOs: each part of a split write holds its own 64 KiB");
    for u in &uppers {
        let layers = u["layers"].as_array().unwrap_or_else(|| panic!("md4: an IO not linked: {u}"));
        assert_eq!(layers.len(), 1, "md4: one member holds each part: {u}");
        assert!(members.iter().any(|m| layers[0]["lower"] == *m) && layers[0]["ios"] == 1, "{u}");
        assert_layers_add_up(u);
    }
    // The two parts of a split write are on different members (adjacent chunks).
    let parts = count_by(&uppers.iter().filter(|u| u["bytes"] == 65536).copied().collect::<Vec<_>>(), |u| {
        format!("{} split={}", u["layers"][0]["lower"].as_str().unwrap(), u["split"])
    });
    assert_eq!(parts.values().sum::<u64>(), 80, "{parts:?}");
    assert!(parts.values().all(|&n| n == 20 || n == 40), "parts over members: {parts:?}");
    // Every member IO is linked: raid0 does no IO of its own.
    let below: Vec<&Value> = lines.iter().filter(|l| members.iter().any(|m| l["device"] == *m)).collect();
    let unlinked: Vec<_> = below.iter().filter(|l| l["parent"].is_null()).collect();
    assert!(unlinked.is_empty(), "member IO not linked: {unlinked:?}");
    assert_eq!(below.len(), 280, "one member IO per page IO and per part");

    let r = report("md_raid0_report_json");
    assert_eq!(device(&r, "md4")["lowers"], serde_json::json!(members));
    assert_counts_match_diskstats(&r, "md_raid0_diskstats", &["md4"]);
    // And the bytes: md counts each part's own sectors.
    let written = op(device(&r, "md4"), "write")["bytes"].as_u64().unwrap();
    assert_eq!(written, 100 * 4096 + 40 * 131072, "md4 write bytes");
}
