//! The metrics endpoint under bad clients, concurrent scrapes, TLS and basic auth (with curl).

use std::{
    io::{Read, Write},
    net::TcpStream,
    path::Path,
    process::Command,
};

use tracerd_tests::{
    HANG, LoopDevice, Metrics, Tracerd, Workload, eventually, free_port, http_get, missed_completions,
    require_root, tracerd_output,
};

/// Sends raw bytes, returns the status line of the answer ("" if the server closed silently).
fn raw(addr: &str, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    // Only a hang reaches this: tracerd answers each of these at once.
    s.set_read_timeout(Some(HANG)).unwrap();
    let _ = s.write_all(request);
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    answer.lines().next().unwrap_or("").to_owned()
}

#[test]
fn bad_clients_cannot_stall_it_and_concurrent_scrapes_are_consistent() {
    require_root();
    let dev = LoopDevice::new(64);
    let agent = Tracerd::run(&["--device", &dev.name]);
    let addr = agent.addr.clone().unwrap();

    // Slow clients: connections that send half a request line and then nothing.
    let slow: Vec<TcpStream> = (0..16)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.write_all(b"GET /met").unwrap();
            s
        })
        .collect();
    let (status, body) = http_get(&addr, "/metrics").expect("a scrape while slow clients hang");
    assert_eq!(status, 200);
    assert!(body.contains("tracerd_build_info"));

    assert_eq!(raw(&addr, &[b'A'; 64 * 1024]), "HTTP/1.1 431 Request Header Fields Too Large");
    let huge_header = format!("GET /metrics HTTP/1.1\r\nX-Junk: {}\r\n\r\n", "x".repeat(20_000));
    assert_eq!(raw(&addr, huge_header.as_bytes()), "HTTP/1.1 431 Request Header Fields Too Large");
    assert_eq!(raw(&addr, b"\x00\xff\xfe garbage\r\n\r\n"), "HTTP/1.1 405 Method Not Allowed");
    assert_eq!(raw(&addr, b"POST /metrics HTTP/1.1\r\n\r\n"), "HTTP/1.1 405 Method Not Allowed");
    assert_eq!(raw(&addr, b"GET /../../etc/passwd HTTP/1.1\r\n\r\n"), "HTTP/1.1 404 Not Found");
    assert_eq!(raw(&addr, b"GET /debug/pprof HTTP/1.1\r\n\r\n"), "HTTP/1.1 404 Not Found");

    // Scrapes from 6 threads while IO runs: every snapshot is internally consistent.
    let scrapers: Vec<_> = (0..6)
        .map(|_| {
            let (addr, dev) = (addr.clone(), dev.name.clone());
            std::thread::spawn(move || {
                for _ in 0..25 {
                    let (status, body) = http_get(&addr, "/metrics").expect("scrape");
                    assert_eq!(status, 200);
                    let m = Metrics::parse(&body);
                    let requests = m.get("tracerd_io_requests_total", &[("device", &dev), ("op", "read")]);
                    let l = [("device", dev.as_str()), ("op", "read"), ("stage", "q2c")];
                    assert_eq!(m.get("tracerd_io_stage_seconds_count", &l), requests, "one snapshot");
                    let inf = [("device", dev.as_str()), ("op", "read"), ("stage", "q2c"), ("le", "+Inf")];
                    assert_eq!(m.get("tracerd_io_stage_seconds_bucket", &inf), requests, "one snapshot");
                }
            })
        })
        .collect();
    Workload { write: false, count: 3000, size: 4096, qd: 8 }.run(&dev);
    for s in scrapers {
        s.join().expect("a scraper saw an inconsistent snapshot");
    }
    drop(slow);
    // Counted reads, and any the kernel skipped the completion program for (missed_completions).
    let reads = || {
        let m = agent.metrics();
        m.get("tracerd_io_requests_total", &[("device", &dev.name), ("op", "read")])
            + missed_completions(&m) as f64
    };
    assert!(eventually(|| reads() == 3000.0), "{} of 3000 reads counted (waited {HANG:?})", reads());
}

fn curl(args: &[&str]) -> (bool, String) {
    // --max-time only bounds a hang.
    let max_time = HANG.as_secs().to_string();
    let out = Command::new("curl").args(["-s", "--max-time", &max_time]).args(args).output().expect("curl");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn tls_and_basic_auth_with_curl() {
    require_root();
    let dir = std::env::temp_dir().join(format!("tracerd-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let ok = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "1",
        ])
        .args(["-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("openssl");
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    std::fs::write(dir.join("password"), "s3cret\n").unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let config = |cert: &Path| {
        format!(
            "listen = \"{addr}\"\n[http]\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n\
             basic_auth_username = \"prometheus\"\nbasic_auth_password_file = \"{}\"\n",
            cert.display(),
            key.display(),
            dir.join("password").display()
        )
    };
    let cfg = dir.join("tracerd.toml");
    std::fs::write(&cfg, config(&cert)).unwrap();

    let dev = LoopDevice::new(64);
    let _agent = Tracerd::spawn(&["run", "--config", cfg.to_str().unwrap(), "--device", &dev.name]);
    let url = format!("https://{addr}");
    let ca = ["--cacert", cert.to_str().unwrap()];
    let code = |extra: &[&str], path: &str| {
        let target = format!("{url}{path}");
        let mut args: Vec<&str> = ca.to_vec();
        args.extend_from_slice(extra);
        args.extend_from_slice(&["-o", "/dev/null", "-w", "%{http_code}", &target]);
        curl(&args).1
    };
    // The listener comes up with the session.
    assert!(eventually(|| code(&[], "/healthz") == "200"), "no /healthz over TLS (waited {HANG:?})");
    assert_eq!(code(&[], "/metrics"), "401", "no credentials");
    assert_eq!(code(&["-u", "prometheus:wrong"], "/metrics"), "401", "wrong password");
    assert_eq!(code(&["-u", "nobody:s3cret"], "/metrics"), "401", "wrong user");
    assert_eq!(code(&["-u", "prometheus:s3cret"], "/metrics"), "200");
    let (ok, body) =
        curl(&["--cacert", cert.to_str().unwrap(), "-u", "prometheus:s3cret", &format!("{url}/metrics")]);
    assert!(ok && body.contains("tracerd_build_info"), "{body}");
    let (ok, _) = curl(&[&format!("http://{addr}/metrics")]);
    assert!(!ok, "plain HTTP to the TLS port must not be answered");
    drop(_agent);

    // A bad certificate path is refused at start, naming the key.
    std::fs::write(&cfg, config(&dir.join("missing.pem"))).unwrap();
    let (status, _, err) = tracerd_output(&["run", "--config", cfg.to_str().unwrap(), "--device", &dev.name]);
    assert!(!status.success() && err.contains("http.tls_cert_file"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn version_and_build_info_name_the_commit_and_the_ebpf_object_loaded() {
    require_root();
    let (status, out, err) = tracerd_output(&["--version"]);
    assert!(status.success(), "{err}");
    // "tracerd 0.1.0 (commit 0123456789ab, eBPF object sha256:<64 hex>)"
    let line = out.trim();
    let (commit, sha) = line
        .strip_prefix(&format!("tracerd {} (commit ", env!("CARGO_PKG_VERSION")))
        .and_then(|rest| rest.strip_suffix(')'))
        .and_then(|rest| rest.split_once(", eBPF object sha256:"))
        .unwrap_or_else(|| panic!("unexpected --version: {line}"));
    assert!(sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()), "{line}");
    // The object embedded is the one built: its hash, computed here by coreutils.
    let object = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tracer-ebpf/target/bpfel-unknown-none/release/tracer-ebpf");
    let sum = Command::new("sha256sum").arg(&object).output().expect("sha256sum");
    let sum = String::from_utf8_lossy(&sum.stdout);
    assert_eq!(Some(sha), sum.split_whitespace().next(), "{line} against {}", object.display());
    assert!(!commit.is_empty() && commit != "unknown", "a build from git knows its commit: {line}");
    let agent = Tracerd::run(&[]);
    let m = agent.metrics();
    let info = [("version", env!("CARGO_PKG_VERSION")), ("commit", commit), ("ebpf_sha256", sha)];
    assert_eq!(m.sum("tracerd_build_info", &info), 1.0, "{m:?}");
}
