//! The dm_deferred scenario: dm targets that send the lower IO from another task (dm-crypt,
//! dm-delay, dm-thin): each upper IO linked from dm's own structs.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{assert_layers_add_up, count_by, device, dm_kernel_name, json_lines, op, ran, report};

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
    // And each is named by the function the kernel ends it in: the pool zeroes a new block
    // through kcopyd (dm-io) and writes its metadata through dm-bufio (dm-io where dm-bufio
    // could not allocate a bio).
    let kinds = |o: &Value| -> BTreeMap<String, u64> {
        serde_json::from_value(o["unlinked_kinds"].clone()).unwrap_or_default()
    };
    let pool_kinds = kinds(op(device(&r, &pool), "write"));
    assert_eq!(pool_kinds, BTreeMap::from([("dm_io".to_string(), own)]), "{pool}'s zeroing");
    let meta_kinds = kinds(meta);
    let named = |k: &str| meta_kinds.get(k).copied().unwrap_or(0);
    assert!(named("dm_bufio") > 0, "metadata through dm-bufio: {meta_kinds:?}");
    assert_eq!(
        named("dm_bufio") + named("dm_io"),
        meta["requests"].as_u64().unwrap(),
        "every metadata write named: {meta_kinds:?}"
    );
    for (dev, o) in [("ram6", "write"), ("ram3", "write"), ("ram3", "read"), ("ram4", "read")] {
        assert!(op(device(&r, dev), o)["unlinked"].is_null(), "every {dev} {o} names its upper IO");
    }
    eprintln!("{pool}: {} IOs from {thin}, {own} of its own (provisioning)", from_thin.len());
}
