//! The causes scenario: the causes tests (tests/tests/causes.rs), run in the guest: the wait
//! hooks on this kernel's scheduler and interrupt tracepoints and its tag wait path.

use serde_json::Value;

use crate::{json_lines, ran, release, section};

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

/// Whether md's thread queued a superblock write on a member while `wait` kept its task off the
/// CPU (between its switch and its next run).
fn superblock_queued_within(wait: &Value, records: &[Value]) -> bool {
    let (Some(slept), Some(ran)) = (wait["slept_ns"].as_u64(), wait["ran_ns"].as_u64()) else {
        return false;
    };
    records.iter().any(|r| {
        (r["device"] == "ram27" || r["device"] == "ram28")
            && r["unlinked"] == "superblock"
            && r["comm"] == "md5_raid1"
            && r["events_ns"]["q"].as_u64().is_some_and(|q| (slept..=ran).contains(&q))
    })
}

#[test]
fn spaced_md_writes_wait_for_the_superblock_writes_or_the_bitmap_and_the_control_not_for_a_superblock() {
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
    // The writes above the window's p90 are the slow ones the cause must explain: each waited
    // in md_write_start (asleep until a superblock write woke it, or preempted there), or in the
    // plug callback for the bitmap kworker (6.12), or was preempted while md's thread queued the
    // superblock writes (the flag was clear when it ran again: no sleep; on an RT kernel the
    // preemption may come before md_submit_bio is entered).
    let slow = &writes[..writes.len() / 10];
    for w in slow {
        let waits = w["waits"].as_array().map(Vec::as_slice).unwrap_or_default();
        let named = waits.iter().any(|x| {
            x["function"] == "md_write_start" || x["cause"] == "md_superblock" || x["cause"] == "md_bitmap"
        });
        let preempted_for_superblock =
            waits.iter().any(|x| x["waker"]["kind"] == "preempted" && superblock_queued_within(x, &safe));
        assert!(
            named || preempted_for_superblock,
            "a slow write waited neither in md_write_start nor for md's superblock writes or bitmap: {w}"
        );
    }
    // Every sleep in md_write_start (a wakeup ended it, not a preemption) was ended by a
    // superblock write's completion or by md's thread, which wakes the waiters once the writes
    // are done. A write preempted there while md's thread wrote the superblocks never sleeps
    // (guide: not covered); how many are depends on the scheduler (9 of 20 on a loaded 6.12
    // run), so the count only has to show that sleeps were there to check.
    let mut named = 0;
    for w in &writes {
        let sleeps: Vec<&Value> = w["waits"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|x| x["function"] == "md_write_start" && x["waker"]["kind"] != "preempted")
            .collect();
        let superblock = superblock_waits(w, &safe).len();
        let by_md_thread = sleeps
            .iter()
            .filter(|x| x["waker"]["kind"] == "task" && x["waker"]["comm"] == "md5_raid1")
            .count();
        assert_eq!(
            superblock + by_md_thread,
            sleeps.len(),
            "a sleep in md_write_start ended by neither a superblock write nor md's thread: {w}"
        );
        named += (superblock > 0) as usize;
    }
    assert!(
        named >= 5,
        "only {named} of 20 spaced writes slept for md's superblock writes: nothing was tested"
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

/// The member writes of md5's `write` in `records`: linked to it (its id as `parent`) and queued
/// within its life (ids are addresses, reused from one write to the next).
fn member_writes<'a>(write: &Value, records: &'a [Value]) -> Vec<&'a Value> {
    let q = |r: &Value, e: &str| r["events_ns"][e].as_u64().unwrap_or_else(|| panic!("no {e} in {r}"));
    records
        .iter()
        .filter(|r| (r["device"] == "ram27" || r["device"] == "ram28") && r["parent"] == write["id"])
        .filter(|r| (q(write, "q")..=q(write, "c")).contains(&q(r, "q")))
        .collect()
}

/// md5's writes in a section and, for each, how many of its member writes md's thread queued.
/// Each member write queued by another task than the one that queued the md write was handed
/// to that thread: the write has exactly one hand-off wait ending at that member's Q and naming
/// the thread; a write whose members its submitter queued itself has none.
fn hand_offs_by_write(name: &str) -> Vec<(u64, usize)> {
    let records = json_lines(name);
    md5_writes(&records)
        .into_iter()
        .map(|w| {
            let members = member_writes(w, &records);
            assert_eq!(members.len(), 2, "{name}: a write to md5 not sent to both members: {w}");
            let hand_offs: Vec<&Value> =
                w["waits"].as_array().into_iter().flatten().filter(|x| x["phase"] == "handoff").collect();
            let by_thread: Vec<&&Value> = members.iter().filter(|m| m["pid"] != w["pid"]).collect();
            for m in &by_thread {
                assert_eq!(m["comm"], "md5_raid1", "{name}: a member write queued by a third task: {m}");
                let matching = hand_offs
                    .iter()
                    .filter(|h| {
                        h["cause"] == "layer_thread"
                            && h["ran_ns"] == m["events_ns"]["q"]
                            && h["waker"]["kind"] == "task"
                            && h["waker"]["tid"] == m["pid"]
                            && h["waker"]["comm"] == "md5_raid1"
                            && h["tid"] == w["pid"]
                            && h["slept_ns"].as_u64() >= w["events_ns"]["q"].as_u64()
                            && h["slept_ns"].as_u64() < h["ran_ns"].as_u64()
                    })
                    .count();
                assert_eq!(matching, 1, "{name}: the hand-off of member write {m} is not named once in {w}");
            }
            assert_eq!(hand_offs.len(), by_thread.len(), "{name}: a hand-off no member write shows: {w}");
            (w["sector"].as_u64().unwrap(), by_thread.len())
        })
        .collect()
}

#[test]
fn member_writes_md_thread_sends_are_hand_offs_naming_the_thread_and_none_else() {
    if !ran("causes") {
        return;
    }
    let release = release();
    // One write at a time without a plug of its own: 6.1 (as packaged) and 6.12 plug every
    // bio-based submission in __submit_bio, so raid1 sends the member writes from the
    // submitter's plug; none is handed off, and none may be named so.
    for name in ["causes_md_safe_mode", "causes_md_control"] {
        let handed: usize = hand_offs_by_write(name).iter().map(|(_, n)| n).sum();
        println!("{release} {name}: {handed} of 40 member writes handed to md5_raid1");
    }
    // Four writes in one plug, the third asleep in a suspended range: the member writes of the
    // first two (sectors 0 and 8) were on the plug when it slept, and md's thread sent them.
    let mut writes = hand_offs_by_write("causes_md_handoff");
    writes.sort_unstable();
    assert_eq!(writes, [(0, 2), (8, 2), (16, 0), (24, 0)], "{release}: (sector, member writes handed off)");

    // What the thread did inside each hand-off: its waits, all inside the hand-off and its own.
    // The submitter woke it as it slept with the member writes on its plug: that wakeup is the
    // first of them (runnable until it ran, so `cpu`), and it names the submitter.
    let records = json_lines("causes_md_handoff");
    let mut woken = 0;
    for w in md5_writes(&records) {
        for h in w["waits"].as_array().into_iter().flatten().filter(|x| x["phase"] == "handoff") {
            let thread = h["thread"].as_array().map(Vec::as_slice).unwrap_or_default();
            for t in thread {
                assert_eq!(t["phase"], "thread", "{t}");
                assert_eq!(t["tid"], h["waker"]["tid"], "a wait of another task than the thread's: {h}");
                let inside = t["slept_ns"].as_u64() >= h["slept_ns"].as_u64()
                    && t["ran_ns"].as_u64() <= h["ran_ns"].as_u64();
                assert!(inside, "a thread wait outside its hand-off: {h}");
            }
            let first = thread.first();
            if first.is_some_and(|t| t["cause"] == "cpu" && t["waker"]["tid"] == w["pid"]) {
                woken += 1;
            }
        }
    }
    println!("{release}: {woken} of 4 hand-offs begin with the submitter's wakeup of md5_raid1");
    assert!(woken >= 2, "{release}: no hand-off shows the submitter waking md's thread");
}

#[test]
fn md_bitmap_waits_name_the_task_that_wrote_the_bitmap_and_follow_it() {
    if !ran("causes") {
        return;
    }
    let release = release();
    for name in ["causes_md_safe_mode", "causes_md_control"] {
        let records = json_lines(name);
        let writes = md5_writes(&records);
        let mut bitmap = 0;
        let mut followed = 0;
        for w in &writes {
            let waits = w["waits"].as_array().map(Vec::as_slice).unwrap_or_default();
            let bitmap_waits: Vec<&Value> = waits.iter().filter(|x| x["cause"] == "md_bitmap").collect();
            bitmap += !bitmap_waits.is_empty() as usize;
            for x in bitmap_waits {
                // The submitter, after md_submit_bio returned, in raid1's plug callback: md's
                // bitmap is written before the member writes are sent.
                assert_eq!(x["phase"], "submit", "{name}: {x}");
                let waker = &x["waker"];
                let comm = waker["comm"].as_str().unwrap_or_default();
                assert!(
                    waker["kind"] == "io"
                        || (waker["kind"] == "task" && (comm.starts_with("kworker") || comm == "md5_raid1")),
                    "{name}: a bitmap wait ended by neither a bitmap write nor the task that wrote it: {x}"
                );
                // The task it waited for was woken by this submitter after its remap: its waits
                // inside this one come with it, the first being that wakeup.
                if waker["kind"] == "task" {
                    let thread = x["thread"].as_array().map(Vec::as_slice).unwrap_or_default();
                    for t in thread {
                        assert_eq!(t["tid"], waker["tid"], "{name}: {x}");
                    }
                    followed += thread.first().is_some_and(|t| t["waker"]["tid"] == w["pid"]) as usize;
                }
            }
        }
        println!(
            "{release} {name}: {bitmap} of 20 writes waited for md's bitmap, {followed} with the task that wrote it followed"
        );
        // 6.12 writes the bitmap from an md_bitmap kworker and makes each write's submitter
        // wait for it in raid1's plug callback, dirty pages or not (docs/guide/causes.md).
        if release.starts_with("6.12") {
            assert!(bitmap >= 15, "{release} {name}: only {bitmap} of 20 writes waited for the bitmap");
            assert!(followed * 2 >= bitmap, "{release} {name}: the kworker followed in only {followed}");
        }
    }
}

/// The `ahead` rows of nullb4 in a report section.
fn nullb4_ahead(name: &str) -> Vec<Value> {
    let text = section(name);
    let report: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: not JSON ({e}):\n{text}"));
    let devices = report["devices"].as_array().unwrap_or_else(|| panic!("{name}: no devices:\n{report}"));
    let d = devices.iter().find(|d| d["device"] == "nullb4").unwrap_or_else(|| panic!("{name}: no nullb4"));
    d["ahead"].as_array().cloned().unwrap_or_default()
}

fn quiet_row<'a>(rows: &'a [Value], stage: &str) -> &'a Value {
    rows.iter()
        .find(|r| r["group"] == "/quiet" && r["stage"] == stage)
        .unwrap_or_else(|| panic!("no {stage} row for /quiet: {rows:?}"))
}

#[test]
fn the_flood_dispatched_ahead_of_a_quiet_reader_behind_mq_deadline_is_named_by_its_cgroup() {
    if !ran("causes") {
        return;
    }
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"));
    // Alone, one read at a time: nothing is allocated or issued ahead of any of the 20.
    let alone = nullb4_ahead("causes_ahead_alone");
    for stage in ["Q2G", "I2D"] {
        let r = quiet_row(&alone, stage);
        assert_eq!((n(r, "ios"), n(r, "ahead")), (20, 0), "{r}");
    }
    // Beside the flood: each quiet read sits in mq-deadline while the flood's requests hold the
    // disk's 64 tags, and what is issued ahead of it is the flood's.
    assert!(
        section("causes_ahead_outlasted").contains("outlasted"),
        "the flood ended before the quiet reads"
    );
    let flood = nullb4_ahead("causes_ahead_flood");
    let i2d = quiet_row(&flood, "I2D");
    println!("quiet reads beside the flood, I2D: {i2d}");
    assert_eq!(n(i2d, "ios"), 20, "{i2d}");
    assert!(n(i2d, "waited") >= 15, "the quiet reads wait in the scheduler behind the flood: {i2d}");
    let by = |r: &Value, group: &str| {
        r["by"].as_array().unwrap().iter().find(|b| b["group"] == group).map_or(0, |b| n(b, "requests"))
    };
    assert!(by(i2d, "/flood") * 10 >= n(i2d, "ahead") * 9, "the flood's share of those issued ahead: {i2d}");
    assert!(n(i2d, "unrecorded") * 10 <= n(i2d, "ahead"), "{i2d}");
    let q2g = quiet_row(&flood, "Q2G");
    if n(q2g, "ahead") > 0 {
        assert!(
            by(q2g, "/flood") * 10 >= n(q2g, "ahead") * 9,
            "the flood's share of those allocated ahead: {q2g}"
        );
    }
}
