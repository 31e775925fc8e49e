//! The dm_copy scenario: dm targets that copy, cache or checksum (snapshot, integrity with and
//! without its journal, writecache, cache): what they send on is linked, what they write of their
//! own is counted as theirs.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{
    assert_counts_match_diskstats, assert_layers_add_up, count_by, dm_kernel_name, json_lines, ran, report,
};

/// The dm_copy scenario's upper IOs on dm device `name` (its kernel name, and those IOs): each
/// linked to exactly one lower IO, on one of `lowers`, the layers adding up; `want` of each op.
fn dmc_uppers<'a>(
    lines: &'a [Value],
    name: &str,
    lowers: &[&str],
    want: &[(&str, u64)],
) -> (String, Vec<&'a Value>) {
    let dev = dm_kernel_name(name);
    let uppers: Vec<&Value> = lines.iter().filter(|l| l["device"] == dev.as_str()).collect();
    for u in &uppers {
        let layers =
            u["layers"].as_array().unwrap_or_else(|| panic!("{name} ({dev}): an IO not linked: {u}"));
        assert_eq!(layers.len(), 1, "{name}: one device below holds its data: {u}");
        assert!(lowers.iter().any(|l| layers[0]["lower"] == *l), "{name}: linked below {lowers:?}: {u}");
        assert_eq!(layers[0]["ios"], 1, "{name}: one lower IO: {u}");
        assert_layers_add_up(u);
    }
    let want: BTreeMap<String, u64> = want.iter().map(|&(o, n)| (o.to_owned(), n)).collect();
    assert_eq!(count_by(&uppers, |l| l["op"].as_str().unwrap().to_owned()), want, "{name} IOs");
    (dev, uppers)
}

/// The dm_copy scenario's IOs on `disk` with `op`: (those that name an upper IO, those that name
/// none), and a check that the report counts the second as `unlinked` (a disk with no IO is in
/// neither).
fn dmc_lowers(lines: &[Value], report: &Value, disk: &str, o: &str) -> (u64, u64) {
    let ios: Vec<&Value> = lines.iter().filter(|l| l["device"] == disk && l["op"] == o).collect();
    let linked = ios.iter().filter(|l| l["parent"].is_string()).count() as u64;
    let own = ios.len() as u64 - linked;
    assert!(ios.iter().all(|l| l["parent"].is_string() != l["unlinked"].is_string()), "{disk} {o}");
    let ops = report["devices"].as_array().unwrap().iter().find(|d| d["device"] == disk).map(|d| &d["ops"]);
    let counted = ops
        .and_then(|ops| ops.as_array().unwrap().iter().find(|x| x["op"] == o))
        .map_or(0, |x| x["unlinked"].as_u64().unwrap_or(0));
    assert_eq!(counted, own, "{disk} {o}: the IO that names no upper IO is counted unlinked");
    (linked, own)
}

/// The dm_copy scenario's workload on integ0, wc0 and cache0.
const BOTH_100: [(&str, u64); 2] = [("read", 100), ("write", 100)];

#[test]
fn dm_snapshot_origin_writes_sent_after_their_copy_are_linked() {
    if !ran("dm_copy") {
        return;
    }
    let lines = json_lines("dm_copy_snoop");
    let r = report("dm_copy_report_json");
    // An origin write waits for kcopyd to copy its chunk to the COW store, then dm-snapshot
    // sends dm's clone on from kcopyd's completion, without a remap: linked at its Q.
    let (orig, _) = dmc_uppers(&lines, "snaporig", &["ram18"], &[("write", 100)]);
    // The snapshot's reads of those chunks are remapped to the COW store.
    let (snap, _) = dmc_uppers(&lines, "snap0", &["ram19"], &[("read", 100)]);
    assert_eq!(dmc_lowers(&lines, &r, "ram18", "write"), (100, 0), "ram18 writes: the origin's");
    assert_eq!(dmc_lowers(&lines, &r, "ram19", "read"), (100, 0), "ram19 reads: the snapshot's");
    // The copies are dm-snapshot's own IO: kcopyd reads each chunk from the origin and writes
    // it to the COW store, with the store's exception metadata after it.
    let (_, copied_out) = dmc_lowers(&lines, &r, "ram18", "read");
    let (_, copied_in) = dmc_lowers(&lines, &r, "ram19", "write");
    assert_eq!(copied_out, 100, "one chunk copied per origin write");
    assert!(copied_in > 100, "the copies and the exception metadata: {copied_in}");
    // brd counts no IO in /proc/diskstats; dm does.
    assert_counts_match_diskstats(&r, "dm_copy_diskstats", &[&orig, &snap]);
}

#[test]
fn dm_integrity_data_sent_on_without_a_remap_is_linked_and_its_tags_are_its_own() {
    if !ran("dm_copy") {
        return;
    }
    let lines = json_lines("dm_copy_snoop");
    let r = report("dm_copy_report_json");
    // dm-integrity moves dm's clone onto its disk and past the tag area itself, and sends it
    // without a remap; the tags go through dm-bufio, to the same disk, naming no upper IO.
    let (dev, _) = dmc_uppers(&lines, "integ0", &["ram20"], &BOTH_100);
    let (writes, tag_writes) = dmc_lowers(&lines, &r, "ram20", "write");
    let (reads, _) = dmc_lowers(&lines, &r, "ram20", "read");
    assert_eq!((writes, reads), (100, 100), "ram20: one data IO per integ0 IO");
    assert!(tag_writes > 0, "the tags of 100 new blocks are written");
    assert_counts_match_diskstats(&r, "dm_copy_diskstats", &[&dev]);
}

#[test]
fn dm_integrity_journal_writes_name_no_upper_io_and_are_counted_as_its_own() {
    if !ran("dm_copy") {
        return;
    }
    let lines = json_lines("dm_copy_snoop");
    let r = report("dm_copy_report_json");
    // With its journal, dm-integrity copies a write's data into the journal and commits whole
    // journal sections with dm-io, for every write since the last commit, then copies the
    // data to its place: no lower IO names an upper write, and each is counted as its own.
    let dev = dm_kernel_name("integ1");
    let uppers: Vec<&Value> = lines.iter().filter(|l| l["device"] == dev.as_str()).collect();
    let want = BTreeMap::from([("read".to_string(), 100), ("write".to_string(), 100)]);
    assert_eq!(count_by(&uppers, |l| l["op"].as_str().unwrap().to_owned()), want, "integ1 IOs");
    let (linked, journal) = dmc_lowers(&lines, &r, "ram26", "write");
    assert_eq!(linked, 0, "ram26: no write names an integ1 write");
    assert!(journal > 0, "the journal commits are written");
    // A read of data still in the journal is served from memory, with no lower IO; any other
    // is dm's clone sent on without a remap, linked one to one.
    let mut read_linked = 0;
    for u in &uppers {
        match u["layers"].as_array() {
            None => {}
            Some(layers) if u["op"] == "read" => {
                assert_eq!(layers.len(), 1, "{u}");
                assert_eq!((&layers[0]["lower"], &layers[0]["ios"]), (&"ram26".into(), &1.into()), "{u}");
                assert_layers_add_up(u);
                read_linked += 1;
            }
            Some(_) => panic!("integ1: a write linked below: {u}"),
        }
    }
    assert_eq!(
        dmc_lowers(&lines, &r, "ram26", "read").0,
        read_linked,
        "ram26 reads that name an integ1 read"
    );
    eprintln!(
        "integ1: {read_linked} of 100 reads from ram26, the rest from the journal; {journal} journal writes"
    );
    assert_counts_match_diskstats(&r, "dm_copy_diskstats", &[&dev]);
}

#[test]
fn dm_writecache_writes_and_cached_reads_are_linked_to_the_cache_disk() {
    if !ran("dm_copy") {
        return;
    }
    let lines = json_lines("dm_copy_snoop");
    let r = report("dm_copy_report_json");
    // In SSD mode a write goes to the cache disk, and a read of a cached block comes from it;
    // the commits of its metadata are its own.
    let (dev, _) = dmc_uppers(&lines, "wc0", &["ram22"], &BOTH_100);
    let (writes, commits) = dmc_lowers(&lines, &r, "ram22", "write");
    assert_eq!(writes, 100, "ram22: each wc0 write");
    assert_eq!(dmc_lowers(&lines, &r, "ram22", "read").0, 100, "ram22: each wc0 read");
    assert!(commits > 0, "writecache commits its metadata");
    assert_counts_match_diskstats(&r, "dm_copy_diskstats", &[&dev]);
}

#[test]
fn dm_cache_ios_are_linked_to_the_origin_or_the_cache_and_its_migrations_are_its_own() {
    if !ran("dm_copy") {
        return;
    }
    let lines = json_lines("dm_copy_snoop");
    let r = report("dm_copy_report_json");
    // A block not in the cache is read and written on the origin; smq's promotions (copies by
    // kcopyd) would be dm-cache's own IO.
    let (dev, _) = dmc_uppers(&lines, "cache0", &["ram24", "ram25"], &BOTH_100);
    let mut linked = 0;
    for disk in ["ram24", "ram25"] {
        for o in ["read", "write"] {
            linked += dmc_lowers(&lines, &r, disk, o).0;
        }
    }
    assert_eq!(linked, 200, "one lower IO per cache0 IO, on the cache or the origin");
    // The metadata device serves no upper IO.
    for o in ["read", "write"] {
        assert_eq!(dmc_lowers(&lines, &r, "ram23", o).0, 0, "cache0's metadata names no upper IO");
    }
    assert_counts_match_diskstats(&r, "dm_copy_diskstats", &[&dev]);
}
