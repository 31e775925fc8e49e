//! The agent's flight recorder and API, against the running kernel: views attach to a running
//! `tracerd run` instead of loading programs, windows of the past count every IO done in them,
//! and the socket is root-only and refuses what it cannot serve.

use std::{
    io::{Read, Write},
    os::unix::{fs::FileTypeExt, fs::PermissionsExt, net::UnixStream},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use serde_json::Value;
use tracerd_tests::{
    HANG, LoopDevice, TempDir, Tracerd, Workload, bpf_programs_held_by, eventually, missed_completions,
    missed_in_lost, note_missed, pane, require_root, tmux, tracerd_bin, tracerd_output,
};

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// `tracerd report ARGS --json` against the agent's socket: the report, or the error text.
fn report_json(socket: &Path, args: &[&str]) -> Result<Value, String> {
    let mut all = vec!["report", "--json", "--socket", socket.to_str().unwrap()];
    all.extend_from_slice(args);
    let (status, out, err) = tracerd_output(&all);
    if !status.success() {
        return Err(err);
    }
    serde_json::from_str(&out).map_err(|e| format!("report --json is not JSON ({e}):\n{out}\n{err}"))
}

fn op<'a>(report: &'a Value, dev: &str, op: &str) -> Option<&'a Value> {
    let device = report["devices"].as_array()?.iter().find(|d| d["device"] == dev)?;
    device["ops"].as_array()?.iter().find(|o| o["op"] == op)
}

fn requests(report: &Value, dev: &str, name: &str) -> u64 {
    op(report, dev, name).map_or(0, |o| o["requests"].as_u64().unwrap())
}

/// A view attached to the agent: started, and known to have found it.
fn attached_report(socket: &Path, dev: &str) -> Tracerd {
    let r = Tracerd::spawn(&[
        "report",
        "--json",
        "--duration",
        "600",
        "--device",
        dev,
        "--socket",
        socket.to_str().unwrap(),
    ]);
    assert!(r.stderr_text().contains("reading from the running agent"), "not attached:\n{}", r.stderr_text());
    r
}

#[test]
fn views_attach_to_the_agent_and_windows_of_the_past_count_every_io() {
    require_root();
    let dev = LoopDevice::new(128);
    let agent = Tracerd::run(&["--device", &dev.name]);
    let socket = agent.socket.clone().unwrap();
    let reads = Workload { write: false, count: 3000, size: 4096, qd: 8 };
    let writes = Workload { write: true, count: 500, size: 8192, qd: 4 };
    reads.run(&dev);
    let settled = |n: u64| {
        eventually(|| {
            let m = agent.metrics();
            let done = ["read", "write"]
                .iter()
                .map(|op| m.get("tracerd_io_requests_total", &[("device", &dev.name), ("op", op)]) as u64)
                .sum::<u64>();
            done + missed_completions(&m) == n
        })
    };
    assert!(settled(reads.count), "the agent never counted the reads:\n{}", agent.stderr_text());
    let reads_done = unix_now();
    // Frames are a second long: the reads end in a frame before `between`, and the frame that
    // holds `cut` has neither reads nor writes.
    std::thread::sleep(Duration::from_millis(3000));
    let between = unix_now();
    let cut = reads_done + 1.5;
    writes.run(&dev);
    assert!(settled(reads.count + writes.count), "the agent never counted the writes");
    let missed = missed_completions(&agent.metrics());
    // The frame with the last IO is sealed within a second.
    let mut last = Value::Null;
    let whole = eventually(|| {
        last = report_json(&socket, &["--since", "1h", "--device", &dev.name]).unwrap_or_else(Value::String);
        requests(&last, &dev.name, "read")
            + requests(&last, &dev.name, "write")
            + missed_in_lost(&last["lost"])
            == reads.count + writes.count
    });
    assert!(whole, "report --since 1h never showed every IO (waited {HANG:?}):\n{last:#}");
    assert_eq!(last["from_agent"]["socket"], socket.to_str().unwrap());
    assert!(last["from_agent"]["frames"].as_u64().unwrap() >= 3, "{}", last["from_agent"]);
    if missed > 0 {
        note_missed("views_attach_to_the_agent_and_windows_of_the_past_count_every_io", missed);
    } else {
        for w in [reads, writes] {
            let o = op(&last, &dev.name, w.op()).unwrap();
            assert_eq!(o["requests"].as_u64(), Some(w.count), "{}", w.op());
            assert_eq!(o["bytes"].as_u64(), Some(w.bytes()), "{}", w.op());
            for stage in ["q2c", "d2c", "q2d"] {
                assert_eq!(o["stages"][stage]["count"].as_u64(), Some(w.count), "{} {stage}", w.op());
            }
        }
        // A window that starts after the reads holds the writes alone.
        let from = format!("{}s", (unix_now() - between).ceil() as u64);
        let later = report_json(&socket, &["--from", &from, "--device", &dev.name]).unwrap();
        assert_eq!(requests(&later, &dev.name, "read"), 0, "{later:#}");
        assert_eq!(requests(&later, &dev.name, "write"), writes.count, "{later:#}");
        // diff of two windows of the agent: the reads before `between`, the writes after.
        let cut = format!("{}.{:03}Z", &tracerd::units::rfc3339(cut)[..19], (cut.fract() * 1e3) as u32);
        let (a, b) = (format!("@1h..{cut}"), format!("@{cut}..now"));
        let (status, out, err) =
            tracerd_output(&["diff", "--json", "--socket", socket.to_str().unwrap(), &a, &b]);
        assert!(status.success(), "diff of two windows: {err}");
        let d: Value = serde_json::from_str(&out).unwrap();
        let only = |side: &str| -> Vec<String> {
            d[side]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["device"] == dev.name.as_str())
                .map(|m| m["op"].to_string())
                .collect()
        };
        assert_eq!(
            (only("only_in_a"), only("only_in_b")),
            (vec!["\"read\"".to_string()], vec!["\"write\"".to_string()]),
            "{d:#}"
        );
        assert!(d["a"]["file"].as_str().unwrap().starts_with("agent "), "{}", d["a"]);
    }

    // Three views at once load nothing: the kernel runs the agent's programs alone.
    let programs = bpf_programs_held_by(agent.pid());
    assert_eq!(programs, tracerd::kernel::hooks::HOOKS.len(), "the agent holds a program per hook");
    std::thread::sleep(Duration::from_millis(1500));
    let mut views: Vec<Tracerd> = (0..3).map(|_| attached_report(&socket, &dev.name)).collect();
    let during = Workload { write: false, count: 700, size: 4096, qd: 2 };
    during.run(&dev);
    assert!(settled(reads.count + writes.count + during.count), "the agent never counted the last reads");
    for v in &views {
        assert_eq!(bpf_programs_held_by(v.pid()), 0, "a view attached to the agent loaded programs");
    }
    assert_eq!(bpf_programs_held_by(agent.pid()), programs, "three views, one copy of the programs");
    for mut v in views.drain(..) {
        assert!(v.stop(libc::SIGINT).success(), "attached report failed:\n{}", v.stderr_text());
        let r: Value = serde_json::from_str(&v.stdout_text()).expect("report --json");
        let missed = missed_in_lost(&r["lost"]);
        assert_eq!(requests(&r, &dev.name, "read") + missed, during.count, "{r:#}");
        assert_eq!(requests(&r, &dev.name, "write"), 0, "{r:#}");
    }

    // --save on a window writes a capture that diff reads.
    let dir = TempDir::new();
    let file = dir.file("window.json");
    report_json(&socket, &["--since", "1h", "--device", &dev.name, "--save", &file]).unwrap();
    let (status, out, err) = tracerd_output(&["diff", &file, &file]);
    assert!(status.success(), "diff of a saved window failed: {err}");
    assert!(out.contains(&dev.name), "{out}");
}

/// Sends `bytes` on the socket and returns the answer.
fn ask(socket: &Path, bytes: &[u8]) -> Value {
    let mut s = UnixStream::connect(socket).expect("connect to the agent");
    s.set_read_timeout(Some(HANG)).unwrap();
    s.write_all(bytes).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    serde_json::from_str(&answer).unwrap_or_else(|e| panic!("answer is not JSON ({e}): {answer}"))
}

#[test]
fn the_socket_is_root_only_refuses_bad_requests_and_goes_with_the_agent() {
    require_root();
    let mut agent = Tracerd::run(&[]);
    let socket = agent.socket.clone().unwrap();
    let meta = std::fs::metadata(&socket).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "root-only");

    let status = ask(&socket, b"{\"version\":1,\"request\":\"status\"}\n");
    assert_eq!(status["version"], 1);
    assert_eq!(status["status"]["pid"], agent.pid());
    assert_eq!(status["status"]["recorder"]["retention_s"], 3600.0);
    for (bytes, says) in [
        (b"hello\n".to_vec(), "not JSON"),
        (b"{\"version\":7,\"request\":\"status\"}\n".to_vec(), "version 7 is not served"),
        (b"{\"version\":1,\"request\":\"everything\"}\n".to_vec(), "requests: status, window"),
        (vec![b' '; 70_000], "longer than 65536 bytes"),
    ] {
        let e = ask(&socket, &bytes);
        assert!(e["error"].as_str().is_some_and(|e| e.contains(says)), "{says}: {e}");
    }

    // A second agent on the same socket is refused before it loads anything.
    let (status, _, err) =
        tracerd_output(&["run", "--listen", "127.0.0.1:0", "--socket", socket.to_str().unwrap()]);
    assert!(!status.success());
    assert!(err.contains("another tracerd agent is already serving"), "{err}");

    // Not root: the socket says so.
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(tracerd_bin())
        .args(["report", "--since", "5m", "--socket", socket.to_str().unwrap()])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("run this as root"), "{err}");

    // doctor finds this agent where it is told to look: by --socket, or by the config's
    // api.socket; the default socket has none.
    let config = socket.with_extension("toml");
    std::fs::write(&config, format!("[api]\nsocket = {:?}\n", socket.to_str().unwrap())).unwrap();
    let serves = format!("(pid {}, tracerd", agent.pid());
    for how in [["--socket", socket.to_str().unwrap()], ["--config", config.to_str().unwrap()]] {
        let (_, out, _) = tracerd_output(&[&["doctor", "--no-load", "--json"][..], &how].concat());
        let checks: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{how:?}: {e}: {out}"));
        let agent_check = checks.as_array().unwrap().iter().find(|c| c["name"] == "agent").unwrap();
        let detail = agent_check["detail"].as_str().unwrap();
        assert!(detail.contains(&serves) && detail.contains(socket.to_str().unwrap()), "{how:?}: {detail}");
    }
    let _ = std::fs::remove_file(&config);

    // The socket goes with the agent; a window then has no agent to come from.
    assert!(agent.stop(libc::SIGTERM).success(), "{}", agent.stderr_text());
    assert!(!socket.exists(), "the socket outlived the agent");
    let e = report_json(&socket, &["--since", "5m"]).unwrap_err();
    assert!(e.contains("no tracerd agent serves") && e.contains("sudo tracerd run"), "{e}");

    // A socket left by an agent that died (SIGKILL) is replaced, with a warning.
    let stale = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    drop(stale);
    assert!(socket.exists());
    let again = Tracerd::run(&["--socket", socket.to_str().unwrap()]);
    assert!(again.stderr_text().contains("removing the stale API socket"), "{}", again.stderr_text());
    assert_eq!(ask(&socket, b"{\"version\":1,\"request\":\"status\"}\n")["status"]["pid"], again.pid());
}

/// `report --interval 1 --json` lines: (requests of `dev` per line, each line's span).
fn interval_lines(out: &str, dev: &str) -> Vec<(u64, Option<(f64, f64)>)> {
    out.lines()
        .map(|l| {
            let r: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"));
            let span = r["from_agent"]["from_unix_s"].as_f64().zip(r["from_agent"]["to_unix_s"].as_f64());
            (requests(&r, dev, "read") + requests(&r, dev, "write") + missed_in_lost(&r["lost"]), span)
        })
        .collect()
}

#[test]
fn report_intervals_add_up_to_the_io_attached_and_standalone() {
    require_root();
    let dev = LoopDevice::new(64);
    let agent = Tracerd::run(&["--device", &dev.name]);
    let socket = agent.socket.clone().unwrap();
    let s = socket.to_str().unwrap();
    let io = Workload { write: false, count: 4000, size: 4096, qd: 4 };
    let no_agent = format!("{s}.none");
    for (how, args) in [
        ("attached", vec!["report", "--interval", "1", "--json", "--device", &dev.name, "--socket", s]),
        (
            "standalone",
            vec!["report", "--interval", "1", "--json", "--device", &dev.name, "--socket", &no_agent],
        ),
    ] {
        let mut view = Tracerd::spawn(&args);
        let attached = view.stderr_text().contains("reading from the running agent");
        assert_eq!(attached, how == "attached", "{how}:\n{}", view.stderr_text());
        let before =
            agent.metrics().get("tracerd_io_requests_total", &[("device", &dev.name), ("op", "read")]);
        io.run(&dev);
        assert!(eventually(|| {
            let m = agent.metrics();
            m.get("tracerd_io_requests_total", &[("device", &dev.name), ("op", "read")]) - before
                + missed_completions(&m) as f64
                >= io.count as f64
        }));
        // The last IO's frame is sealed within a second; the standalone view prints its
        // interval so far on SIGINT.
        std::thread::sleep(Duration::from_millis(2500));
        assert!(view.stop(libc::SIGINT).success(), "{how}:\n{}", view.stderr_text());
        let lines = interval_lines(&view.stdout_text(), &dev.name);
        assert!(lines.len() >= 2, "{how}: {} lines", lines.len());
        assert_eq!(lines.iter().map(|l| l.0).sum::<u64>(), io.count, "{how}: {lines:?}");
        if attached {
            // Each interval starts where the last ended: no frame is shown twice or skipped.
            for pair in lines.windows(2) {
                let ((_, a), (_, b)) = (pair[0], pair[1]);
                assert_eq!(a.unwrap().1, b.unwrap().0, "{lines:?}");
            }
        }
    }
}

/// `snoop` JSON lines of one device.
fn snoop_lines(out: &str, dev: &str) -> Vec<Value> {
    out.lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .filter(|v| v["device"] == dev)
        .collect()
}

#[test]
fn snoop_streams_from_the_agent_with_filters_and_no_programs_of_its_own() {
    require_root();
    let dev = LoopDevice::new(64);
    let agent = Tracerd::run(&["--device", &dev.name]);
    let s = agent.socket.clone().unwrap();
    let s = s.to_str().unwrap();
    let programs = bpf_programs_held_by(agent.pid());
    assert_eq!(programs, tracerd::kernel::hooks::HOOKS.len(), "the agent holds a program per hook");
    let views: Vec<(&str, Vec<&str>)> = vec![
        ("all", vec!["snoop", "--json", "--device", &dev.name, "--socket", s]),
        ("text", vec!["snoop", "--device", &dev.name, "--socket", s]),
        ("iogen", vec!["snoop", "--json", "--comm", "iogen", "--socket", s]),
        ("nobody", vec!["snoop", "--json", "--pid", "1", "--socket", s]),
        ("slow", vec!["snoop", "--json", "--min-latency", "10s", "--socket", s]),
    ];
    let mut running: Vec<(&str, Tracerd)> =
        views.iter().map(|(n, args)| (*n, Tracerd::spawn(args))).collect();
    for (name, v) in &running {
        assert!(v.stderr_text().contains("reading from the running agent"), "{name}:\n{}", v.stderr_text());
    }
    for (name, v) in &running {
        assert_eq!(bpf_programs_held_by(v.pid()), 0, "{name}: an attached view loaded programs");
    }
    assert_eq!(bpf_programs_held_by(agent.pid()), programs, "five views, one copy of the programs");
    let io = Workload { write: false, count: 800, size: 4096, qd: 4 };
    io.run(&dev);
    let read = |m: &tracerd_tests::Metrics| {
        m.get("tracerd_io_requests_total", &[("device", &dev.name), ("op", "read")]) as u64
            + missed_completions(m)
    };
    assert!(eventually(|| read(&agent.metrics()) == io.count), "the agent never counted the reads");
    let missed = missed_completions(&agent.metrics());
    // Lines follow the IO within the agent's next read of the ring buffer.
    std::thread::sleep(Duration::from_millis(1000));
    for (name, v) in running.iter_mut() {
        assert!(v.stop(libc::SIGINT).success(), "{name}:\n{}", v.stderr_text());
        assert!(!v.stderr_text().contains("dropped"), "{name}: {}", v.stderr_text());
    }
    let out = |name: &str| running.iter().find(|(n, _)| *n == name).unwrap().1.stdout_text();
    let all = snoop_lines(&out("all"), &dev.name);
    assert_eq!(all.len() as u64 + missed, io.count, "one line per IO");
    assert!(all.iter().all(|l| l["comm"] == "iogen" && l["pid"].as_u64().unwrap() > 1), "{}", all[0]);
    assert!(all.iter().all(|l| l["stages_ns"]["d2c"].as_u64().is_some()), "{}", all[0]);
    let text_lines = out("text").lines().filter(|l| l.starts_with(&dev.name)).count() as u64;
    assert_eq!(text_lines + missed, io.count, "text: one row per IO");
    assert_eq!(snoop_lines(&out("iogen"), &dev.name).len(), all.len(), "--comm iogen: every IO");
    assert!(snoop_lines(&out("nobody"), &dev.name).is_empty(), "--pid 1 does no IO here");
    assert!(snoop_lines(&out("slow"), &dev.name).is_empty(), "no IO takes 10 s on a loop device");
    // With the views gone the kernel counts alone again, still exactly.
    let more = Workload { write: true, count: 300, size: 4096, qd: 2 };
    more.run(&dev);
    let written = |m: &tracerd_tests::Metrics| {
        m.get("tracerd_io_requests_total", &[("device", &dev.name), ("op", "write")]) as u64
    };
    assert!(eventually(|| written(&agent.metrics()) + missed_completions(&agent.metrics()) >= more.count));
}

/// The visible screen of a tmux session.
/// The screen line of each device's first row (None if not shown).
fn row_of(screen: &str, dev: &str) -> Option<usize> {
    screen.lines().position(|l| l.starts_with(&format!("{dev} ")))
}

#[test]
fn top_under_tmux_shows_the_devices_sorts_on_a_key_and_leaves_a_clean_terminal() {
    require_root();
    let (fast, slow) = (LoopDevice::new(64), LoopDevice::new(256));
    let agent = Tracerd::run(&["--device", &fast.name, "--device", &slow.name]);
    let socket = agent.socket.clone().unwrap();
    // Known IO all along: many small reads on one device, few large ones on the other.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load: Vec<_> = [(fast.path.clone(), 4096u64, 2000u64), (slow.path.clone(), 1 << 20, 50)]
        .into_iter()
        .map(|(path, size, count)| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    Workload { write: false, count, size, qd: 1 }.run_on(&path);
                }
            })
        })
        .collect();
    let session = format!("tracerd-top-{}", std::process::id());
    let command = format!(
        "{} top --socket {} --device {} --device {}; echo TOP-EXITED $?; sleep 600",
        tracerd_bin().display(),
        socket.display(),
        fast.name,
        slow.name
    );
    tmux(&["new-session", "-d", "-s", &session, "-x", "80", "-y", "24", &command]);
    let ordered =
        |first: &str, second: &str, screen: &str| match (row_of(screen, first), row_of(screen, second)) {
            (Some(a), Some(b)) => a < b,
            _ => false,
        };
    // Sorted by Q2C p99 at first: the device of 1 MiB reads on top.
    let mut screen = String::new();
    let shown = eventually(|| {
        screen = pane(&session);
        screen.contains("sort: Q2C p99") && ordered(&slow.name, &fast.name, &screen)
    });
    assert!(shown, "top never showed both devices, slowest first:\n{screen}");
    assert!(screen.lines().all(|l| l.chars().count() <= 80), "fits 80 columns:\n{screen}");
    let clock = |s: &str| s.lines().next().unwrap_or("").split_whitespace().nth(2).unwrap_or("").to_owned();
    let first = clock(&screen);
    assert!(
        eventually(|| clock(&pane(&session)) != first),
        "the screen never refreshed:\n{}",
        pane(&session)
    );
    // Two presses of `s`: sorted by IOPS, the device of small reads on top.
    tmux(&["send-keys", "-t", &session, "s"]);
    tmux(&["send-keys", "-t", &session, "s"]);
    let resorted = eventually(|| {
        screen = pane(&session);
        screen.contains("sort: IOPS") && ordered(&fast.name, &slow.name, &screen)
    });
    assert!(resorted, "`s` never sorted by IOPS:\n{screen}");
    tmux(&["send-keys", "-t", &session, "q"]);
    let left = eventually(|| {
        screen = pane(&session);
        screen.contains("TOP-EXITED 0")
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = Command::new("tmux").args(["kill-session", "-t", &session]).output();
    for t in load {
        t.join().unwrap();
    }
    assert!(left, "`q` did not end top with status 0:\n{screen}");
    assert!(!screen.contains("Q2C p99"), "the alternate screen was not left:\n{screen}");
}

#[test]
fn the_api_is_served_read_only_over_http_only_when_asked() {
    require_root();
    let dir = TempDir::new();
    let config = dir.file("tracerd.toml");
    std::fs::write(&config, "[api]\nhttp = true\n").unwrap();
    let with = Tracerd::run(&["--config", &config]);
    let without = Tracerd::run(&[]);
    let get = |t: &Tracerd, path: &str| tracerd_tests::http_get(t.addr.as_deref().unwrap(), path).unwrap();
    let (status, body) = get(&with, "/api/v1/status");
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((v["version"].clone(), v["status"]["pid"].clone()), (1.into(), with.pid().into()));
    let (status, body) = get(&with, "/api/v1/window?from_unix_s=0&to_unix_s=1");
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["window"]["capture"]["format"],
        "tracerd-capture"
    );
    for bad in ["/api/v1/window", "/api/v1/window?from_unix_s=5&to_unix_s=1", "/api/v1/everything"] {
        let (status, body) = get(&with, bad);
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(serde_json::from_str::<Value>(&body).unwrap()["error"].is_string(), "{bad}: {body}");
    }
    assert_eq!(get(&without, "/api/v1/status").0, 404, "off unless [api] http = true");
    assert_eq!(get(&with, "/metrics").0, 200);
}

#[test]
fn the_agent_keeps_each_minutes_slowest_ios_whole_from_few_records() {
    require_root();
    let dev = LoopDevice::new(256);
    let agent = Tracerd::run(&["--device", &dev.name]);
    let socket = agent.socket.clone().unwrap();
    // A device's first IOs are all records, until the agent's next tick gives it a series, and
    // each minute's bar starts low: a low bar sends whatever completes before the agent's next
    // read, up to its idle poll (320 ms) away after a pause. Both are as many IOs as the disk
    // does in that time, whatever the bar does later. So the measured IOs fall in one minute,
    // after reads like the fast ones have raised the bar and given the device its series; only
    // the records after those count.
    let second = unix_now() as u64 % 60;
    if second > 45 {
        std::thread::sleep(Duration::from_secs(61 - second));
    }
    let prime = Workload { write: false, count: 2000, size: 4096, qd: 4 };
    prime.run(&dev);
    let mut primed = 0;
    let ready = eventually(|| {
        let report = report_json(&socket, &["--since", "10m", "--device", &dev.name]).unwrap_or_default();
        primed = requests(&report, &dev.name, "read");
        primed >= prime.count && agent.metrics().get("tracerd_kernel_series", &[("state", "used")]) >= 1.0
    });
    assert!(ready, "the device never got a series: {primed} reads of {} seen", prime.count);
    let records_before = agent.metrics().get("tracerd_records_total", &[]);
    let fast = Workload { write: false, count: 3000, size: 4096, qd: 4 };
    // 4 MiB reads: split into requests far slower than the 4 KiB ones.
    let slow = Workload { write: false, count: 20, size: 4 << 20, qd: 1 };
    // Each iogen lives to the end, so that the agent can name it (from /proc) as the submitter
    // of the slow IOs the kernel counted.
    let _submitters = [fast.run_held(&dev), slow.run_held(&dev), fast.run_held(&dev)];
    let mut last = Value::Null;
    let kept = eventually(|| {
        last = report_json(&socket, &["--since", "10m", "--device", &dev.name]).unwrap_or_else(Value::String);
        let ios = last["slowest"]
            .as_array()
            .map_or(0, |m| m.iter().map(|m| m["ios"].as_array().unwrap().len()).sum());
        requests(&last, &dev.name, "read") >= primed + 2 * fast.count + slow.count && ios >= 10
    });
    assert!(kept, "the agent never kept 10 slow IOs (waited {HANG:?}):\n{last:#}");
    let mut slowest: Vec<&Value> =
        last["slowest"].as_array().unwrap().iter().flat_map(|m| m["ios"].as_array().unwrap()).collect();
    slowest.sort_by_key(|s| std::cmp::Reverse(s["took_ns"].as_u64().unwrap()));
    // The slowest IO of the window is kept: the window's Q2C histogram (kernel buckets, each
    // bound at most 1.28 times the one below, at their middles) has its maximum in the bucket of
    // the slowest kept IO. (Which IOs are slowest is the machine's business: on a busy one a
    // 4 KiB read can stall longer than a 512 KiB one.)
    let top = slowest[0]["took_ns"].as_u64().unwrap() as f64;
    let max = op(&last, &dev.name, "read").unwrap()["stages"]["q2c"]["max_s"].as_f64().unwrap() * 1e9;
    assert!((0.85..=1.15).contains(&(max / top)), "window max Q2C {max} ns, slowest kept {top} ns");
    for s in &slowest[..10] {
        let io = &s["io"];
        assert_eq!(io["device"], dev.name.as_str());
        assert_eq!(io["stages_ns"]["q2c"], s["took_ns"], "took is the IO's Q2C: {s}");
        // The comm is read from /proc when the record arrives: "?" if iogen had exited.
        assert!(io["pid"].as_u64().unwrap() > 1 && (io["comm"] == "iogen" || io["comm"] == "?"), "{io}");
        assert!(io["stages_ns"]["d2c"].as_u64().is_some() && io["sector"].is_u64(), "{io}");
    }
    assert!(slowest[..10].iter().any(|s| s["io"]["comm"] == "iogen"), "who did it: {}", slowest[0]);
    // The kernel sent records only for IOs above the bar: far fewer than the IOs done. (While
    // the bar is at its floor each such record wakes the agent, so it rises within a read; a
    // poll later, most of a run of fast IOs would have come whole.)
    let records = agent.metrics().get("tracerd_records_total", &[]) - records_before;
    let ios = (requests(&last, &dev.name, "read") - primed) as f64;
    assert!(records < ios / 5.0, "{records} records for {ios} IOs");
    let text = tracerd_output(&[
        "report",
        "--since",
        "10m",
        "--device",
        &dev.name,
        "--socket",
        socket.to_str().unwrap(),
    ])
    .1;
    assert!(text.contains(&format!("{}: slowest IOs", dev.name)) && text.contains("iogen"), "{text}");
}
