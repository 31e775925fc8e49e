//! tracerd against the running (host) kernel: real programs, a real loop device, real IO with a
//! known count, size, op and queue depth; what was traced must equal what was done.

use std::collections::BTreeMap;

use serde_json::Value;
use tracerd::{model::capture::Capture, model::stage::Stage};
use tracerd_tests::{
    HANG, LoopDevice, Metrics, TempDir, Tracerd, Workload, eventually, missed_completions, missed_in_lost,
    missed_in_text, note_missed, require_root, tracerd_output,
};

const QD1_AND_QD16: [Workload; 4] = [
    Workload { write: true, count: 300, size: 4096, qd: 1 },
    Workload { write: false, count: 200, size: 65536, qd: 1 },
    Workload { write: true, count: 500, size: 8192, qd: 16 },
    Workload { write: false, count: 400, size: 4096, qd: 16 },
];

/// (requests, bytes) per op of a set of workloads.
fn expected(workloads: &[Workload]) -> BTreeMap<&'static str, (u64, u64)> {
    let mut m = BTreeMap::new();
    for w in workloads {
        let e = m.entry(w.op()).or_insert((0, 0));
        e.0 += w.count;
        e.1 += w.bytes();
    }
    m
}

fn requests(m: &Metrics, dev: &str, op: &str) -> u64 {
    m.get("tracerd_io_requests_total", &[("device", dev), ("op", op)]) as u64
}

fn stage_count(m: &Metrics, dev: &str, op: &str, stage: &str) -> u64 {
    m.get("tracerd_io_stage_seconds_count", &[("device", dev), ("op", op), ("stage", stage)]) as u64
}

#[test]
fn metrics_and_report_count_every_io_at_qd1_and_qd16() {
    require_root();
    let dev = LoopDevice::new(256);
    let agent = Tracerd::run(&["--device", &dev.name]);
    // Ended by SIGINT once the workload is done, never by a guessed window: on a slow machine
    // (a TCG guest on a loaded host) the IO can take minutes.
    let mut report =
        Tracerd::spawn(&["report", "--duration", "600", "--json", "--by", "qd", "--device", &dev.name]);
    for w in &QD1_AND_QD16 {
        w.run(&dev);
    }
    let want = expected(&QD1_AND_QD16);
    let issued: u64 = want.values().map(|(n, _)| n).sum();
    let traced = |m: &Metrics| want.keys().map(|op| requests(m, &dev.name, op)).sum::<u64>();
    let settled = eventually(|| {
        let m = agent.metrics();
        traced(&m) + missed_completions(&m) == issued
    });
    let m = agent.metrics();
    assert!(settled, "metrics never reached the issued counts (waited {HANG:?}): {want:?}\n{:?}", m.samples);
    let missed = missed_completions(&m);
    if missed > 0 {
        note_missed("metrics_and_report_count_every_io_at_qd1_and_qd16 (agent)", missed);
        assert!(report.stop(libc::SIGINT).success(), "report failed:\n{}", report.stderr_text());
        return;
    }
    for (op, (n, bytes)) in &want {
        assert_eq!(requests(&m, &dev.name, op), *n, "{op} requests");
        assert_eq!(
            m.get("tracerd_io_bytes_total", &[("device", &dev.name), ("op", op)]) as u64,
            *bytes,
            "{op} bytes"
        );
        assert_eq!(
            m.get("tracerd_io_merged_bios_total", &[("device", &dev.name), ("op", op)]),
            0.0,
            "{op}: iogen never merges"
        );
        // Every request was issued and completed, and every one was queued while traced.
        assert_eq!(stage_count(&m, &dev.name, op, "d2c"), *n, "{op} d2c count");
        assert_eq!(stage_count(&m, &dev.name, op, "q2c"), *n, "{op} q2c count");
        // The +Inf bucket is the count.
        let inf = m.get(
            "tracerd_io_stage_seconds_bucket",
            &[("device", &dev.name), ("op", op), ("stage", "d2c"), ("le", "+Inf")],
        );
        assert_eq!(inf as u64, *n);
        // Direct dispatch or insert: each request has exactly one of G2D and I2D.
        let g2d = stage_count(&m, &dev.name, op, "g2d");
        let i2d = stage_count(&m, &dev.name, op, "i2d");
        assert_eq!(g2d + i2d, *n, "{op}: g2d {g2d} + i2d {i2d}");
    }
    let lost = m.sum("tracerd_events_lost_total", &[]);
    assert_eq!(lost, 0.0, "no event may be lost at this rate");
    // Every tracepoint hook attaches (as tp_btf); each kprobe is attached or skipped with a reason.
    let tp_btf = m.sum("tracerd_hook_attached", &[("attach_type", "tp_btf")]);
    assert_eq!(
        tp_btf,
        tracerd::kernel::hooks::HOOKS.len() as f64,
        "every tracepoint hook attaches as tp_btf"
    );
    let kprobes =
        m.sum("tracerd_hook_attached", &[("attach_type", "kprobe")]) + m.sum("tracerd_hook_skipped", &[]);
    // The stacked devices' kprobes and blk-throttle's (H).
    let probes = tracerd::kernel::hooks::KPROBES.len() + 1;
    assert_eq!(kprobes, probes as f64, "each kprobe attached or skipped");

    // report --json, captured over the same IO, agrees with /metrics.
    assert!(report.stop(libc::SIGINT).success(), "report failed:\n{}", report.stderr_text());
    let json: Value = serde_json::from_str(&report.stdout_text()).expect("report --json is JSON");
    let missed = missed_in_lost(&json["lost"]);
    if missed > 0 {
        note_missed("metrics_and_report_count_every_io_at_qd1_and_qd16 (report)", missed);
        return;
    }
    let device = json["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"] == dev.name.as_str())
        .expect("device in report");
    for op in device["ops"].as_array().unwrap() {
        let name = op["op"].as_str().unwrap();
        let (n, bytes) = want[name];
        assert_eq!(op["requests"].as_u64().unwrap(), n, "report {name} requests");
        assert_eq!(op["bytes"].as_u64().unwrap(), bytes, "report {name} bytes");
        assert_eq!(op["requests"].as_u64().unwrap(), requests(&m, &dev.name, name));
        for stage in ["q2c", "d2c", "q2d"] {
            assert_eq!(
                op["stages"][stage]["count"].as_u64().unwrap(),
                stage_count(&m, &dev.name, name, stage),
                "{name} {stage}"
            );
        }
        // --by qd: per-depth counts add up to the whole.
        let by_qd: u64 = op["by_queue_depth"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| q["stages"]["d2c"]["count"].as_u64().unwrap())
            .sum();
        assert_eq!(by_qd, n, "{name} by-qd counts");
        let max_qd = op["by_queue_depth"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| q["queue_depth"].as_u64().unwrap())
            .max()
            .unwrap();
        assert!(max_qd <= 16, "{name}: queue depth {max_qd} above what iogen kept in flight");
    }
    assert_eq!(device["ops"].as_array().unwrap().len(), want.len());
    assert!(json["lost"].as_object().unwrap().values().all(|v| v == 0), "{}", json["lost"]);
}

#[test]
fn snoop_lines_have_ordered_stages_and_match_the_workload() {
    require_root();
    let dev = LoopDevice::new(128);
    let mut snoop = Tracerd::spawn(&["snoop", "--json", "--device", &dev.name]);
    let workloads = [
        Workload { write: true, count: 250, size: 4096, qd: 16 },
        Workload { write: false, count: 150, size: 16384, qd: 4 },
    ];
    for w in &workloads {
        w.run(&dev);
    }
    // Every IO completed, so its record is in the ring buffer; snoop drains it before exiting.
    assert!(snoop.stop(libc::SIGINT).success(), "snoop failed:\n{}", snoop.stderr_text());
    let mut seen: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for line in snoop.stdout_text().lines() {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert_eq!(v["device"], dev.name.as_str());
        assert_eq!(v["kind"], "request", "iogen never merges: {line}");
        let e = &v["events_ns"];
        let order: Vec<u64> = ["q", "g", "i", "d", "c"].iter().filter_map(|k| e[*k].as_u64()).collect();
        assert!(order.windows(2).all(|w| w[0] <= w[1]), "events out of order: {line}");
        assert!(
            e["d"].is_u64() && e["c"].is_u64() && e["q"].is_u64(),
            "Q, D and C fire for every IO: {line}"
        );
        let s = &v["stages_ns"];
        assert!(s["d2c"].as_u64().unwrap() <= s["q2c"].as_u64().unwrap(), "{line}");
        assert!(s["q2c"].as_u64().unwrap() == e["c"].as_u64().unwrap() - e["q"].as_u64().unwrap(), "{line}");
        assert!(s.get("g2i").is_none() || s.get("g2d").is_none(), "G2I and G2D exclude each other: {line}");
        assert!(v["queue_depth"].as_u64().unwrap() >= 1, "{line}");
        assert_eq!(v["comm"], "iogen", "{line}");
        let entry = seen.entry(v["op"].as_str().unwrap().to_owned()).or_default();
        entry.0 += 1;
        entry.1 += v["bytes"].as_u64().unwrap();
    }
    let want: BTreeMap<String, (u64, u64)> =
        expected(&workloads).into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    let missed = missed_in_text(&snoop.stderr_text());
    if missed > 0 {
        let (lines, issued) =
            (seen.values().map(|v| v.0).sum::<u64>(), want.values().map(|v| v.0).sum::<u64>());
        assert_eq!(lines + missed, issued, "snoop lines + missed completions");
        note_missed("snoop_lines_have_ordered_stages_and_match_the_workload", missed);
        return;
    }
    assert_eq!(seen, want, "snoop saw a different workload");
}

#[test]
fn partition_io_counts_towards_its_disk_unless_the_partition_is_named() {
    require_root();
    let (disk, parts) = LoopDevice::partitioned(128, 2, 32);
    let whole = Tracerd::run(&["--device", &disk.name]);
    let part = Tracerd::run(&["--device", &parts[0]]);
    Workload { write: true, count: 120, size: 4096, qd: 4 }.run_on(&format!("/dev/{}", parts[0]));
    Workload { write: false, count: 70, size: 8192, qd: 1 }.run_on(&format!("/dev/{}", parts[1]));
    Workload { write: false, count: 30, size: 4096, qd: 2 }.run(&disk);
    let settled = eventually(|| {
        let m = whole.metrics();
        requests(&m, &disk.name, "write") + requests(&m, &disk.name, "read") + missed_completions(&m) == 220
    });
    assert!(
        settled,
        "disk series never reached the issued counts (waited {HANG:?}): {:?}",
        whole.metrics().samples
    );
    let m = whole.metrics();
    let missed = missed_completions(&m) + missed_completions(&part.metrics());
    if missed > 0 {
        note_missed("partition_io_counts_towards_its_disk_unless_the_partition_is_named", missed);
        return;
    }
    assert_eq!(requests(&m, &disk.name, "write"), 120);
    assert_eq!(requests(&m, &disk.name, "read"), 100);
    assert_eq!(
        m.get("tracerd_io_bytes_total", &[("device", &disk.name), ("op", "read")]) as u64,
        70 * 8192 + 30 * 4096
    );
    assert_eq!(
        m.sum("tracerd_io_requests_total", &[("device", &parts[0])]),
        0.0,
        "no partition series unless named"
    );
    // The named partition: its own IO only.
    assert!(
        eventually(|| {
            let m = part.metrics();
            requests(&m, &parts[0], "write") + missed_completions(&m) == 120
        }),
        "partition series never reached 120 writes (waited {HANG:?}): {:?}",
        part.metrics().samples
    );
    let m = part.metrics();
    assert_eq!(m.get("tracerd_io_bytes_total", &[("device", &parts[0]), ("op", "write")]) as u64, 120 * 4096);
    assert_eq!(m.sum("tracerd_io_requests_total", &[("op", "read")]), 0.0, "reads went elsewhere");
    assert_eq!(m.sum("tracerd_io_requests_total", &[("device", &disk.name)]), 0.0);
}

/// IDs and names of loaded programs named like tracerd's (btf_*/raw_* hook variants, kp_*/kr_*
/// kprobes; the kernel keeps 15 characters of a name).
fn tracerd_programs() -> Vec<(u32, String)> {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .map(|p| (p.id(), p.name_as_str().unwrap_or_default().to_owned()))
        .filter(|(_, name)| ["btf_", "raw_", "kp_", "kr_"].iter().any(|pre| name.starts_with(pre)))
        .collect()
}

#[test]
fn sigterm_and_sigint_detach_every_program() {
    require_root();
    for signal in [libc::SIGTERM, libc::SIGINT] {
        let before: Vec<u32> = tracerd_programs().into_iter().map(|(id, _)| id).collect();
        let mut agent = Tracerd::run(&[]);
        let ours: Vec<(u32, String)> =
            tracerd_programs().into_iter().filter(|(id, _)| !before.contains(id)).collect();
        let tracepoints = ours.iter().filter(|(_, n)| n.starts_with("btf_") || n.starts_with("raw_")).count();
        assert_eq!(
            tracepoints,
            tracerd::kernel::hooks::HOOKS.len(),
            "one program per tracepoint hook: {ours:?}"
        );
        let status = agent.stop(signal);
        assert!(status.success(), "exit status {status} after signal {signal}:\n{}", agent.stderr_text());
        let left = || -> Vec<(u32, String)> {
            tracerd_programs().into_iter().filter(|(id, _)| ours.iter().any(|(o, _)| o == id)).collect()
        };
        // The kernel frees a program after an RCU grace period once its last fd closed: on a
        // loaded machine that can trail the process's exit by a moment.
        assert!(
            eventually(|| left().is_empty()),
            "programs {:?} still loaded {HANG:?} after signal {signal}",
            left()
        );
    }
}

#[test]
fn fio_and_tracerd_agree_io_for_io() {
    require_root();
    if std::env::var_os("TRACERD_TEST_NO_FIO").is_some() {
        // The VM run of these tests has no fio; everywhere else `cargo xtask test` installs it.
        eprintln!("SKIPPED fio_and_tracerd_agree_io_for_io: TRACERD_TEST_NO_FIO is set (no fio here)");
        return;
    }
    let dev = LoopDevice::new(256);
    let agent = Tracerd::run(&["--device", &dev.name]);
    let out = std::process::Command::new("fio")
        .args(["--name=agree", "--rw=randread", "--bs=4k", "--iodepth=32", "--ioengine=libaio", "--direct=1"])
        .args(["--number_ios=3000", "--norandommap", "--output-format=json"])
        .arg(format!("--filename={}", dev.path))
        .output()
        .expect("fio is installed by `cargo xtask test`");
    assert!(out.status.success(), "fio failed: {}", String::from_utf8_lossy(&out.stderr));
    let fio: Value = serde_json::from_slice(&out.stdout).expect("fio JSON");
    let fio_ios = fio["jobs"][0]["read"]["total_ios"].as_u64().unwrap();
    let fio_bytes = fio["jobs"][0]["read"]["io_bytes"].as_u64().unwrap();
    assert!(fio_ios >= 3000);
    // Random 4k reads can merge when two land side by side: requests + merged bios = fio's IOs.
    let merged =
        |m: &Metrics| m.get("tracerd_io_merged_bios_total", &[("device", &dev.name), ("op", "read")]) as u64;
    let seen = |m: &Metrics| requests(m, &dev.name, "read") + merged(m) + missed_completions(m);
    let settled = eventually(|| seen(&agent.metrics()) >= fio_ios);
    let m = agent.metrics();
    assert!(settled, "tracerd never saw fio's {fio_ios} reads (waited {HANG:?}): {:?}", m.samples);
    assert_eq!(seen(&m), fio_ios, "fio issued {fio_ios}");
    let missed = missed_completions(&m);
    if missed > 0 {
        note_missed("fio_and_tracerd_agree_io_for_io", missed);
        return;
    }
    assert_eq!(m.get("tracerd_io_bytes_total", &[("device", &dev.name), ("op", "read")]) as u64, fio_bytes);
}

/// `report --save FILE` while `w` runs on `dev`; ended by SIGINT once the IO is done.
fn save_capture(dev: &LoopDevice, file: &str, w: Workload) {
    let mut report = Tracerd::spawn(&["report", "--duration", "600", "--device", &dev.name, "--save", file]);
    w.run(dev);
    assert!(report.stop(libc::SIGINT).success(), "report --save failed:\n{}", report.stderr_text());
    assert!(report.stderr_text().contains("capture saved to"), "{}", report.stderr_text());
}

fn find<'a>(list: &'a Value, key: &str, value: &str) -> &'a Value {
    list.as_array()
        .unwrap()
        .iter()
        .find(|v| v[key] == value)
        .unwrap_or_else(|| panic!("no {value} in {list}"))
}

#[test]
fn diff_of_saved_captures_at_qd1_and_qd32_matches_the_captures() {
    require_root();
    const N: u64 = 5000;
    let dev = LoopDevice::new(128);
    let dir = TempDir::new();
    let (a, b) = (dir.file("qd1.json"), dir.file("qd32.json"));
    save_capture(&dev, &a, Workload { write: false, count: N, size: 4096, qd: 1 });
    save_capture(&dev, &b, Workload { write: false, count: N, size: 4096, qd: 32 });
    let missed: u64 = [&a, &b]
        .iter()
        .map(|f| missed_in_lost(&serde_json::json!(Capture::load(f.as_ref()).unwrap().lost)))
        .sum();
    if missed > 0 {
        note_missed("diff_of_saved_captures_at_qd1_and_qd32_matches_the_captures", missed);
        return;
    }

    let (status, out, err) = tracerd_output(&["diff", &a, &b, "--json"]);
    assert!(status.success(), "diff failed: {err}");
    let diff: Value = serde_json::from_str(&out).expect("diff --json is JSON");
    assert_eq!(diff["a"]["file"], a.as_str());
    assert_eq!(diff["kernels_differ"], false);
    let read = find(&find(&diff["devices"], "device", &dev.name)["ops"], "op", "read");
    assert_eq!((read["requests_a"].as_u64(), read["requests_b"].as_u64()), (Some(N), Some(N)));

    // Every number in the diff is the captures' own.
    let (ca, cb) = (Capture::load(a.as_ref()).unwrap(), Capture::load(b.as_ref()).unwrap());
    let read_of = |c: &Capture| {
        let d = c.devices.iter().find(|d| d.device == dev.name).expect("device in capture");
        d.ops.iter().find(|o| o.op == tracerd::model::op::Op::Read).expect("reads in capture").clone()
    };
    let (ra, rb) = (read_of(&ca), read_of(&cb));
    assert_eq!((ra.requests, rb.requests, ra.bytes), (N, N, N * 4096));
    let stages = read["stages"].as_array().unwrap();
    for s in stages {
        let stage: Stage = serde_json::from_value(s["stage"].clone()).unwrap();
        let (ha, hb) = (&ra.stages[&stage], &rb.stages[&stage]);
        assert_eq!((s["count_a"].as_u64(), s["count_b"].as_u64()), (Some(ha.count), Some(hb.count)));
        let (ha, hb) = (ha.histogram(), hb.histogram());
        for q in s["quantiles"].as_array().unwrap() {
            let quantile = q["quantile"].as_f64().unwrap();
            for (h, value, interval) in
                [(&ha, &q["a_s"], &q["a_interval_s"]), (&hb, &q["b_s"], &q["b_interval_s"])]
            {
                let v = value.as_f64().unwrap();
                assert_eq!(v, h.value_at_quantile(quantile) as f64 / 1e9, "{stage:?} {q}");
                assert!(interval[0].as_f64().unwrap() <= v && v <= interval[1].as_f64().unwrap(), "{q}");
            }
            // The flag follows the noise rule: judged with enough samples, set where the
            // intervals do not overlap.
            let (ia, ib) = (&q["a_interval_s"], &q["b_interval_s"]);
            let apart = ia[1].as_f64() < ib[0].as_f64() || ib[1].as_f64() < ia[0].as_f64();
            let judged = tracerd::view::diff::enough(ha.len(), quantile)
                && tracerd::view::diff::enough(hb.len(), quantile);
            let want = match (judged, apart) {
                (false, _) => "too_few_samples",
                (true, true) => "changed",
                (true, false) => "within_noise",
            };
            assert_eq!(q["verdict"], want, "{stage:?} {q}");
        }
    }
    // Compared are exactly the stages both captures have; the others are listed.
    let compared: Vec<Stage> =
        stages.iter().map(|s| serde_json::from_value(s["stage"].clone()).unwrap()).collect();
    let both: Vec<Stage> = ra.stages.keys().filter(|s| rb.stages.contains_key(s)).copied().collect();
    assert_eq!(compared, both);
    for stage in [Stage::Q2c, Stage::D2c, Stage::Q2d] {
        assert!(both.contains(&stage), "{stage:?} in both captures");
        assert_eq!((ra.stages[&stage].count, rb.stages[&stage].count), (N, N), "{stage:?}");
    }
    assert!(ca.lost.values().chain(cb.lost.values()).all(|n| *n == 0), "{:?} {:?}", ca.lost, cb.lost);
    // The same capture twice: nothing changed.
    let (status, out, err) = tracerd_output(&["diff", &a, &a, "--json"]);
    assert!(status.success(), "{err}");
    let same: Value = serde_json::from_str(&out).unwrap();
    for s in
        find(&find(&same["devices"], "device", &dev.name)["ops"], "op", "read")["stages"].as_array().unwrap()
    {
        assert!(s["quantiles"].as_array().unwrap().iter().all(|q| q["verdict"] != "changed"), "{s}");
    }

    let (status, text, err) = tracerd_output(&["diff", &a, &b]);
    assert!(status.success(), "{err}");
    assert!(text.contains(&format!("{} read: {N} requests in A, {N} in B (+0.0%)", dev.name)), "{text}");
    eprintln!("tracerd diff {a} {b}:\n{text}");

    // Garbage, unrelated JSON and a missing file: non-zero, the file named, what is wrong said.
    let garbage = dir.file("garbage.json");
    std::fs::write(&garbage, b"\x7fELF\x02\x01 not a capture {[").unwrap();
    let (status, _, err) = tracerd_output(&["diff", &garbage, &b]);
    assert!(!status.success());
    assert!(err.contains(&garbage) && err.contains("truncated or not JSON"), "{err}");
    let unrelated = dir.file("unrelated.json");
    std::fs::write(&unrelated, r#"{"name": "fio", "jobs": []}"#).unwrap();
    let (status, _, err) = tracerd_output(&["diff", &a, &unrelated]);
    assert!(!status.success());
    assert!(err.contains(&unrelated) && err.contains("not a tracerd capture"), "{err}");
    let (status, _, err) = tracerd_output(&["diff", &a, &dir.file("missing.json")]);
    assert!(
        !status.success() && err.contains("cannot read capture") && err.contains("missing.json"),
        "{err}"
    );
}

/// The rows (from, to, count) of the `--hist` histogram under `<dev> <op>:` in report's text.
fn hist_rows(text: &str, dev: &str, op: &str) -> Vec<(String, String, u64)> {
    let section = text
        .split("\n\n")
        .find(|s| s.starts_with(&format!("{dev} {op}:")))
        .unwrap_or_else(|| panic!("no {dev} {op} in\n{text}"));
    let (_, hist) =
        section.split_once(" histogram (").unwrap_or_else(|| panic!("no histogram in\n{section}"));
    hist.lines()
        .filter_map(|l| {
            let t: Vec<&str> = l.split_whitespace().collect();
            (t.len() > 4 && t[1] == "->").then(|| (t[0].into(), t[2].into(), t[3].parse().expect(l)))
        })
        .collect()
}

#[test]
fn report_hist_counts_every_read_and_colours_only_when_asked() {
    require_root();
    const N: u64 = 2000;
    let dev = LoopDevice::new(64);
    let report = |extra: &[&str]| {
        let mut args = vec!["report", "--duration", "600", "--device", &dev.name];
        args.extend_from_slice(extra);
        Tracerd::spawn(&args)
    };
    // Three reports over the same IO; stdout is a file, not a terminal. Each session has its own
    // programs, which take their own timestamps, so an IO near a range's edge may fall on either
    // side of it in different reports: counts are compared with the workload, not across reports.
    let mut plain = report(&["--hist", "d2c"]);
    let mut coloured = report(&["--hist", "D2C", "--color", "always"]);
    let mut json = report(&["--hist", "d2c", "--json"]);
    Workload { write: false, count: N, size: 4096, qd: 1 }.run(&dev);
    for r in [&mut plain, &mut coloured, &mut json] {
        assert!(r.stop(libc::SIGINT).success(), "report failed:\n{}", r.stderr_text());
    }
    let missed = missed_in_text(&plain.stdout_text())
        + missed_in_text(&coloured.stdout_text())
        + serde_json::from_str::<Value>(&json.stdout_text()).map_or(0, |v| missed_in_lost(&v["lost"]));
    if missed > 0 {
        note_missed("report_hist_counts_every_read_and_colours_only_when_asked", missed);
        return;
    }

    let text = plain.stdout_text();
    eprintln!("tracerd report --hist d2c --device {}:\n{text}", dev.name);
    assert!(!text.contains('\x1b'), "escapes in output that is not a terminal:\n{text:?}");
    let rows = hist_rows(&text, &dev.name, "read");
    assert_eq!(rows.iter().map(|r| r.2).sum::<u64>(), N, "every read in exactly one row:\n{text}");
    assert!(rows.windows(2).all(|w| w[0].1 == w[1].0), "contiguous ranges:\n{text}");
    assert!(rows.first().unwrap().2 > 0 && rows.last().unwrap().2 > 0, "no empty rows at the ends:\n{text}");
    assert!(text.contains("  D2C histogram (a row holds from <= time < to):"), "{text}");

    let out = coloured.stdout_text();
    assert!(out.contains("\x1b["), "--color always colours a file too:\n{out}");
    let stripped = hist_rows(&tracerd::view::style::strip(&out), &dev.name, "read");
    assert_eq!(stripped.iter().map(|r| r.2).sum::<u64>(), N, "coloured, the same text:\n{out}");

    let v: Value = serde_json::from_str(&json.stdout_text()).expect("report --json is JSON");
    assert_eq!(v["schema_version"], 1);
    let read = find(&find(&v["devices"], "device", &dev.name)["ops"], "op", "read");
    let buckets = read["stages"]["d2c"]["log2_buckets"].as_array().expect("log2_buckets with --hist");
    let counts: u64 = buckets.iter().map(|b| b["count"].as_u64().unwrap()).sum();
    assert_eq!(counts, N, "{buckets:?}");
    assert_eq!(read["stages"]["d2c"]["count"].as_u64(), Some(N));
    for b in buckets {
        let (from, to) = (b["from_s"].as_f64().unwrap(), b["to_s"].as_f64().unwrap());
        assert!(to == 2.0 * from || from == 0.0, "a power-of-two range: {b}");
    }
    assert!(read["stages"]["q2c"].get("log2_buckets").is_none(), "only the chosen stage");
}

#[test]
fn user_errors_are_clear_and_fail() {
    require_root();
    let (status, _, err) = tracerd_output(&["report", "--duration", "1", "--device", "nosuchdisk9"]);
    assert!(!status.success());
    assert!(err.contains("unknown block device 'nosuchdisk9'") && err.contains("Known devices"), "{err}");

    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let (status, _, err) = tracerd_output(&["run", "--listen", &addr]);
    assert!(!status.success());
    assert!(err.contains("in use"), "{err}");
    assert!(err.contains("--listen"), "the advice names the flag: {err}");

    // Without CAP_BPF/CAP_PERFMON/CAP_SYS_ADMIN: a clear refusal, nothing attempted. `run`
    // says so before it binds (as nobody, the socket's directory would be the first error).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{port}");
    let unprivileged: [&[&str]; 2] = [&["report", "--duration", "1"], &["run", "--listen", &listen]];
    for args in unprivileged {
        let out = std::process::Command::new("setpriv")
            .args([
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
            ])
            .arg(tracerd_tests::tracerd_bin())
            .args(args)
            .output()
            .expect("setpriv (util-linux)");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} ran without privileges");
        assert!(
            err.contains("lacks CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN)") && err.contains("root"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("socket"), "{args:?}: the capability error comes first: {err}");
    }
    let (status, _, err) = tracerd_output(&["report", "--duration", "1", "--device", "mapper/x"]);
    assert!(!status.success() && err.contains("--device \"mapper/x\""), "the flag is named: {err}");

    let (status, _, err) = tracerd_output(&["report", "--duration", "0"]);
    assert!(!status.success() && err.contains("positive number of seconds"), "{err}");

    // Config files: each bad one is refused before anything is loaded, naming file, key and why.
    let dir = std::env::temp_dir().join(format!("tracerd-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases: [(&str, &[u8], &str); 6] = [
        ("typo.toml", b"lisen = \"127.0.0.1:1\"\n", "unknown field `lisen`"),
        ("range.toml", b"[series]\nmax_devices = 0\n", "series.max_devices = 0: must be 1 to 65536"),
        ("ring.toml", b"ring_buffer_bytes = 1000\n", "ring_buffer_bytes = 1000: must be a power of two"),
        ("syntax.toml", b"[histogram\nlowest_ns = 1\n", "not a valid tracerd config"),
        ("garbage.toml", &[0xff, 0xfe, 0x00, 0x13, 0x37], "not a valid tracerd config"),
        ("device.toml", b"[devices]\ninclude = [\"nosuchdisk9\"]\n", "unknown block device 'nosuchdisk9'"),
    ];
    for (name, text, want) in cases {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        let (status, _, err) =
            tracerd_output(&["report", "--duration", "1", "--config", path.to_str().unwrap()]);
        assert!(!status.success(), "{name} accepted");
        assert!(err.contains(want), "{name}: {err}");
        assert!(!err.contains("panicked"), "{name}: {err}");
        if want.starts_with("unknown block") {
            continue; // found at resolve time, after the file was read fine
        }
        assert!(err.contains(name), "{name}: the error names the file: {err}");
    }
    let (status, _, err) = tracerd_output(&["run", "--config", "/nonexistent/tracerd.toml"]);
    assert!(
        !status.success() && err.contains("cannot read the config file /nonexistent/tracerd.toml"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);

    // --save into a directory that does not exist fails before anything is traced.
    let (status, _, err) =
        tracerd_output(&["report", "--duration", "1", "--save", "/nonexistent-dir/a.json"]);
    assert!(!status.success());
    assert!(err.contains("/nonexistent-dir") && err.contains("does not exist"), "{err}");
    assert!(!err.contains("hooks; tracing"), "refused before tracing: {err}");
}

/// `doctor --json` run directly or under a wrapper (setpriv): exit status, checks, stderr.
fn doctor(wrapper: &[&str], args: &[&str]) -> (std::process::ExitStatus, Vec<Value>, String) {
    let mut cmd = match wrapper.split_first() {
        Some((program, rest)) => {
            let mut c = std::process::Command::new(program);
            c.args(rest).arg(tracerd_tests::tracerd_bin());
            c
        }
        None => std::process::Command::new(tracerd_tests::tracerd_bin()),
    };
    let out = cmd.arg("doctor").args(args).output().expect("spawn tracerd doctor");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!stderr.contains("panicked"), "{stderr}");
    let checks: Vec<Value> = if args.contains(&"--json") {
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("doctor --json is not JSON ({e}):\n{stdout}"))
    } else {
        vec![Value::String(stdout.into_owned())]
    };
    (out.status, checks, stderr.into_owned())
}

fn check<'a>(checks: &'a [Value], name: &str) -> &'a Value {
    checks.iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("no check {name} in {checks:#?}"))
}

const NOBODY: [&str; 6] =
    ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"];

#[test]
fn doctor_checks_this_kernel_and_says_what_privileges_change() {
    require_root();
    let (status, checks, err) = doctor(&[], &["--json"]);
    assert!(status.success(), "doctor failed here:\n{checks:#?}\n{err}");
    for c in &checks {
        assert!(["ok", "warn", "fail"].contains(&c["status"].as_str().unwrap()), "{c}");
        assert!(!c["detail"].as_str().unwrap().is_empty(), "{c}");
        assert!(c["advice"].is_null() || c["advice"].is_string(), "{c}");
    }
    assert!(checks.iter().all(|c| c["status"] != "fail"), "exit 0 means no FAIL: {checks:#?}");
    for name in ["privileges", "btf", "layout", "op_enums", "ring_buffer", "load"] {
        assert_eq!(check(&checks, name)["status"], "ok", "{name}: {checks:#?}");
    }
    for hook in tracerd::kernel::hooks::HOOKS {
        assert!(
            checks.iter().any(|c| c["name"] == format!("tracepoint:{}", hook.tracepoint)),
            "{}",
            hook.tracepoint
        );
    }
    for name in ["tracepoint:block_rq_issue", "tracepoint:block_rq_complete"] {
        let c = check(&checks, name);
        assert_eq!(c["status"], "ok", "{c}");
        // The load test's attach type for the hook.
        let detail = c["detail"].as_str().unwrap();
        assert!(detail.contains("tp_btf") || detail.contains("raw_tp"), "{c}");
    }
    // No kprobe PMU on this host kernel (there is one in the VM's): the check follows the kernel.
    let pmu = std::path::Path::new("/sys/bus/event_source/devices/kprobe").exists();
    let kprobes = check(&checks, "kprobes");
    assert_eq!(kprobes["status"], if pmu { "ok" } else { "warn" }, "{kprobes}");
    if !pmu {
        assert!(kprobes["advice"].is_string(), "says what to do: {kprobes}");
    }
    for k in tracerd::kernel::hooks::KPROBES {
        check(&checks, &format!("kprobe:{}", k.function));
    }
    // The kernel (5.16 and later) says what its verifier processed of each program loaded: the
    // check names the program with the most, and how many.
    let verifier = check(&checks, "verifier");
    let (program, took, _) = tracerd_tests::verifier_figures(verifier);
    assert!(program.starts_with("btf_") || program.starts_with("raw_"), "a tracepoint's program: {verifier}");
    assert!(took > 0 && took < 1_000_000, "{verifier}");
    // Without privileges: a FAIL for them with what to do, the rest still checked, no panic.
    let (status, checks, err) = doctor(&NOBODY, &["--json"]);
    assert_eq!(status.code(), Some(1), "{checks:#?}\n{err}");
    let privileges = check(&checks, "privileges");
    assert_eq!(privileges["status"], "fail", "{privileges}");
    assert!(privileges["advice"].as_str().unwrap().contains("sudo"), "{privileges}");
    assert_eq!(check(&checks, "btf")["status"], "ok", "BTF is readable by anyone");
    assert_eq!(check(&checks, "tracepoint:block_rq_issue")["status"], "ok");
    for name in ["ring_buffer", "load"] {
        let c = check(&checks, name);
        assert_eq!(c["status"], "warn", "not checked without privileges: {c}");
        assert!(c["advice"].is_string(), "{c}");
    }
    assert!(checks.iter().all(|c| c["name"] != "verifier"), "nothing was loaded: {checks:#?}");
    // The text form ends with the verdict naming the first failure, without colour in a pipe.
    let (status, text, _) = doctor(&NOBODY, &[]);
    assert_eq!(status.code(), Some(1));
    let text = text[0].as_str().unwrap();
    let verdict = text.lines().last().unwrap();
    assert!(verdict.starts_with("tracerd cannot run here: privileges"), "{text}");
    assert!(!text.contains('\x1b'), "no colour when stdout is not a terminal");
}

/// The device's ops in a `report --json`, each checked to hold exactly the requests and bytes
/// the workloads did (every op they did, no other), with its name and request count.
fn exact_ops<'a>(
    json: &'a Value,
    dev: &LoopDevice,
    workloads: &[Workload],
) -> Vec<(&'a Value, &'a str, u64)> {
    let device = json["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"] == dev.name.as_str())
        .expect("device");
    let want = expected(workloads);
    let ops = device["ops"].as_array().unwrap();
    assert_eq!(ops.len(), want.len(), "{device}");
    ops.iter()
        .map(|op| {
            let name = op["op"].as_str().unwrap();
            let (n, bytes) = want[name];
            assert_eq!((op["requests"].as_u64(), op["bytes"].as_u64()), (Some(n), Some(bytes)), "{name}");
            (op, name, n)
        })
        .collect()
}

/// `--attach raw_tp`: the raw_tp variant of every hook (the fallback where a kernel refuses
/// tp_btf) loaded and attached in this kernel, counting the same workload as exactly as tp_btf.
#[test]
fn raw_tp_hooks_count_every_io_exactly() {
    require_root();
    let dev = LoopDevice::new(128);
    let mut report = Tracerd::spawn(&[
        "report",
        "--json",
        "--duration",
        "600",
        "--attach",
        "raw_tp",
        "--device",
        &dev.name,
    ]);
    for w in &QD1_AND_QD16 {
        w.run(&dev);
    }
    assert!(report.stop(libc::SIGINT).success(), "report failed:\n{}", report.stderr_text());
    let json: Value = serde_json::from_str(&report.stdout_text()).expect("report --json is JSON");
    for hook in tracerd::kernel::hooks::HOOKS {
        let h = json["hooks"].as_array().unwrap().iter().find(|h| h["hook"] == hook.tracepoint).unwrap();
        assert_eq!(h["attach_type"], "raw_tp", "{h}");
        assert!(h["program"].as_str().unwrap().starts_with("raw_"), "{h}");
    }
    let missed = missed_in_lost(&json["lost"]);
    if missed > 0 {
        note_missed("raw_tp_hooks_count_every_io_exactly", missed);
        return;
    }
    for (op, name, n) in exact_ops(&json, &dev, &QD1_AND_QD16) {
        for stage in ["q2g", "q2d", "d2c", "q2c"] {
            assert_eq!(op["stages"][stage]["count"].as_u64(), Some(n), "{name} {stage}");
        }
    }
    assert!(json["lost"].as_object().unwrap().values().all(|v| v == 0), "{}", json["lost"]);
}

/// `skip_hooks = ["block_bio_queue", "block_getrq"]`: neither is attached, each is reported
/// skipped with the reason, and D and C alone still count every IO exactly with its D2C; the
/// stages that need Q or G are absent, not invented.
#[test]
fn skipped_q_and_g_hooks_leave_exact_counts_and_d2c() {
    require_root();
    let dev = LoopDevice::new(128);
    let tmp = TempDir::new();
    let config = tmp.0.join("skip.toml");
    std::fs::write(&config, "skip_hooks = [\"block_bio_queue\", \"block_getrq\"]\n").unwrap();
    let mut report = Tracerd::spawn(&[
        "report",
        "--json",
        "--duration",
        "600",
        "--config",
        config.to_str().unwrap(),
        "--device",
        &dev.name,
    ]);
    for w in &QD1_AND_QD16 {
        w.run(&dev);
    }
    assert!(report.stop(libc::SIGINT).success(), "report failed:\n{}", report.stderr_text());
    let json: Value = serde_json::from_str(&report.stdout_text()).expect("report --json is JSON");
    let hooks = json["hooks"].as_array().unwrap();
    for name in ["block_bio_queue", "block_getrq"] {
        let h = hooks.iter().find(|h| h["hook"] == name).unwrap();
        assert!(h["attach_type"].is_null(), "{h}");
        assert_eq!(h["reason"], "skip_hooks in the config", "{h}");
    }
    for name in ["block_rq_issue", "block_rq_complete"] {
        let h = hooks.iter().find(|h| h["hook"] == name).unwrap();
        assert!(h["attach_type"].is_string(), "{h}");
    }
    let missed = missed_in_lost(&json["lost"]);
    if missed > 0 {
        note_missed("skipped_q_and_g_hooks_leave_exact_counts_and_d2c", missed);
        return;
    }
    for (op, name, n) in exact_ops(&json, &dev, &QD1_AND_QD16) {
        assert_eq!(op["stages"]["d2c"]["count"].as_u64(), Some(n), "{name} d2c");
        for stage in ["q2g", "g2d", "q2d", "q2c"] {
            let count = op["stages"].get(stage).and_then(|s| s["count"].as_u64()).unwrap_or(0);
            assert_eq!(count, 0, "{name} {stage} without Q and G: {}", op["stages"]);
        }
    }
    assert!(json["lost"].as_object().unwrap().values().all(|v| v == 0), "{}", json["lost"]);
}

/// What start-up detection must choose on this kernel (tests/src/kernels.rs, docs/reference/kernels.md's
/// support matrix): on the host, and on each VM kernel that runs these tests.
#[test]
fn doctor_chooses_what_this_kernel_must_get() {
    require_root();
    let release = tracerd::kernel::tracer::kernel_release();
    let (status, checks, err) = doctor(&[], &["--json"]);
    assert!(status.success(), "doctor failed here:\n{checks:#?}\n{err}");
    match tracerd_tests::kernels::assert_doctor_chose(&release, &checks) {
        Some(log) => eprintln!("{}", log.join("\n")),
        None => eprintln!(
            "SKIPPED doctor_chooses_what_this_kernel_must_get: kernel {release} is not one tracerd is \
             tested on (tests/src/kernels.rs)"
        ),
    }
}

/// Min, median and max of signed differences (ns), for the report.
fn spread(mut v: Vec<i64>) -> String {
    if v.is_empty() {
        return "none".into();
    }
    v.sort_unstable();
    format!("min {} / median {} / max {} ns over {} IOs", v[0], v[v.len() / 2], v[v.len() - 1], v.len())
}

/// The request's own timestamps (`rq->start_time_ns`, `rq->io_start_time_ns`), read at
/// completion, beside the probes' G and D on the same IOs: present wherever the kernel sets them
/// (iostats for the first, a stats consumer such as wbt for the second), and in the order the
/// kernel takes them. How far they lie from the probes is printed, not asserted: that is time.
#[test]
fn kernel_timestamps_sit_beside_the_probes_io_by_io() {
    require_root();
    let dev = LoopDevice::new(128);
    let mut snoop = Tracerd::spawn(&["snoop", "--json", "--device", &dev.name]);
    let workloads = [
        Workload { write: false, count: 1000, size: 4096, qd: 1 },
        Workload { write: false, count: 2000, size: 4096, qd: 16 },
    ];
    for w in &workloads {
        w.run(&dev);
    }
    assert!(snoop.stop(libc::SIGINT).success(), "snoop failed:\n{}", snoop.stderr_text());
    let queue = |file: &str| std::fs::read_to_string(format!("/sys/block/{}/queue/{file}", dev.name));
    // wbt_lat_usec is readable exactly when writeback throttling, a stats consumer, is on the
    // queue; iostats=1 has the kernel stamp the request's start.
    let wbt = queue("wbt_lat_usec").is_ok();
    let iostats = queue("iostats").is_ok_and(|v| v.trim() == "1");
    let (mut n, mut io_start_minus_d, mut start_minus_g) = (0u64, Vec::new(), Vec::new());
    for line in snoop.stdout_text().lines() {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        n += 1;
        let (e, k) = (&v["events_ns"], &v["kernel_ns"]);
        let ev = |name: &str| e[name].as_u64().unwrap_or_else(|| panic!("no {name} in {line}"));
        let c = ev("c");
        match k["io_start"].as_u64() {
            Some(io_start) => {
                assert!(io_start <= c, "io_start_time_ns after the completion probe: {line}");
                io_start_minus_d.push(io_start as i64 - ev("d") as i64);
            }
            None => assert!(!wbt, "wbt is on {} but a request has no io_start_time_ns: {line}", dev.name),
        }
        match k["start"].as_u64() {
            Some(start) => {
                assert!(start <= c, "start_time_ns after the completion probe: {line}");
                if let Some(io_start) = k["io_start"].as_u64() {
                    assert!(start <= io_start, "start_time_ns after io_start_time_ns: {line}");
                }
                start_minus_g.push(start as i64 - ev("g") as i64);
            }
            None => {
                assert!(!iostats, "iostats is on for {} but a request has no start_time_ns: {line}", dev.name)
            }
        }
    }
    assert_eq!(n, 3000, "one line per read");
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    eprintln!(
        "kernel timestamps on {} (wbt {wbt}, iostats {iostats}):\n  io_start_time_ns - D probe: {}\n  start_time_ns - G probe: {}",
        kernel.trim(),
        spread(io_start_minus_d),
        spread(start_minus_g)
    );
}

/// The agent counts reads and writes in the kernel. `--aggregation check` has the kernel send
/// each such IO as a record too; on exit the daemon counts the records with its own stage
/// definitions and compares them with the kernel's counters, series by series: requests,
/// bytes, paths, queue depths, and every stage's sum and histogram buckets.
#[test]
fn kernel_aggregation_equals_the_records_io_by_io() {
    require_root();
    let (disk, parts) = LoopDevice::partitioned(128, 2, 32);
    let (whole, part) = (&disk.name, &parts[0]);
    let mut agent = Tracerd::run(&["--device", whole, "--device", part, "--aggregation", "check"]);
    // Both devices have a kernel series from the start (there are enough for every device).
    let used = agent.metrics().get("tracerd_kernel_series", &[("state", "used")]);
    assert_eq!(used, 2.0, "kernel series for {whole} and {part}");
    let on_disk = [
        Workload { write: false, count: 4000, size: 4096, qd: 16 },
        Workload { write: true, count: 600, size: 8192, qd: 4 },
        Workload { write: false, count: 300, size: 65536, qd: 1 },
    ];
    for w in &on_disk {
        w.run(&disk);
    }
    // Partition 2 is not named: its IO counts towards the disk. Partition 1's is its own.
    Workload { write: true, count: 200, size: 4096, qd: 8 }.run_on(&format!("/dev/{}", parts[1]));
    Workload { write: false, count: 500, size: 4096, qd: 32 }.run_on(&format!("/dev/{part}"));
    let want = [(whole.as_str(), "read", 4300), (whole, "write", 800), (part, "read", 500)];
    let counts = || {
        let m = agent.metrics();
        want.iter().map(|(d, op, _)| requests(&m, d, op)).collect::<Vec<_>>()
    };
    let in_metrics: Vec<u64> = want.iter().map(|w| w.2).collect();
    let issued: u64 = in_metrics.iter().sum();
    assert!(
        eventually(|| counts().iter().sum::<u64>() + missed_completions(&agent.metrics()) == issued),
        "/metrics: {:?}, not {in_metrics:?} (waited {HANG:?})",
        counts()
    );
    let missed = missed_completions(&agent.metrics());
    // A missed completion is missing from both sides alike: the check still holds.
    assert!(agent.stop(libc::SIGINT).success(), "the check failed:\n{}", agent.stdout_text());
    if missed > 0 {
        note_missed("kernel_aggregation_equals_the_records_io_by_io", missed);
        return;
    }
    let out = agent.stdout_text();
    for (d, op, n) in want {
        let line = format!("aggregation check: {d} {op}: {n} requests, kernel and records agree");
        assert!(out.contains(&line), "no '{line}' in:\n{out}");
    }
    assert!(!out.contains("DIFFER"), "{out}");
}

#[test]
fn a_device_named_by_a_link_to_its_node_is_traced_as_its_kernel_name() {
    require_root();
    let dev = LoopDevice::new(64);
    // As /dev/disk/by-id/... is: a link to the node, here in a directory of the test's own.
    let dir = TempDir::new();
    let link = dir.file("by-id-tracerd-test");
    std::os::unix::fs::symlink(&dev.path, &link).unwrap();
    let mut report = Tracerd::spawn(&["report", "--json", "--duration", "600", "--device", &link]);
    let reads = Workload { write: false, count: 300, size: 4096, qd: 1 };
    reads.run(&dev);
    assert!(report.stop(libc::SIGINT).success(), "{}", report.stderr_text());
    let json: Value = serde_json::from_str(&report.stdout_text()).unwrap();
    let devices: Vec<&str> =
        json["devices"].as_array().unwrap().iter().filter_map(|d| d["device"].as_str()).collect();
    assert_eq!(devices, vec![dev.name.as_str()], "the link names {}", dev.name);
    let traced = json["devices"][0]["ops"][0]["requests"].as_u64().unwrap();
    assert_eq!(traced + missed_in_lost(&json["lost"]), reads.count);

    let (status, _, err) = tracerd_output(&["report", "--duration", "1", "--device", "top0"]);
    assert!(!status.success());
    assert!(err.contains("unknown block device 'top0'") && err.contains("device-mapper name"), "{err}");
}

/// 40 traced disks, more than the 32 series a small host starts with: the kernel's series are
/// sized at load for the devices traced (and half as many again), so every disk's reads are
/// counted in the kernel: `--aggregation check` compares each disk's series with its records.
#[test]
fn kernel_series_are_sized_for_the_devices_traced() {
    require_root();
    let disks: Vec<LoopDevice> = (0..40).map(|_| LoopDevice::new(2)).collect();
    let mut args: Vec<&str> = disks.iter().flat_map(|d| ["--device", d.name.as_str()]).collect();
    args.extend(["--aggregation", "check"]);
    let mut agent = Tracerd::run(&args);
    let m = agent.metrics();
    assert_eq!(m.get("tracerd_kernel_series", &[("state", "capacity")]), 60.0, "40 devices and half again");
    assert_eq!(
        m.get("tracerd_kernel_series", &[("state", "used")]),
        40.0,
        "a series for each disk from the start"
    );
    let reads = Workload { write: false, count: 25, size: 4096, qd: 1 };
    for d in &disks {
        reads.run(d);
    }
    let counted = |m: &Metrics| disks.iter().map(|d| requests(m, &d.name, "read")).sum::<u64>();
    assert!(
        eventually(|| {
            let m = agent.metrics();
            counted(&m) + missed_completions(&m) == 40 * 25
        }),
        "reads counted: {} of {}",
        counted(&agent.metrics()),
        40 * 25
    );
    let missed = missed_completions(&agent.metrics());
    assert!(agent.stop(libc::SIGINT).success(), "the check failed:\n{}", agent.stdout_text());
    if missed > 0 {
        note_missed("kernel_series_are_sized_for_the_devices_traced", missed);
        return;
    }
    // Each disk's reads were counted into its own kernel series (the check names only those).
    let out = agent.stdout_text();
    for d in &disks {
        let line = format!("aggregation check: {} read: 25 requests, kernel and records agree", d.name);
        assert!(out.contains(&line), "no '{line}' in:\n{out}");
    }
}

/// Writes completed and writes merged for `dev` in /proc/diskstats.
fn write_stats(dev: &str) -> (u64, u64) {
    let stats = std::fs::read_to_string("/proc/diskstats").unwrap();
    let f: Vec<u64> = stats
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.get(2) == Some(&dev))
        .unwrap_or_else(|| panic!("{dev} is not in /proc/diskstats"))[7..9]
        .iter()
        .map(|v| v.parse().unwrap())
        .collect();
    (f[0], f[1])
}

/// Sets a loop device's IO scheduler until dropped, then puts back `none`: a loop device keeps
/// its queue when detached, and the next test to attach it would run behind the elevator.
struct Scheduler(String);

impl Scheduler {
    fn set(dev: &LoopDevice, name: &str) -> Scheduler {
        let path = format!("/sys/block/{}/queue/scheduler", dev.name);
        std::fs::write(&path, name).unwrap_or_else(|e| panic!("{path} <- {name}: {e}"));
        Scheduler(path)
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.0, "none");
    }
}

#[test]
fn requests_an_elevator_merges_as_it_inserts_them_are_each_a_merge_and_nothing_is_lost() {
    require_root();
    let dev = LoopDevice::new(64);
    let _scheduler = Scheduler::set(&dev, "mq-deadline");
    let mut snoop = Tracerd::spawn(&["snoop", "--json", "--device", &dev.name]);
    let before = write_stats(&dev.name);
    // Rounds of 16 adjacent 4 KiB writes, each in one io_submit, odd positions first: every write
    // gets a request in the plug, and as the plug is flushed into mq-deadline, each even request
    // merges into the odd one before it, which then merges into the request before it.
    let (count, qd) = (512u64, 16u64);
    let out = std::process::Command::new(tracerd_tests::iogen_bin())
        .args([&dev.path, "write", &count.to_string(), "4096", &qd.to_string(), "scatter"])
        .output()
        .expect("spawn iogen");
    assert!(out.status.success(), "iogen failed: {}", String::from_utf8_lossy(&out.stderr));
    let after = write_stats(&dev.name);
    assert!(snoop.stop(libc::SIGINT).success(), "snoop failed:\n{}", snoop.stderr_text());
    let (written, merged) = (after.0 - before.0, after.1 - before.1);
    assert!(merged > 0, "mq-deadline merged none of {count} writes: nothing was tested");
    let lines: Vec<Value> = snoop.stdout_text().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let kind = |k: &str| lines.iter().filter(|l| l["kind"] == k && l["op"] == "write").count() as u64;
    let missed = missed_in_text(&snoop.stderr_text());
    // Each write is one line: a request, or a merge into one; the requests are diskstats'.
    assert_eq!(
        (kind("request"), kind("merge"), missed),
        (written, merged, 0),
        "(requests, merges, missed) traced vs diskstats' (writes, merged); {count} writes issued:\n{}",
        snoop.stderr_text()
    );
    assert_eq!(written + merged, count, "diskstats: {written} writes + {merged} merged");
    // A merge record times its bio from Q to the merge. Both kinds are here: a request merged
    // into the one before it as it is inserted (no I of its own), and, chained from that, an
    // inserted request merged into the one before it (its I is in the record).
    let merges: Vec<&Value> = lines.iter().filter(|l| l["kind"] == "merge").collect();
    for l in &merges {
        assert!(l["stages_ns"]["q2m"].as_u64().is_some(), "{l}");
    }
    let inserted = merges.iter().filter(|l| l["events_ns"]["i"].is_u64()).count();
    assert!(
        inserted > 0 && inserted < merges.len(),
        "{inserted} of {} merged requests had been inserted: both kinds of merge were expected",
        merges.len()
    );
    eprintln!(
        "{count} writes: {written} requests, {merged} merged by mq-deadline ({inserted} after their I)"
    );
}
