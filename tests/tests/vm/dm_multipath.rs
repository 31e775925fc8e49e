//! The dm_multipath scenario: request-based dm (multipath over null_blk): each request linked to
//! its clone, with the kprobes and without, and the losses at depth counted.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{assert_layers_add_up, count_by, device, json_lines, op, ran, report};

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
