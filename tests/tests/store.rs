//! The recorder's store on disk, on the host kernel: history across agent restarts (a stop
//! and a kill), read by a later agent and offline by `report --store` without root; damage
//! and unfinished records skipped and counted; a full filesystem warned of, counted, and
//! recorded again when space returns.

use std::{
    fs,
    io::Write,
    path::Path,
    process::{Command, Stdio},
};

use serde_json::Value;
use tracerd_tests::{
    LoopDevice, TempDir, Tracerd, Workload, eventually, require_root, tracerd_bin, tracerd_output,
};

fn reads(count: u64) -> Workload {
    Workload { write: false, count, size: 4096, qd: 1 }
}

fn requests(report: &Value, dev: &str) -> u64 {
    let Some(devices) = report["devices"].as_array() else { return 0 };
    let ops = devices.iter().filter(|d| d["device"] == dev).flat_map(|d| d["ops"].as_array().unwrap());
    ops.filter(|o| o["op"] == "read").map(|o| o["requests"].as_u64().unwrap()).sum()
}

/// `report --json ARGS`: the report, or the error text.
fn report(args: &[&str]) -> Result<Value, String> {
    let (status, out, err) = tracerd_output(&[&["report", "--json"][..], args].concat());
    if !status.success() {
        return Err(err);
    }
    serde_json::from_str(&out).map_err(|e| format!("not JSON ({e}): {out}\n{err}"))
}

/// Waits until the agent's recorder holds `want` reads of `dev` in sealed frames (and so in
/// its store): then a kill loses none of them.
fn recorded(agent: &Tracerd, dev: &str, want: u64) -> Value {
    let socket = agent.socket.as_ref().unwrap().to_str().unwrap();
    let mut last = Value::Null;
    let ok = eventually(|| {
        last = report(&["--since", "10m", "--socket", socket, "--device", dev]).unwrap_or(Value::Null);
        requests(&last, dev) == want
    });
    assert!(ok, "the agent's recorder never held {want} reads of {dev}: {last:#}\n{}", agent.stderr_text());
    last
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64()
}

/// iogen reading `dev` until dropped.
struct Busy(std::process::Child);

impl Busy {
    fn reading(dev: &LoopDevice) -> Busy {
        let child = Command::new(tracerd_tests::iogen_bin())
            .args([&dev.path, "read", "100000000", "4096", "1"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        Busy(child)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// RFC 3339, to the second.
fn rfc3339(unix_s: u64) -> String {
    let out = Command::new("date")
        .args(["-u", "-d", &format!("@{unix_s}"), "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// Three agents in turn on one store: the first stopped (SIGTERM), the second killed
/// (SIGKILL). The third's `report --from T0 --to T2` counts every read of all three exactly,
/// and marks the two gaps. The slowest IOs of a device only the first agent saw IO on are
/// reported after it, exactly as it served them. A copy of the store reads the same offline,
/// as nobody; damaged and unfinished records in it are skipped and counted, by `report` and by
/// an agent.
#[test]
fn history_across_a_stop_and_a_kill_is_reported_whole_with_its_gaps() {
    require_root();
    let (dev, early) = (LoopDevice::new(16), LoopDevice::new(16));
    let tmp = TempDir::new();
    let store = tmp.0.join("store");
    let agent_on = |store: &Path| {
        Tracerd::run(&["--store", store.to_str().unwrap(), "--device", &dev.name, "--device", &early.name])
    };
    let t0 = now();

    let mut first = agent_on(&store);
    reads(100).run(&dev);
    reads(20).run(&early);
    recorded(&first, &dev.name, 100);
    let served = recorded(&first, &early.name, 20)["slowest"].clone();
    assert!(served.as_array().is_some_and(|m| !m.is_empty()), "the first agent kept slow IOs: {served:#}");
    assert!(first.stop(libc::SIGTERM).success(), "{}", first.stderr_text());

    let mut second = agent_on(&store);
    assert!(second.stderr_text().contains("recorder store"), "{}", second.stderr_text());
    reads(50).run(&dev);
    // The second agent's window holds the first's frames too, read back from the store.
    recorded(&second, &dev.name, 150);
    second.stop(libc::SIGKILL);

    let third = agent_on(&store);
    reads(30).run(&dev);
    recorded(&third, &dev.name, 180);
    let (from, to) = (rfc3339(t0 as u64), rfc3339(now() as u64 + 1));
    let socket = third.socket.as_ref().unwrap().to_str().unwrap().to_owned();
    let whole = report(&["--from", &from, "--to", &to, "--socket", &socket, "--device", &dev.name]).unwrap();
    assert_eq!(requests(&whole, &dev.name), 180, "{whole:#}");
    let gaps = whole["from_agent"]["gaps"].as_array().cloned().unwrap_or_default();
    assert_eq!(gaps.len(), 2, "a gap before each restart: {:#}", whole["from_agent"]);
    for g in &gaps {
        let (a, b) = (g["from_unix_s"].as_f64().unwrap(), g["to_unix_s"].as_f64().unwrap());
        assert!(t0 < a && a < b, "{g}");
    }
    let (_, text, _) =
        tracerd_output(&["report", "--since", "10m", "--socket", &socket, "--device", &dev.name]);
    assert_eq!(text.matches("gap: no agent ran from ").count(), 2, "{text}");
    // The slowest IOs of the device only the first agent saw IO on: from the store, as served.
    let slowest = |r: &Value| r["slowest"].clone();
    let later =
        report(&["--from", &from, "--to", &to, "--socket", &socket, "--device", &early.name]).unwrap();
    assert_eq!(slowest(&later), served, "the first agent's slowest IOs, read back after two restarts");
    drop(third);

    // A copy, read as nobody without an agent.
    let copy = tmp.0.join("copy");
    let cp =
        Command::new("cp").args(["-r", store.to_str().unwrap(), copy.to_str().unwrap()]).status().unwrap();
    assert!(cp.success());
    let _ = Command::new("chmod").args(["-R", "a+rX", tmp.0.to_str().unwrap()]).status();
    let as_nobody = |args: &[&str]| {
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(tracerd_bin())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, out, err) = as_nobody(&["report", "--json", "--store", copy.to_str().unwrap()]);
    assert!(ok, "{err}");
    let offline: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(requests(&offline, &dev.name), 180, "{offline:#}");
    assert_eq!(
        offline["from_agent"]["gaps"].as_array().map(Vec::len),
        Some(2),
        "{:#}",
        offline["from_agent"]
    );
    assert!(offline["from_agent"]["store"].is_string(), "{:#}", offline["from_agent"]);
    let (ok, out, err) =
        as_nobody(&["report", "--json", "--store", copy.to_str().unwrap(), "--device", &early.name]);
    assert!(ok, "{err}");
    let offline_early: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(slowest(&offline_early), served, "the slowest IOs, offline");

    // Damage in the middle of the first segment, and an unfinished record at the end of the
    // last: both skipped and said, never a crash or a wrong count.
    let mut segments: Vec<_> = fs::read_dir(&copy)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "tdr"))
        .collect();
    segments.sort();
    let mut bytes = fs::read(&segments[0]).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle..middle + 8].copy_from_slice(&[0xa5; 8]);
    fs::write(&segments[0], &bytes).unwrap();
    let mut last = fs::OpenOptions::new().append(true).open(segments.last().unwrap()).unwrap();
    last.write_all(&[200, 0, 0, 0, 1, 2, 3, 4, 1, 0, 0]).unwrap();
    let (ok, out, err) = as_nobody(&["report", "--json", "--store", copy.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(err.contains("damaged bytes at offset"), "{err}");
    assert!(err.contains("unfinished record"), "{err}");
    let damaged: Value = serde_json::from_str(&out).unwrap();
    assert!(requests(&damaged, &dev.name) <= 180, "{damaged:#}");

    // An agent opens the damaged copy, cuts the unfinished record, and counts both.
    let agent = agent_on(&copy);
    let counter = |name: &str| agent.metrics().get(name, &[]);
    // Served from the first frame on.
    assert!(
        eventually(|| counter("tracerd_recorder_store_damaged_records_total") >= 1.0),
        "{:?}",
        agent.metrics()
    );
    assert_eq!(counter("tracerd_recorder_store_torn_tails_total"), 1.0);
}

/// The store on a 2 MiB tmpfs filled up: the agent warns once, counts the frames it could not
/// write, goes on tracing, and writes again once space returns. Offline, the store holds the
/// reads before and after, not those of the full time.
#[test]
fn a_full_filesystem_is_warned_of_and_counted_and_recording_resumes() {
    require_root();
    let dev = LoopDevice::new(16);
    let tmp = TempDir::new();
    let mount = tmp.0.join("small");
    fs::create_dir(&mount).unwrap();
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2m", "tracerd-test", mount.to_str().unwrap()])
        .status();
    assert!(ok.is_ok_and(|s| s.success()), "cannot mount a tmpfs on {}", mount.display());
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(mount.clone());
    let store = mount.join("store");
    let mut agent = Tracerd::run(&["--store", store.to_str().unwrap(), "--device", &dev.name]);
    let not_stored = |a: &Tracerd| a.metrics().get("tracerd_recorder_store_frames_not_stored_total", &[]);
    reads(50).run(&dev);
    recorded(&agent, &dev.name, 50);

    // Fill what is left, with reads going on: every frame then holds IO, and the page the
    // segment's last write left room in fills within seconds.
    let filler = mount.join("filler");
    let _ = Command::new("dd")
        .args(["if=/dev/zero", &format!("of={}", filler.display()), "bs=64k"])
        .stderr(Stdio::null())
        .status();
    let busy = Busy::reading(&dev);
    assert!(
        eventually(|| not_stored(&agent) >= 1.0),
        "no frame counted as not stored:\n{}",
        agent.stderr_text()
    );
    let failed = not_stored(&agent);
    assert!(eventually(|| not_stored(&agent) >= failed + 2.0));
    drop(busy);
    let warned = agent.stderr_text();
    assert_eq!(warned.matches("cannot write to the recorder's store").count(), 1, "one warning: {warned}");
    // Tracing went on: the agent counts every read it saw.
    let read = || agent.metrics().get("tracerd_io_requests_total", &[("device", &dev.name), ("op", "read")]);
    let mut seen = 0.0;
    assert!(eventually(|| {
        let before = seen;
        seen = read();
        std::thread::sleep(std::time::Duration::from_millis(1500));
        seen == before && seen > 50.0
    }));

    // Space again: the reads after it are written, and the outage ends once the store has
    // written for a minute without a failure.
    fs::remove_file(&filler).unwrap();
    reads(70).run(&dev);
    let total = seen as u64 + 70;
    recorded(&agent, &dev.name, total);
    assert!(
        eventually(|| agent.stderr_text().contains("takes frames again")),
        "recording never resumed:\n{}",
        agent.stderr_text()
    );
    let warned = agent.stderr_text();
    assert_eq!(warned.matches("cannot write to the recorder's store").count(), 1, "one warning: {warned}");
    assert!(agent.stop(libc::SIGTERM).success());
    // Offline: the reads before and after, and of the full time only what the frames that
    // were written hold.
    let offline = report(&["--store", store.to_str().unwrap(), "--device", &dev.name]).unwrap();
    let stored = requests(&offline, &dev.name);
    assert!((50 + 70..total).contains(&stored), "{stored} reads stored of {total}: {offline:#}");
}

/// 50 agents in turn on one store, each killed (SIGKILL) at a random moment of its second
/// second, with reads going on throughout. Every agent opens the store its predecessor left,
/// and at the end the store, read offline, holds exactly what each agent's window held when
/// it was killed: no frame an agent served is lost or changed.
#[test]
fn fifty_kills_lose_no_frame_an_agent_served() {
    require_root();
    let dev = LoopDevice::new(16);
    let tmp = TempDir::new();
    let store = tmp.0.join("store");
    let t0 = now() as u64;
    let busy = Busy::reading(&dev);
    let mut served: Vec<(u64, u64)> = Vec::new();
    for i in 0..50u64 {
        let mut agent = Tracerd::run(&["--store", store.to_str().unwrap(), "--device", &dev.name]);
        let socket = agent.socket.as_ref().unwrap().to_str().unwrap().to_owned();
        // The window once it holds a frame of this agent's.
        let after = served.last().map_or(0.0, |&(to_ms, _)| to_ms as f64 / 1e3);
        let mut w = Value::Null;
        let own_frame = eventually(|| {
            w = report(&["--since", "1h", "--socket", &socket, "--device", &dev.name]).unwrap_or(Value::Null);
            w["from_agent"]["to_unix_s"].as_f64().is_some_and(|to| to > after + 0.5)
        });
        assert!(own_frame, "agent {i} never served a frame of its own: {w:#}\n{}", agent.stderr_text());
        std::thread::sleep(std::time::Duration::from_millis(i * 37 % 900));
        // What it serves now: the frames written so far.
        let w = report(&["--since", "1h", "--socket", &socket, "--device", &dev.name]).unwrap();
        let to = w["from_agent"]["to_unix_s"].as_f64().unwrap();
        served.push(((to * 1e3).round() as u64, requests(&w, &dev.name)));
        agent.stop(libc::SIGKILL);
    }
    drop(busy);
    assert!(served.windows(2).all(|p| p[0].1 < p[1].1), "reads went on: {served:?}");
    let from = rfc3339(t0);
    for &(to_ms, requests_then) in &served {
        // Windows take whole frames that start before their end: ask to just inside the end.
        let to = format!("{}.{:03}Z", &rfc3339(to_ms / 1000)[..19], to_ms % 1000);
        let stored = report(&[
            "--store",
            store.to_str().unwrap(),
            "--from",
            &from,
            "--to",
            &to,
            "--device",
            &dev.name,
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            requests(&stored, &dev.name),
            requests_then,
            "the store up to {to}: {:#}",
            stored["from_agent"]
        );
    }
}
