//! The md_parity scenario: md raid5 and raid6 (member data linked to its upper bios, the rest
//! named md's own IO), and three levels: dm-crypt over dm-linear over raid5.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{
    assert_counts_match_diskstats, assert_layers_add_up, count_by, device, json_lines, op, ran, report,
    section,
};

#[test]
fn md_raid5_links_member_data_to_its_upper_bios_and_names_md_s_own_io() {
    if !ran("md_parity") {
        return;
    }
    // Without kprobes: raid5d sends the stripes, so only md's structs can link them.
    let lines = json_lines("md_parity_raid5_snoop");
    let members = ["ram9", "ram10", "ram11"];
    let uppers: Vec<&Value> = lines.iter().filter(|l| l["device"] == "md2").collect();
    let by = count_by(&uppers, |l| format!("{} {}", l["op"].as_str().unwrap(), l["bytes"]));
    let want =
        BTreeMap::from([("read 4096".into(), 100), ("write 4096".into(), 120), ("write 512".into(), 64)]);
    assert_eq!(by, want, "md2's IOs");
    // Each upper IO's data is on one member page: one lower IO on one member, whichever task
    // sent it, also where one member write carries four 512-byte writes of a page.
    let (below, kinds) = raid5_member_kinds(&lines, &uppers, &members);
    let n = |k: &str| kinds.get(k).copied().unwrap_or(0);
    assert_eq!(n("linked read"), 100, "aligned reads, one member read each: {kinds:?}");
    // The page writes: one member write each (and a parity write each, at qd 1). The small
    // writes: four to a page, 16 pages, so between 16 and 64 member writes.
    assert!((120 + 16..=120 + 64).contains(&n("linked write")), "{kinds:?}");
    assert!(n("parity write") >= 120 + 16, "{kinds:?}");
    // The first write after the array was marked clean waits for md to mark it dirty again,
    // in every member's superblock.
    for m in members {
        let sb = below.iter().filter(|l| l["device"] == m && l["unlinked"] == "superblock").count();
        assert!(sb >= 1, "{m}: {sb} superblock writes");
    }

    let r = report("md_parity_raid5_report_json");
    let w = op(device(&r, "md2"), "write");
    assert_eq!(w["requests"], 184);
    let linked: u64 = w["layers"].as_array().unwrap().iter().map(|l| l["ios"].as_u64().unwrap()).sum();
    assert_eq!(linked, 184, "every md2 write linked to one member: {w}");
    let parity: u64 = members
        .iter()
        .map(|m| op(device(&r, m), "write")["unlinked_kinds"]["parity"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(parity, n("parity write"), "report and snoop count the same parity writes");
    // md counts its own IO in /proc/diskstats (brd counts none).
    assert_counts_match_diskstats(&r, "md_parity_raid5_diskstats", &["md2"]);
}

/// An md raid4/5/6 snoop: each of the array's IOs (`uppers`) linked to one member IO on one of
/// `members`, with layers that add up; every member IO linked or named as md's own, by a kind
/// md states. Returns the member IOs and their count by kind ("linked read", "parity write").
fn raid5_member_kinds<'a>(
    lines: &'a [Value],
    uppers: &[&Value],
    members: &[&str],
) -> (Vec<&'a Value>, BTreeMap<String, u64>) {
    for u in uppers {
        let layers =
            u["layers"].as_array().unwrap_or_else(|| panic!("{}: an IO not linked: {u}", u["device"]));
        assert_eq!(layers.len(), 1, "one member holds the data: {u}");
        assert!(members.iter().any(|m| layers[0]["lower"] == *m) && layers[0]["ios"] == 1, "{u}");
        assert_layers_add_up(u);
    }
    let below: Vec<&Value> = lines.iter().filter(|l| members.iter().any(|m| l["device"] == *m)).collect();
    let kinds = count_by(&below, |l| match (&l["parent"], &l["unlinked"]) {
        (Value::String(_), Value::Null) => format!("linked {}", l["op"].as_str().unwrap()),
        (Value::Null, Value::String(kind)) => format!("{kind} {}", l["op"].as_str().unwrap()),
        _ => panic!("a member IO is neither linked nor unlinked: {l}"),
    });
    let known = ["linked read", "linked write", "parity write", "preread read", "superblock write"];
    assert!(kinds.keys().all(|k| known.contains(&k.as_str())), "member IO md did not explain: {kinds:?}");
    (below, kinds)
}

#[test]
fn md_raid6_links_member_data_and_names_both_parity_pages_md_s_own() {
    if !ran("md_parity") {
        return;
    }
    // raid6 over four members: a page write is one data write and two parity writes (P, Q).
    let lines = json_lines("md_parity_raid6_snoop");
    let members = ["ram12", "ram13", "ram14", "ram15"];
    let uppers: Vec<&Value> = lines.iter().filter(|l| l["device"] == "md3").collect();
    let by = count_by(&uppers, |l| format!("{} {}", l["op"].as_str().unwrap(), l["bytes"]));
    assert_eq!(by, BTreeMap::from([("read 4096".into(), 60), ("write 4096".into(), 60)]), "md3's IOs");
    let (_, kinds) = raid5_member_kinds(&lines, &uppers, &members);
    let n = |k: &str| kinds.get(k).copied().unwrap_or(0);
    assert_eq!((n("linked read"), n("linked write")), (60, 60), "one member IO per page: {kinds:?}");
    assert!(n("parity write") >= 2 * 60, "P and Q for each page write: {kinds:?}");

    let r = report("md_parity_raid6_report_json");
    assert_eq!(device(&r, "md3")["lowers"], serde_json::json!(members));
    let w = op(device(&r, "md3"), "write");
    let linked: u64 = w["layers"].as_array().unwrap().iter().map(|l| l["ios"].as_u64().unwrap()).sum();
    assert_eq!((w["requests"].as_u64(), linked), (Some(60), 60), "every md3 write linked to one member: {w}");
    let parity: u64 = members
        .iter()
        .map(|m| op(device(&r, m), "write")["unlinked_kinds"]["parity"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(parity, n("parity write"), "report and snoop count the same parity writes");
    assert_counts_match_diskstats(&r, "md_parity_raid6_diskstats", &["md3"]);
}

#[test]
fn three_levels_split_at_each_level_and_add_up_io_by_io() {
    if !ran("md_parity") {
        return;
    }
    // dm-crypt (top0) over dm-linear (vol0) over md raid5 (md2) over ram9..11, no kprobes.
    let names: BTreeMap<String, String> = section("md_parity_stack3_names")
        .lines()
        .filter_map(|l| l.split_once(' ').map(|(a, b)| (a.to_owned(), b.to_owned())))
        .collect();
    let (top, vol) = (names["top0"].as_str(), names["vol0"].as_str());
    let r = report("md_parity_stack3_report_json");
    assert_eq!(device(&r, top)["lowers"], serde_json::json!([vol]));
    assert_eq!(device(&r, vol)["lowers"], serde_json::json!(["md2"]));
    assert_eq!(device(&r, "md2")["lowers"], serde_json::json!(["ram10", "ram11", "ram9"]));
    let lines = json_lines("md_parity_stack3_snoop");
    let members = ["ram9", "ram10", "ram11"];
    for (upper, below) in [(top, vec![vol]), (vol, vec!["md2"]), ("md2", members.to_vec())] {
        let mut n = BTreeMap::<String, u64>::new();
        for (i, u) in lines.iter().enumerate().filter(|(_, l)| l["device"] == upper) {
            *n.entry(u["op"].as_str().unwrap().to_owned()).or_default() += 1;
            let layers = u["layers"].as_array().unwrap_or_else(|| panic!("{upper}: an IO not linked: {u}"));
            assert_eq!(layers.len(), 1, "{upper}: one device below holds its data: {u}");
            assert_eq!(layers[0]["ios"], 1, "{u}");
            assert_layers_add_up(u);
            // The level below, IO by IO: this IO's `lower` phase is its lower IO's Q2C. Its
            // record came before, and is the last one there naming this IO (bios are reused).
            let lower = lines[..i]
                .iter()
                .rev()
                .find(|l| l["parent"] == u["id"] && below.iter().any(|b| l["device"] == *b))
                .unwrap_or_else(|| panic!("{upper}: no lower IO names {u}"));
            assert_eq!(layers[0]["lower"], lower["device"], "{u}");
            assert_eq!(layers[0]["lower_ns"], lower["stages_ns"]["q2c"], "{upper} over {lower}");
        }
        assert_eq!(n, BTreeMap::from([("read".into(), 100), ("write".into(), 100)]), "{upper}");
    }
    assert_counts_match_diskstats(&r, "md_parity_stack3_diskstats", &[top, vol, "md2"]);
}
