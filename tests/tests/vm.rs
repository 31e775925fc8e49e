//! Assertions on a run of a Debian kernel (6.1, 6.12, 6.12 PREEMPT_RT) under qemu (`cargo xtask
//! vm-test`): md raid1, dm-linear, brd and null_blk exist only there. The guest runs tracerd
//! against known workloads and prints its output between `VM-RESULT-BEGIN name` /
//! `VM-RESULT-END name` markers on the serial console; xtask hands the console log over in
//! TRACERD_VM_CONSOLE, one kernel at a time.

use std::collections::BTreeMap;

use serde_json::Value;

fn console() -> String {
    let path = std::env::var("TRACERD_VM_CONSOLE")
        .expect("TRACERD_VM_CONSOLE is unset: these tests check a VM run; use `cargo xtask vm-test`");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read the VM console log {path}: {e}"))
}

/// `uname -r` of the guest.
fn release() -> String {
    let text = console();
    let line = text.lines().find_map(|l| l.strip_prefix("VM-BOOTED ")).expect("no VM-BOOTED line");
    line.split_whitespace().next().unwrap_or_default().to_owned()
}

/// Whether scenario `name` ran: false, with a loud SKIPPED line, where the kernel's package
/// lacks a module it needs (the guest says which); a scenario that neither ran nor said why
/// fails the test.
fn ran(name: &str) -> bool {
    let text = console();
    if text.lines().any(|l| l == format!("VM-SCENARIO {name}")) {
        return true;
    }
    match text.lines().find(|l| l.starts_with(&format!("VM-SKIPPED {name}:"))) {
        Some(line) => {
            eprintln!("SKIPPED on {}: {line}", release());
            false
        }
        None => panic!("scenario {name} did not run on {} and the guest did not say why", release()),
    }
}

fn section(name: &str) -> String {
    let text = console();
    let begin = format!("VM-RESULT-BEGIN {name}\n");
    let end = format!("VM-RESULT-END {name}");
    let start =
        text.find(&begin).unwrap_or_else(|| panic!("no section {name} in the VM console log")) + begin.len();
    let len = text[start..].find(&end).unwrap_or_else(|| panic!("section {name} is not closed"));
    // Kernel messages ("[   12.345678] md: ...") can interleave on the serial console.
    text[start..start + len]
        .replace('\r', "")
        .lines()
        .filter(|l| !is_kernel_line(l))
        .map(|l| format!("{l}\n"))
        .collect()
}

fn is_kernel_line(line: &str) -> bool {
    line.strip_prefix('[').and_then(|rest| rest.split_once(']')).is_some_and(|(ts, _)| {
        ts.trim().split_once('.').is_some_and(|(a, b)| a.chars().all(|c| c.is_ascii_digit()) && b.len() == 6)
    })
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

#[test]
fn kprobes_attach_in_the_debian_kernel() {
    if !ran("dm_linear") {
        return;
    }
    let r = report("dm_linear_report_json");
    for hook in ["md_submit_bio", "dm_submit_bio", "raid1_make_request", "dm_mq_queue_rq"] {
        let h = r["hooks"].as_array().unwrap().iter().find(|h| h["hook"] == hook).expect(hook);
        assert_eq!(h["attach_type"], "kprobe", "{h}");
    }
    for h in r["hooks"].as_array().unwrap() {
        assert!(h["attach_type"].is_string(), "every hook attaches on {}: {h}", release());
    }
}

#[test]
fn dm_linear_each_io_counted_once_and_linked_to_one_lower_io() {
    if !ran("dm_linear") {
        return;
    }
    let lines = json_lines("dm_linear_snoop");
    let uppers: Vec<&Value> = lines.iter().filter(|l| l["device"] == "dm-0").collect();
    let lowers: Vec<&Value> = lines.iter().filter(|l| l["device"] == "ram2").collect();
    let want = BTreeMap::from([("read".to_string(), 300), ("write".to_string(), 200)]);
    assert_eq!(count_by(&uppers, |l| l["op"].as_str().unwrap().to_owned()), want, "dm-0 IOs");
    assert_eq!(count_by(&lowers, |l| l["op"].as_str().unwrap().to_owned()), want, "ram2 IOs");
    for u in &uppers {
        assert_eq!(u["kind"], "bio", "dm-0 is bio-based: {u}");
        let layers = u["layers"].as_array().unwrap_or_else(|| panic!("no layers: {u}"));
        assert_eq!(layers.len(), 1, "{u}");
        assert_eq!(layers[0]["lower"], "ram2");
        assert_eq!(layers[0]["ios"], 1, "one lower IO per dm-linear IO: {u}");
        assert_layers_add_up(u);
        assert!(u["submit_ns"].as_u64().unwrap_or(0) > 0, "dm_submit_bio timed: {u}");
    }
    assert!(lowers.iter().all(|l| l["parent"].is_string()), "every ram2 IO came from dm-0");

    let r = report("dm_linear_report_json");
    let dm = device(&r, "dm-0");
    assert_eq!(dm["label"], "dm-0 (lin0)");
    assert_eq!(dm["lowers"], serde_json::json!(["ram2"]));
    for (name, n) in [("read", 300), ("write", 200)] {
        let o = op(dm, name);
        assert_eq!(o["requests"], n);
        assert_eq!(o["stages"]["q2c"]["count"], n);
        assert_eq!(o["layers"][0]["lower"], "ram2");
        assert_eq!(o["layers"][0]["ios"], n);
        assert_eq!(o["layers"][0]["lower_ios"], n);
        assert_eq!(o["submit_path"]["submit_bio"]["count"], n);
        assert_eq!(op(device(&r, "ram2"), name)["requests"], n);
    }
    let text = section("dm_linear_report_text");
    assert!(text.contains("dm-0 (lin0)\n  └─ ram2"), "stack tree:\n{text}");
    assert!(text.contains("per layer"), "{text}");

    // The same IO from the agent's recorder (report --since, attached): counts, the stack and
    // the per-layer phases survive the frames.
    let w = report("dm_linear_window");
    assert!(w["from_agent"]["frames"].as_u64().unwrap() >= 1, "{}", w["from_agent"]);
    let dm = device(&w, "dm-0");
    assert_eq!(dm["label"], "dm-0 (lin0)");
    assert_eq!(dm["lowers"], serde_json::json!(["ram2"]));
    for (name, n) in [("read", 300), ("write", 200)] {
        let o = op(dm, name);
        assert_eq!(o["requests"], n, "window {name}");
        assert_eq!(o["stages"]["q2c"]["count"], n);
        assert_eq!(o["layers"][0]["lower"], "ram2");
        assert_eq!(
            (o["layers"][0]["ios"].clone(), o["layers"][0]["lower_ios"].clone()),
            (n.into(), n.into())
        );
        assert_eq!(o["layers"][0]["phases"]["lower"]["count"], n);
        assert_eq!(op(device(&w, "ram2"), name)["requests"], n);
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

/// Lines of `lines` on `device` by op, and a check that each names exactly one lower device.
fn linked_uppers<'a>(lines: &'a [Value], device: &str, lower: &str) -> Vec<&'a Value> {
    let uppers: Vec<&Value> = lines.iter().filter(|l| l["device"] == device).collect();
    for u in &uppers {
        let layers = u["layers"].as_array().unwrap_or_else(|| panic!("{device}: an IO not linked: {u}"));
        assert_eq!(layers.len(), 1, "{u}");
        assert_eq!(layers[0]["lower"], lower, "{u}");
        assert!(layers[0]["ios"].as_u64().unwrap() >= 1, "{u}");
        assert_layers_add_up(u);
    }
    uppers
}

#[test]
fn dm_crypt_reads_and_writes_from_its_threads_are_each_linked() {
    if !ran("dm_deferred") {
        return;
    }
    let crypt = dm_kernel_name("crypt0");
    let lines = json_lines("dm_deferred_snoop");
    let uppers = linked_uppers(&lines, &crypt, "ram3");
    let want = BTreeMap::from([("read".to_string(), 100), ("write".to_string(), 200)]);
    assert_eq!(count_by(&uppers, |l| l["op"].as_str().unwrap().to_owned()), want, "{crypt} IOs");
    // Each 4 KiB IO is one crypt clone: a write is encrypted into a bio of its own, sent by
    // dmcrypt_write, and still names its upper bio.
    for u in &uppers {
        assert_eq!(u["layers"][0]["ios"], 1, "{u}");
    }
    let lowers: Vec<&Value> = lines.iter().filter(|l| l["device"] == "ram3").collect();
    assert_eq!(count_by(&lowers, |l| l["op"].as_str().unwrap().to_owned()), want, "ram3 IOs");
    assert!(lowers.iter().all(|l| l["parent"].is_string()), "every ram3 IO names its upper bio");
}

#[test]
fn dm_delay_puts_its_delay_in_the_layer_phase_not_below() {
    if !ran("dm_deferred") {
        return;
    }
    const DELAY_NS: u64 = 20_000_000;
    // dm-delay counts its delay in jiffies from the bio's arrival, and under emulation the jiffy
    // count can lag the clock, so a bio is held the delay less up to a jiffy or two (one jiffy
    // is 4 ms at CONFIG_HZ=250, every tested Debian kernel's): every read is held at least
    // half the delay, the median read the delay less one jiffy, and ram4's own time holds none.
    const JIFFY_NS: u64 = 4_000_000;
    let delay = dm_kernel_name("delay0");
    let lines = json_lines("dm_deferred_snoop");
    let uppers = linked_uppers(&lines, &delay, "ram4");
    assert_eq!(uppers.len(), 50, "{delay} reads");
    let (mut layer, mut lower): (Vec<u64>, Vec<u64>) = (Vec::new(), Vec::new());
    for u in &uppers {
        let l = &u["layers"][0];
        layer.push(l["layer_ns"].as_u64().unwrap());
        lower.push(l["lower_ns"].as_u64().unwrap());
        assert!(layer[layer.len() - 1] >= DELAY_NS / 2, "the delay before the lower IO: {u}");
    }
    layer.sort_unstable();
    lower.sort_unstable();
    let (layer, lower) = (layer[layer.len() / 2], lower[lower.len() / 2]);
    assert!(layer >= DELAY_NS - JIFFY_NS, "dm-delay's 20 ms in its layer phase: median {layer} ns");
    assert!(lower < DELAY_NS / 4, "ram4's own time holds no delay: median {lower} ns");
}

#[test]
fn dm_thin_writes_are_linked_through_the_pool_even_when_they_provision_a_block() {
    if !ran("dm_deferred") {
        return;
    }
    let (thin, pool) = (dm_kernel_name("thin0"), dm_kernel_name("pool"));
    let lines = json_lines("dm_deferred_snoop");
    let uppers = linked_uppers(&lines, &thin, &pool);
    assert_eq!(uppers.len(), 150, "{thin} writes");
    // Three levels: each thin write reaches the pool as dm's clone, which the pool sends to
    // its data device. The pool's own IO (zeroing new blocks, metadata) names no thin bio.
    let pool_ios: Vec<&Value> = lines.iter().filter(|l| l["device"] == pool).collect();
    let from_thin: Vec<&Value> = pool_ios.iter().copied().filter(|l| l["parent"].is_string()).collect();
    assert_eq!(from_thin.len(), 150, "every thin write's clone on {pool}");
    for p in &from_thin {
        let layers =
            p["layers"].as_array().unwrap_or_else(|| panic!("{pool}: a clone not linked below: {p}"));
        assert!(layers.iter().any(|l| l["lower"] == "ram6"), "{p}");
        assert_layers_add_up(p);
    }
    // The pool's own IO names no thin IO, and is counted as such, never folded in silently:
    // its zeroing of new blocks on the pool device, and every write to its metadata device.
    let own = (pool_ios.len() - from_thin.len()) as u64;
    let r = report("dm_deferred_report_json");
    assert!(own > 0, "provisioning writes zero new blocks through the pool");
    assert_eq!(op(device(&r, &pool), "write")["unlinked"], own, "{pool}'s own IO");
    let meta = op(device(&r, "ram5"), "write");
    assert_eq!(meta["unlinked"], meta["requests"], "the metadata writes serve no upper IO: {meta}");
    for (dev, o) in [("ram6", "write"), ("ram3", "write"), ("ram3", "read"), ("ram4", "read")] {
        assert!(op(device(&r, dev), o)["unlinked"].is_null(), "every {dev} {o} names its upper IO");
    }
    eprintln!("{pool}: {} IOs from {thin}, {own} of its own (provisioning)", from_thin.len());
}

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

#[test]
fn null_blk_queue_depths_match_the_workload() {
    if !ran("null_blk") {
        return;
    }
    // 96 reads in rounds of QD (iogen batch): every depth 1..=QD is seen 96/QD times.
    let r = report("null_blk_qd_report_json");
    for (i, qd) in [1u64, 2, 4, 8, 16, 32].iter().enumerate() {
        let d = device(&r, &format!("nullb{i}"));
        let o = op(d, "read");
        assert_eq!(o["requests"], 96, "nullb{i}");
        let rows = o["by_queue_depth"].as_array().unwrap();
        let seen: BTreeMap<u64, (u64, u64)> = rows
            .iter()
            .map(|q| {
                let count = |s: &str| q["stages"][s]["count"].as_u64().unwrap();
                (q["queue_depth"].as_u64().unwrap(), (count("q2d"), count("d2c")))
            })
            .collect();
        let want: BTreeMap<u64, (u64, u64)> = (1..=*qd).map(|depth| (depth, (96 / qd, 96 / qd))).collect();
        assert_eq!(seen, want, "nullb{i} at queue depth {qd}: (Q2D, D2C) counts per depth at issue");
    }
}

/// The dm-1 (upper) and nullb6 (clone) records of a multipath snoop.
fn multipath_records(name: &str) -> (Vec<Value>, Vec<Value>) {
    let lines = json_lines(name);
    let (uppers, rest): (Vec<Value>, Vec<Value>) = lines.into_iter().partition(|l| l["device"] == "dm-1");
    let lowers: Vec<Value> = rest.into_iter().filter(|l| l["device"] == "nullb6").collect();
    (uppers, lowers)
}

/// Each of 100 reads and 50 writes on dm-1 linked to its own clone request on nullb6.
/// `kprobes`: the kprobe on `dm_mq_queue_rq` was attached, and timed each dispatch.
fn assert_each_request_linked_to_its_clone(snoop: &str, kprobes: bool) {
    let (uppers, lowers) = multipath_records(snoop);
    let by_op = |v: &[Value]| count_by(&v.iter().collect::<Vec<_>>(), |l| l["op"].as_str().unwrap().into());
    let want = BTreeMap::from([("read".to_string(), 100), ("write".to_string(), 50)]);
    assert_eq!(by_op(&uppers), want, "dm-1 requests");
    assert_eq!(by_op(&lowers), want, "nullb6 clone requests");
    for u in &uppers {
        assert_eq!(u["kind"], "request", "multipath is request-based: {u}");
        let layers = u["layers"].as_array().unwrap_or_else(|| panic!("no layers: {u}"));
        assert_eq!(layers.len(), 1, "{u}");
        assert_eq!(layers[0]["lower"], "nullb6");
        assert_eq!(layers[0]["ios"], 1, "one clone per request: {u}");
        assert_layers_add_up(u);
        let submit_ns = u["submit_ns"].as_u64().unwrap_or(0);
        assert_eq!(submit_ns > 0, kprobes, "dm_mq_queue_rq timed only by its kprobe: {u}");
    }
    assert!(lowers.iter().all(|l| l["parent"].is_string()), "every clone request came from dm-1");
}

#[test]
fn request_based_dm_links_each_request_to_its_clone() {
    if !ran("dm_multipath") {
        return;
    }
    assert_each_request_linked_to_its_clone("dm_multipath_snoop", true);
    let r = report("dm_multipath_report_json");
    for (reason, n) in r["lost"].as_object().unwrap() {
        assert_eq!(n, 0, "lost {reason} at queue depth 1 (dm's end of a request is no lost event)");
    }
    for (dev, n) in [("dm-1", 100), ("nullb6", 100)] {
        assert_eq!(op(device(&r, dev), "read")["requests"], n, "{dev} reads in report");
    }
}

#[test]
fn request_based_dm_links_each_clone_from_dms_structs_without_kprobes() {
    if !ran("dm_multipath") {
        return;
    }
    assert_each_request_linked_to_its_clone("dm_multipath_btf_snoop", false);
}

/// At depth 8 a clone's completion (hard interrupt) can arrive while the same tracer's completion
/// program handles dm's end of another request (soft interrupt); the kernel skips that run. Each
/// tracer's programs are skipped on their own, so this reads one tracer's report throughout.
#[test]
fn request_based_dm_losses_at_depth_are_counted() {
    if !ran("dm_multipath") {
        return;
    }
    let r = report("dm_multipath_qd8_report_json");
    let upper = op(device(&r, "dm-1"), "read");
    assert_eq!(upper["requests"], 400, "dm-1 requests: dm ends each in a soft interrupt");
    let clones = op(device(&r, "nullb6"), "read")["requests"].as_u64().unwrap();
    let linked = upper["layers"].as_array().and_then(|l| l.first()).map_or(0, |l| l["ios"].as_u64().unwrap());
    assert_eq!(linked, clones, "every recorded clone is linked to its own dm-1 request: {upper}");
    let recursion = r["lost"]["recursion"].as_u64().unwrap();
    assert!(
        recursion >= 400 - clones,
        "{} clones unrecorded but only {recursion} skipped program runs counted: {}",
        400 - clones,
        r["lost"]
    );
    for reason in ["ringbuf_full", "request_map_full", "complete_without_start", "link_map_full"] {
        assert_eq!(r["lost"][reason], 0, "{reason}: {}", r["lost"]);
    }
    let (uppers, lowers) = multipath_records("dm_multipath_qd8_snoop");
    assert_eq!(uppers.len(), 400, "dm-1 requests in snoop");
    for u in uppers.iter().filter(|u| !u["layers"].is_null()) {
        assert_eq!(u["layers"][0]["ios"], 1, "a clone is never folded into another request: {u}");
        assert_layers_add_up(u);
    }
    let unlinked = uppers.iter().filter(|u| u["layers"].is_null()).count();
    assert_eq!(lowers.len() + unlinked, 400, "each dm-1 request without its clone is a clone not recorded");
}

#[test]
fn null_blk_snoop_stages_are_ordered_on_the_second_kernel() {
    if !ran("null_blk") {
        return;
    }
    let lines = json_lines("null_blk_snoop");
    assert_eq!(lines.len(), 300, "one line per IO");
    for l in &lines {
        assert_eq!(l["kind"], "request");
        let e = &l["events_ns"];
        let order: Vec<u64> = ["q", "g", "i", "d", "c"].iter().filter_map(|k| e[*k].as_u64()).collect();
        assert!(order.windows(2).all(|w| w[0] <= w[1]), "{l}");
        assert!(l["stages_ns"]["d2c"].as_u64().unwrap() <= l["stages_ns"]["q2c"].as_u64().unwrap(), "{l}");
    }
}

#[test]
fn host_kernel_tests_pass_on_the_second_kernel() {
    if !ran("host_kernel") {
        return;
    }
    let out = section("host_kernel");
    assert!(out.contains("host tests exit status: 0"), "host-kernel tests failed in the VM:\n{out}");
    let result =
        out.lines().find(|l| l.starts_with("test result:")).unwrap_or_else(|| panic!("no result:\n{out}"));
    // Every test of host_kernel.rs ran and passed there (the fio one passes by skipping).
    let tests = include_str!("host_kernel.rs").matches("#[test]").count();
    assert!(result.starts_with(&format!("test result: ok. {tests} passed; 0 failed")), "{result}");
    assert!(
        out.contains("SKIPPED fio_and_tracerd_agree_io_for_io"),
        "only the fio test may skip, loudly:\n{out}"
    );
}

#[test]
fn cgroup_tests_pass_on_cgroup_v2_with_writeback() {
    if !ran("cgroups") {
        return;
    }
    let out = section("cgroups");
    assert!(out.contains("cgroup tests exit status: 0"), "cgroup tests failed in the VM:\n{out}");
    let tests = include_str!("cgroups.rs").matches("#[test]").count();
    let result =
        out.lines().find(|l| l.starts_with("test result:")).unwrap_or_else(|| panic!("no result:\n{out}"));
    assert!(result.starts_with(&format!("test result: ok. {tests} passed; 0 failed")), "{result}");
    // The guest runs v2 with io and memory: the writeback test must have met the dirtying
    // cgroup, not the root (which is what a v1 blkio host gives).
    assert!(out.contains("cgroup writeback: on (v2 io+memory)"), "{out}");
    assert!(
        out.contains("SKIPPED top_shows_a_row_per_cgroup_on_c"),
        "only the tmux test may skip, loudly:\n{out}"
    );
}

/// The doctor's load test in this kernel: the layout paths and hook variants it must get
/// (tests/src/kernels.rs), every tracepoint and kprobe attached.
#[test]
fn doctor_chooses_what_this_kernel_must_get() {
    if !ran("doctor") {
        return;
    }
    let release = release();
    let out = section("doctor_json");
    assert!(console().contains("tracerd doctor exit status: 0"), "doctor failed on {release}:\n{out}");
    let checks: Vec<Value> =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("doctor --json is not JSON ({e}):\n{out}"));
    let log = tracerd_tests::kernels::assert_doctor_chose(&release, &checks).unwrap_or_else(|| {
        panic!("kernel {release} is not in tests/src/kernels.rs: add what tracerd must choose there")
    });
    let load = checks.iter().find(|c| c["name"] == "load").expect("load check");
    let tracepoints = tracerd::kernel::hooks::HOOKS.len();
    // The stacked devices' kprobes, and blk-throttle's (H).
    let kprobes = tracerd::kernel::hooks::KPROBES.len() + 1;
    let want = format!(
        "loaded and attached {tracepoints} of {tracepoints} tracepoints (tp_btf {tracepoints}, raw_tp 0) \
         and {kprobes} of {kprobes} kprobes"
    );
    assert!(load["detail"].as_str().unwrap().contains(&want), "{release}: {load}");
    // Every kernel of the VM has blk-throttle's check as a function, and kprobes.
    let throttle = checks.iter().find(|c| c["name"] == "kprobe:__blk_throtl_bio").expect("H's check");
    assert_eq!(throttle["status"], "ok", "{release}: {throttle}");
    assert!(throttle["detail"].as_str().unwrap().starts_with("attached (kprobe)"), "{release}: {throttle}");
    // And the functions where the rq-qos policies wait, so Q2G can be split (config rq_qos).
    let rq_qos = checks.iter().find(|c| c["name"] == "rq_qos").expect("the rq_qos check");
    assert_eq!(rq_qos["status"], "ok", "{release}: {rq_qos}");
    assert!(
        rq_qos["detail"].as_str().unwrap().starts_with("rq_qos_wait and ioc_rqos_throttle in BTF"),
        "{release}: {rq_qos}"
    );
    // The stacked drivers' structs, from their modules' BTF (loaded by the prologue).
    for module in ["dm_mod", "dm_mod/request", "dm_crypt", "md_mod", "raid1", "raid10", "raid456"] {
        let c = checks.iter().find(|c| c["name"] == format!("module_btf:{module}")).expect(module);
        assert_eq!(c["status"], "ok", "{release}: {c}");
        assert!(c["detail"].as_str().unwrap().starts_with("links "), "{release}: {c}");
        eprintln!("  module_btf:{module}: {}", c["detail"].as_str().unwrap());
    }
    eprintln!("{}", log.join("\n"));
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

fn requests(report: &Value, device: &str, o: &str) -> u64 {
    report["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"] == device)
        .and_then(|d| d["ops"].as_array().unwrap().iter().find(|x| x["op"] == o))
        .map_or(0, |x| x["requests"].as_u64().unwrap())
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
fn nvme_controller_resets_under_io_count_each_head_bio_once_and_link_every_path_request() {
    if !ran("nvme_failover") {
        return;
    }
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
    assert_eq!((heads, served), (3000, 3000), "each head bio counted once, served once");
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

/// Walks a snoop of an NVMe head over `paths`: each head record follows every path request its
/// bio took (those naming its id as parent since its last record: bios are reused once
/// complete); exactly one of them served it, the others failed over, and all are lower IOs of
/// it. Returns (head bios, path requests that served one, path requests that failed over).
fn assert_each_head_bio_served_once(lines: &[Value], head: &str, paths: &[&str]) -> (u64, u64, u64) {
    let mut waiting: BTreeMap<&str, Vec<&Value>> = BTreeMap::new();
    let (mut heads, mut served, mut failed_over) = (0, 0, 0);
    for l in lines {
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
            assert_eq!((&l["op"], &l["sector"]), (&serving[0]["op"], &serving[0]["sector"]), "{l}");
            let ios: u64 = l["layers"].as_array().unwrap().iter().map(|x| x["ios"].as_u64().unwrap()).sum();
            assert_eq!(ios, took.len() as u64, "every path request it took is a lower IO of it: {l}");
            assert_layers_add_up(l);
        }
    }
    assert!(waiting.values().all(Vec::is_empty), "path requests with no head bio: {waiting:?}");
    (heads, served, failed_over)
}

#[test]
fn nvme_ana_failover_under_io_counts_each_head_bio_once_and_links_the_failed_over_request() {
    if !ran("nvme_ana") {
        return;
    }
    // NVMe/TCP on loopback, 2000 reads at qd 16: port 1 goes away with requests in flight and
    // comes back, then its ANA group flips to inaccessible and back four times. The requests
    // on the lost connection, and a command sent through the inaccessible port, fail, and NVMe
    // sends their bios down the other path: each failed request is flagged failed over and is
    // a lower IO of its bio beside the one that served it.
    let setup = section("nvme_ana_setup");
    let head =
        setup.split_whitespace().find_map(|w| w.strip_prefix("head=")).unwrap_or_else(|| panic!("{setup}"));
    let paths: Vec<&str> = setup.split("paths=").nth(1).unwrap().split_whitespace().collect();
    assert_eq!(paths.len(), 2, "{setup}");
    let (heads, served, failed_over) =
        assert_each_head_bio_served_once(&json_lines("nvme_ana_snoop"), head, &paths);
    assert_eq!((heads, served), (2000, 2000), "each head bio counted once, served once");
    assert!(failed_over >= 1, "no request failed over: a lost connection and four ANA transitions under IO");
    let r = report("nvme_ana_report");
    assert_counts_match_diskstats(&r, "nvme_ana", &paths);
    assert_eq!(op(device(&r, head), "read")["requests"], 2000);
    // Where the head's iostats is on (6.12), the kernel counts a bio again each time NVMe
    // sends it down another path; tracerd counts it once.
    let (head_reads, _) = diskstats_delta("nvme_ana")[head];
    if head_reads != 0 {
        assert_eq!(head_reads, 2000 + failed_over, "{head} in /proc/diskstats");
    }
    eprintln!("{}: 2000 head bios, {failed_over} path requests failed over", release());
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
