//! The causes scenario: the causes tests (tests/tests/causes.rs), run in the guest: the wait
//! hooks on this kernel's scheduler and interrupt tracepoints and its tag wait path.

use serde_json::Value;

use crate::{json_lines, ran, section};

#[test]
fn causes_tests_pass_on_each_kernel() {
    if !ran("causes") {
        return;
    }
    let out = section("causes");
    assert!(out.contains("causes tests exit status: 0"), "causes tests failed in the VM:\n{out}");
    let tests = include_str!("../causes.rs").matches("#[test]").count();
    let result =
        out.lines().find(|l| l.starts_with("test result:")).unwrap_or_else(|| panic!("no result:\n{out}"));
    assert!(result.starts_with(&format!("test result: ok. {tests} passed; 0 failed")), "{result}");
}

/// md5's user writes in one section, by Q2C, slowest first.
fn md5_writes(records: &[Value]) -> Vec<&Value> {
    let mut writes: Vec<&Value> = records
        .iter()
        .filter(|r| r["device"] == "md5" && r["submitted_to"] == "md5" && r["op"] == "write")
        .collect();
    writes.sort_by_key(|r| std::cmp::Reverse(r["stages_ns"]["q2c"].as_u64().unwrap_or(0)));
    writes
}

/// The md_superblock waits of `write` whose waker is a superblock write on a member traced in the
/// same section, matched by member, id and completion time: the edge comes from the kernel's
/// wakeup, so the IO it names must be one that completed just then.
fn superblock_waits<'a>(write: &'a Value, records: &[Value]) -> Vec<&'a Value> {
    write["waits"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|w| w["cause"] == "md_superblock" && w["function"] == "md_write_start")
        .filter(|w| {
            let waker = &w["waker"];
            waker["kind"] == "io"
                && records.iter().any(|r| {
                    r["device"] == waker["device"]
                        && (r["device"] == "ram27" || r["device"] == "ram28")
                        && r["id"] == waker["id"]
                        && r["events_ns"]["c"] == waker["completed_ns"]
                        && r["unlinked"] == "superblock"
                })
        })
        .collect()
}

#[test]
fn spaced_md_writes_wait_in_md_write_start_for_the_superblock_writes_and_the_control_does_not() {
    if !ran("causes") {
        return;
    }
    let delay = section("causes_md_delay");
    assert!(
        delay.trim().parse::<f64>().is_ok_and(|d| d < 0.5),
        "safe_mode_delay not below the spacing: {delay}"
    );
    let safe = json_lines("causes_md_safe_mode");
    let writes = md5_writes(&safe);
    assert_eq!(writes.len(), 20, "20 writes were made to md5");
    // The writes above the window's p90 are the slow ones the cause must explain: each waited in
    // md_write_start, asleep until a superblock write woke it, or preempted there while md's
    // thread wrote the superblocks (then the flag was clear when it ran again: no sleep).
    let slow = &writes[..writes.len() / 10];
    for w in slow {
        let waits = w["waits"].as_array().map(Vec::as_slice).unwrap_or_default();
        assert!(
            waits.iter().any(|x| x["function"] == "md_write_start"),
            "a slow write never waited in md_write_start: {w}"
        );
    }
    let named = writes.iter().filter(|w| !superblock_waits(w, &safe).is_empty()).count();
    assert!(
        named * 10 >= writes.len() * 6,
        "only {named} of 20 spaced writes waited for md's superblock writes"
    );

    let control = json_lines("causes_md_control");
    let writes = md5_writes(&control);
    assert_eq!(writes.len(), 20, "20 writes were made to md5 in the control");
    for w in &writes {
        let waits = w["waits"].as_array().map(Vec::as_slice).unwrap_or_default();
        assert!(
            !waits.iter().any(|x| x["cause"] == "md_superblock"),
            "the control waited for a superblock: {w}"
        );
    }
}
