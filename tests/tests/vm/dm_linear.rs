//! The dm_linear scenario: dm-linear (lin0, dm-0) over brd with the kprobes: snoop, reports naming
//! lin0 by its dm name and its /dev/mapper node, the agent's exposition and its recorder.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{assert_layers_add_up, count_by, device, json_lines, op, ran, release, report, section};

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
