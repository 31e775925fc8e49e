//! The null_blk scenario: queue depths 1 to 32 as the workload made them, and the stage order of
//! a snoop.

use std::collections::BTreeMap;

use crate::{device, json_lines, op, ran, report};

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
