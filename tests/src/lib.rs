//! Harness for tracerd's integration tests: loop devices on /dev/shm, the real tracerd binary,
//! the iogen workload generator, and a Prometheus text parser. Everything created is removed
//! on drop, also when a test fails.

use std::{
    collections::BTreeMap,
    fs,
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

/// The integration tests load programs into the running kernel: they need root.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "these tests load eBPF programs and create loop devices: run them as root (sudo cargo xtask test)"
    );
}

pub fn tracerd_bin() -> PathBuf {
    std::env::var_os("TRACERD_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/tracerd"))
}

/// iogen, built beside the test binaries (target/<profile>/iogen).
pub fn iogen_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>");
    profile_dir.join("iogen")
}

pub mod kernels;
pub mod prometheus;

fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

fn cmd_output(cmd: &mut Command) -> String {
    let out = cmd.output().expect("spawn");
    assert!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A loop device backed by a file on /dev/shm.
pub struct LoopDevice {
    /// Kernel name (loop3).
    pub name: String,
    /// /dev/loop3
    pub path: String,
    backing: PathBuf,
}

impl LoopDevice {
    pub fn new(size_mib: u64) -> LoopDevice {
        LoopDevice::create(size_mib, &[])
    }

    fn create(size_mib: u64, losetup_flags: &[&str]) -> LoopDevice {
        let backing = PathBuf::from("/dev/shm").join(unique("tracerd-test") + ".img");
        let f = fs::File::create(&backing).expect("backing file");
        f.set_len(size_mib << 20).expect("size backing file");
        let path =
            cmd_output(Command::new("losetup").args(["--find", "--show"]).args(losetup_flags).arg(&backing));
        // LOOP_CONFIGURE scans partitions (with --partscan) before losetup returns, and nothing
        // else here reads a new device: it is ready now.
        let name = path.trim_start_matches("/dev/").to_owned();
        LoopDevice { name, path, backing }
    }
}

impl LoopDevice {
    /// A loop device with a DOS label and `parts` partitions of `part_mib` each; returns the
    /// partitions' kernel names too (loop3p1, ...).
    pub fn partitioned(size_mib: u64, parts: usize, part_mib: u64) -> (LoopDevice, Vec<String>) {
        // partscan: the kernel reads the partition table sfdisk writes.
        let dev = LoopDevice::create(size_mib, &["--partscan"]);
        let script = format!("label: dos\n{}", format!(",{part_mib}M\n").repeat(parts));
        let mut child = Command::new("sfdisk")
            .args(["--quiet", &dev.path])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("sfdisk (fdisk package)");
        child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
        assert!(child.wait().unwrap().success(), "sfdisk failed");
        let names: Vec<String> = (1..=parts).map(|i| format!("{}p{i}", dev.name)).collect();
        let present = || names.iter().all(|n| std::path::Path::new(&format!("/dev/{n}")).exists());
        // sfdisk's BLKRRPART has the kernel rescan before it returns; kernels built without
        // partition-table parsers (this host's) need them added by BLKPG instead.
        if !present() {
            let _ = Command::new("partx").args(["--add", &dev.path]).status();
        }
        assert!(eventually(present), "partitions {names:?} never appeared (waited {HANG:?}: a hang)");
        (dev, names)
    }
}

impl LoopDevice {
    /// A loop device never used before in this boot (LOOP_CTL_ADD of an index past the usual
    /// ones), removed from the system on drop: a fresh block device inode, whose page cache
    /// no earlier writer has claimed for its cgroup (cgroup writeback keeps an inode's first
    /// dirtier's).
    pub fn fresh(size_mib: u64) -> FreshLoopDevice {
        const LOOP_CTL_ADD: libc::Ioctl = 0x4C80;
        let ctl = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/loop-control")
            .expect("/dev/loop-control");
        let fd = std::os::fd::AsRawFd::as_raw_fd(&ctl);
        let mut index = 4096 + std::process::id() as libc::c_long % 4096;
        // SAFETY: ioctls on an fd we own, with an integer argument.
        while unsafe { libc::ioctl(fd, LOOP_CTL_ADD, index) } < 0 {
            assert_eq!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::EEXIST),
                "LOOP_CTL_ADD {index}"
            );
            index += 1;
        }
        let path = format!("/dev/loop{index}");
        assert!(eventually(|| std::path::Path::new(&path).exists()), "{path} never appeared");
        let backing = PathBuf::from("/dev/shm").join(unique("tracerd-test") + ".img");
        fs::File::create(&backing).expect("backing file").set_len(size_mib << 20).expect("size backing file");
        cmd_output(Command::new("losetup").arg(&path).arg(&backing));
        FreshLoopDevice(LoopDevice { name: format!("loop{index}"), path, backing })
    }
}

/// A [`LoopDevice::fresh`] one: detached, then removed, on drop (the inner device's own drop
/// then finds nothing to detach).
pub struct FreshLoopDevice(pub LoopDevice);

impl Drop for FreshLoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0.path]).output();
        remove_loop_device(&self.0.name);
    }
}

/// Removes a detached loop device from the system (LOOP_CTL_REMOVE): unlike `losetup -d`,
/// which leaves an empty /dev/loopN, the device then leaves /sys/class/block.
pub fn remove_loop_device(name: &str) {
    const LOOP_CTL_REMOVE: libc::Ioctl = 0x4C81;
    let index: libc::c_long = name.trim_start_matches("loop").parse().expect("loopN");
    let ctl =
        fs::OpenOptions::new().read(true).write(true).open("/dev/loop-control").expect("/dev/loop-control");
    // SAFETY: an ioctl on an fd we own, with an integer argument.
    let rc = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&ctl), LOOP_CTL_REMOVE, index) };
    assert_eq!(rc, 0, "LOOP_CTL_REMOVE {name}: {}", std::io::Error::last_os_error());
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.path]).output();
        let _ = fs::remove_file(&self.backing);
    }
}

/// A directory under the system temp dir, removed with its files on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        let dir = std::env::temp_dir().join(unique("tracerd-test-dir"));
        fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }

    /// A path in the directory, as a string for command lines.
    pub fn file(&self, name: &str) -> String {
        self.0.join(name).to_str().expect("UTF-8 temp path").to_owned()
    }
}

impl Default for TempDir {
    fn default() -> Self {
        TempDir::new()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// An iogen whose IOs are done, kept running until dropped (`Workload::run_held`).
pub struct Held(Child);

impl Drop for Held {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}

/// What iogen did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    pub write: bool,
    pub count: u64,
    pub size: u64,
    pub qd: u64,
}

impl Workload {
    pub fn bytes(&self) -> u64 {
        self.count * self.size
    }

    pub fn op(&self) -> &'static str {
        if self.write { "write" } else { "read" }
    }

    /// iogen's arguments for this workload on `path`.
    fn iogen_args(&self, path: &str) -> [String; 5] {
        [path.into(), self.op().into(), self.count.to_string(), self.size.to_string(), self.qd.to_string()]
    }

    /// Runs the workload with O_DIRECT on `dev`; panics unless every IO succeeded.
    pub fn run(&self, dev: &LoopDevice) {
        self.run_on(&dev.path)
    }

    /// Runs the workload on `dev` and returns once its IOs are done, iogen still running until
    /// the `Held` is dropped: the agent names the submitter of an IO it counted in the kernel
    /// from /proc when the IO's record arrives, and an exited process is no longer there.
    pub fn run_held(&self, dev: &LoopDevice) -> Held {
        let mut child = Command::new(iogen_bin())
            .args(self.iogen_args(&dev.path))
            .arg("hold")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn iogen");
        let mut line = String::new();
        let _ = std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        );
        assert!(line.starts_with('{'), "iogen failed: {:?}", child.wait());
        Held(child)
    }

    /// Runs the workload on a device node (`/dev/loop3p1`).
    pub fn run_on(&self, path: &str) {
        let out = Command::new(iogen_bin()).args(self.iogen_args(path)).output().expect("spawn iogen");
        assert!(out.status.success(), "iogen failed: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// A tracerd process; killed on drop if still running.
pub struct Tracerd {
    child: Child,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
    pub addr: Option<String>,
    /// The agent's API socket (`run`), or the one a view looked for an agent on.
    pub socket: Option<PathBuf>,
    /// The agent's recorder store when the test gave it one of its own (removed on drop).
    pub store: Option<PathBuf>,
    /// Whether `socket` is one `with_own_socket` made (removed on drop: a killed agent leaves
    /// its socket file behind).
    own_socket: bool,
}

/// The args with a socket of this test's own when they name none: tests run in parallel, and
/// each agent must serve its own socket, each view find only the agent it was given. An agent
/// (`run`) also gets a recorder store of its own (see `own_store`).
pub fn with_own_socket(args: &[&str]) -> (Vec<String>, Option<PathBuf>) {
    let mut out: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    if let Some(store) = own_store(args) {
        out.push("--store".into());
        out.push(store.display().to_string());
    }
    let takes_socket = args.first().is_some_and(|c| ["run", "report", "snoop"].contains(c));
    if let Some(at) = args.iter().position(|a| *a == "--socket") {
        return (out, args.get(at + 1).map(PathBuf::from));
    }
    if !takes_socket {
        return (out, None);
    }
    let socket = std::env::temp_dir().join(unique("tracerd-api")).with_extension("sock");
    out.push("--socket".into());
    out.push(socket.display().to_string());
    (out, Some(socket))
}

/// A store directory of the test's own for `run` unless the args name one (`--store`,
/// `--no-store`, or a config file, whose `[store]` the test then sets): agents of tests that
/// run in parallel must not share the default one, nor leave history in it.
pub fn own_store(args: &[&str]) -> Option<PathBuf> {
    let names_one = args.iter().any(|a| ["--store", "--no-store"].contains(a));
    let config_names_one = args
        .iter()
        .position(|a| *a == "--config")
        .and_then(|at| fs::read_to_string(args.get(at + 1)?).ok())
        .is_some_and(|text| text.lines().any(|l| l.trim() == "[store]"));
    (args.first() == Some(&"run") && !names_one && !config_names_one)
        .then(|| std::env::temp_dir().join(unique("tracerd-store")))
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Tracerd {
    /// Starts `tracerd ARGS`, waiting until it has attached its programs.
    pub fn spawn(args: &[&str]) -> Tracerd {
        Tracerd::spawn_under(&[], args)
    }

    /// Starts `WRAPPER... tracerd ARGS` (a wrapper that execs it, such as setpriv), waiting
    /// until it has attached its programs.
    pub fn spawn_under(wrapper: &[&str], args: &[&str]) -> Tracerd {
        let cmd = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(tracerd_bin());
                c
            }
            None => Command::new(tracerd_bin()),
        };
        Tracerd::spawn_command(cmd, args)
    }

    /// `BINARY run` on a free loopback port, serving /metrics: a tracerd other than the one
    /// built here (the one a package installed).
    pub fn run_binary(binary: &Path, extra: &[&str]) -> Tracerd {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut args = vec!["run", "--listen", &addr];
        args.extend_from_slice(extra);
        let mut t = Tracerd::spawn_command(Command::new(binary), &args);
        let healthy = eventually(|| http_get(&addr, "/healthz").map(|(s, _)| s) == Some(200));
        assert!(healthy, "{} never answered /healthz:\n{}", binary.display(), t.stderr_text());
        t.addr = Some(addr);
        t
    }

    fn spawn_command(mut cmd: Command, args: &[&str]) -> Tracerd {
        let stdout = std::env::temp_dir().join(unique("tracerd-stdout"));
        let stderr = std::env::temp_dir().join(unique("tracerd-stderr"));
        let own_socket = !args.contains(&"--socket");
        let (args, socket) = with_own_socket(args);
        let store = args.iter().position(|a| a == "--store").map(|at| PathBuf::from(&args[at + 1]));
        let store = store.filter(|s| s.starts_with(std::env::temp_dir()) && own_store_name(s));
        let child = cmd
            .args(&args)
            .stdin(Stdio::null())
            .stdout(fs::File::create(&stdout).unwrap())
            .stderr(fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", cmd.get_program()));
        let mut t = Tracerd { child, stdout, stderr, addr: None, socket, store, own_socket };
        // The session's line, logged once every hook is attached and the devices are set; a
        // view that found an agent says so instead.
        t.wait_for_stderr(&["hooks; tracing", "reading from the running agent"]);
        t
    }

    /// `tracerd run` on a free loopback port, serving /metrics.
    pub fn run(extra: &[&str]) -> Tracerd {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut args = vec!["run", "--listen", &addr];
        args.extend_from_slice(extra);
        let mut t = Tracerd::spawn(&args);
        let healthy = eventually(|| http_get(&addr, "/healthz").map(|(s, _)| s) == Some(200));
        assert!(healthy, "tracerd never answered /healthz (waited {HANG:?}: a hang):\n{}", t.stderr_text());
        t.addr = Some(addr);
        t
    }

    pub fn stderr_text(&self) -> String {
        fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn stdout_text(&self) -> String {
        fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    fn wait_for_stderr(&mut self, needles: &[&str]) {
        let deadline = Instant::now() + HANG;
        loop {
            if needles.iter().any(|n| self.stderr_text().contains(n)) {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("tracerd exited ({status}) before any of {needles:?}:\n{}", self.stderr_text());
            }
            assert!(
                Instant::now() < deadline,
                "tracerd never logged any of {needles:?} (waited {HANG:?}: a hang):\n{}",
                self.stderr_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends a signal and waits for the exit. `report` and `snoop` drain the ring buffer before
    /// they exit, so every IO that completed before the signal is in their output.
    pub fn stop(&mut self, signal: i32) -> ExitStatus {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.pid(), signal) };
        self.wait()
    }

    /// Waits for the process to exit.
    pub fn wait(&mut self) -> ExitStatus {
        let deadline = Instant::now() + HANG;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "tracerd did not exit (waited {HANG:?}: a hang):\n{}",
                self.stderr_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn metrics(&self) -> Metrics {
        let addr = self.addr.as_deref().expect("not a `run` instance");
        let (status, body) = http_get(addr, "/metrics").expect("scrape");
        assert_eq!(status, 200);
        Metrics::parse(&body)
    }
}

impl Drop for Tracerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_file(&self.stdout);
        let _ = fs::remove_file(&self.stderr);
        if let Some(store) = &self.store {
            let _ = fs::remove_dir_all(store);
        }
        if let Some(socket) = self.socket.as_ref().filter(|_| self.own_socket) {
            let _ = fs::remove_file(socket);
        }
    }
}

/// Whether a store path is one `own_store` made.
fn own_store_name(path: &Path) -> bool {
    path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("tracerd-store"))
}

/// Runs tracerd to completion (for error cases): (exit status, stdout, stderr).
pub fn tracerd_output(args: &[&str]) -> (ExitStatus, String, String) {
    let (args, _) = with_own_socket(args);
    let out = Command::new(tracerd_bin()).args(&args).stdin(Stdio::null()).output().expect("spawn tracerd");
    if let Some(at) = args.iter().position(|a| a == "--store") {
        let store = Path::new(&args[at + 1]);
        if own_store_name(store) {
            let _ = fs::remove_dir_all(store);
        }
    }
    (out.status, String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// A minimal HTTP GET: (status, body). HTTP/1.0, so no server (tracerd, Prometheus) answers
/// with chunked encoding, and the body ends with the connection.
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(HANG)).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    let status = resp.split_whitespace().nth(1)?.parse().ok()?;
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    Some((status, body))
}

/// Parsed Prometheus text exposition: (name, sorted labels) -> value.
#[derive(Debug, Default)]
pub struct Metrics {
    pub samples: BTreeMap<(String, BTreeMap<String, String>), f64>,
}

impl Metrics {
    pub fn parse(text: &str) -> Metrics {
        let mut m = Metrics::default();
        for line in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
            let (series, value) = line.rsplit_once(' ').expect("sample line");
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, parse_labels(rest.strip_suffix('}').expect("closing brace"))),
                None => (series, BTreeMap::new()),
            };
            let value = match value {
                "+Inf" => f64::INFINITY,
                v => v.parse().unwrap_or_else(|_| panic!("bad value in {line}")),
            };
            m.samples.insert((name.to_owned(), labels), value);
        }
        m
    }

    /// The sample with exactly these labels (0 if absent: counters start at zero).
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let labels: BTreeMap<String, String> =
            labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.samples.get(&(name.to_owned(), labels)).copied().unwrap_or(0.0)
    }

    /// Sum over samples of `name` whose labels include `labels`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|((n, l), _)| {
                n == name && labels.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|(_, v)| v)
            .sum()
    }
}

fn parse_labels(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut chars = s.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
        if key.is_empty() {
            return out;
        }
        assert_eq!(chars.next(), Some('"'));
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(c) => value.push(c),
                    None => break,
                },
                '"' => break,
                c => value.push(c),
            }
        }
        out.insert(key.trim_start_matches(',').to_owned(), value);
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
}

/// IOs whose completion the kernel did not run tracerd's program for (docs/internals/missed-completions.md:
/// `missed_completion`, about 1 in 50,000 IOs on this project's host, never seen in the VM).
/// tracerd counts each when its request is issued again, or as `stale_request` if it was among
/// the last. A test's exact per-IO assertions cannot hold in a run with one; such a test checks
/// instead that traced + missed is what was issued, says so ([`note_missed`]), and skips them.
pub fn missed_completions(m: &Metrics) -> u64 {
    MISSED_REASONS.map(|r| m.get("tracerd_events_lost_total", &[("reason", r)]) as u64).iter().sum()
}

/// The lost-event reasons of a missed completion: seen at the request's next issue, or swept.
pub const MISSED_REASONS: [&str; 2] = ["missed_completion", "stale_request"];

/// What doctor's `verifier` check names: the program, the instructions the verifier processed
/// of it, and their share of its limit in per cent.
pub fn verifier_figures(check: &serde_json::Value) -> (String, u64, u64) {
    let detail = check["detail"].as_str().unwrap_or_default();
    let number = |after: &str| -> u64 {
        let text = detail.split(after).nth(1).and_then(|t| t.split(' ').next());
        text.and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("no number after {after:?}: {check}"))
    };
    let program = detail.split(", ").nth(1).unwrap_or_default().to_owned();
    (program, number(" took "), number(" instructions ("))
}

/// [`missed_completions`] from the `lost` object of `report --json` or a capture.
pub fn missed_in_lost(lost: &serde_json::Value) -> u64 {
    MISSED_REASONS.iter().filter_map(|r| lost[*r].as_u64()).sum()
}

/// [`missed_completions`] from `report`'s text (`lost events: missed_completion 1, ...`) or
/// `snoop`'s exit warning (`lost events: [("missed_completion", 1)]`).
pub fn missed_in_text(text: &str) -> u64 {
    let Some(line) = text.lines().rev().find(|l| l.contains("lost events:")) else { return 0 };
    let line = crate::strip_escapes(line);
    MISSED_REASONS
        .iter()
        .filter_map(|r| {
            let rest = &line[line.find(r)? + r.len()..];
            rest.trim_start_matches(['"', ',', ' '])
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

pub fn strip_escapes(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Says that a test skipped its exact per-IO assertions because of [`missed_completions`].
pub fn note_missed(test: &str, missed: u64) {
    eprintln!(
        "{test}: the kernel did not run tracerd's completion program for {missed} IO(s) (counted \
         as missed completions; docs/internals/missed-completions.md): traced + missed == issued was checked, the \
         exact per-IO assertions are skipped in this run"
    );
}

/// BPF programs a process holds (its `anon_inode:bpf-prog` descriptors): per process, what
/// `bpftool prog show` lists with `pids` where bpftool is built with them (it is not here).
pub fn bpf_programs_held_by(pid: i32) -> usize {
    fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.flatten()
                .filter(|fd| {
                    fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == "anon_inode:bpf-prog")
                })
                .count()
        })
        .unwrap_or(0)
}

/// Runs of the kprobe programs (BPF_PROG_TYPE_KPROBE) that process `pid` holds, summed from
/// their fdinfo; the kernel counts them only while `kernel.bpf_stats_enabled` is 1.
pub fn kprobe_runs_of(pid: i32) -> u64 {
    program_stats_of(pid, &[BPF_PROG_TYPE_KPROBE]).0
}

pub const BPF_PROG_TYPE_KPROBE: u32 = 2;
/// raw_tp and tp_btf programs: the agent's tracepoint hooks.
pub const BPF_PROG_TYPES_TRACEPOINT: [u32; 2] = [17, 26];

/// Runs and run time (ns) of the programs of these types that process `pid` holds, summed
/// from their fdinfo; counted only while `kernel.bpf_stats_enabled` is 1.
pub fn program_stats_of(pid: i32, types: &[u32]) -> (u64, u64) {
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else { return (0, 0) };
    let field = |info: &str, name: &str| -> u64 {
        info.lines().find_map(|l| l.strip_prefix(name)).and_then(|n| n.trim().parse().ok()).unwrap_or(0)
    };
    fds.flatten()
        .filter(|fd| fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == "anon_inode:bpf-prog"))
        .filter_map(|fd| {
            fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.file_name().to_string_lossy())).ok()
        })
        .filter(|info| types.contains(&(field(info, "prog_type:") as u32)))
        .fold((0, 0), |(runs, ns), info| (runs + field(&info, "run_cnt:"), ns + field(&info, "run_time_ns:")))
}

/// The text of a tmux session's pane, as a user sees it.
pub fn pane(session: &str) -> String {
    let out = Command::new("tmux").args(["capture-pane", "-p", "-t", session]).output().expect("tmux");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `tmux ARGS`, which must succeed.
pub fn tmux(args: &[&str]) {
    // CI runs without a terminal: tmux gets a TERM to describe its panes by.
    let term = std::env::var("TERM").ok().filter(|t| !t.is_empty() && t != "dumb");
    let out = Command::new("tmux")
        .args(args)
        .env("TERM", term.as_deref().unwrap_or("xterm-256color"))
        .output()
        .expect("tmux (apt install tmux)");
    assert!(out.status.success(), "tmux {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// How long a test waits for something that must happen before it calls it a hang. Only a
/// hang may fail a test on time: no assertion depends on how fast the IO or tracerd runs, so
/// this is far above what the slowest machine (a TCG guest on a loaded host) needs.
pub const HANG: Duration = Duration::from_secs(300);

/// Polls `f` until it returns true, or [`HANG`] passes (then false: the caller says what hung).
pub fn eventually(mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + HANG;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_exposition_with_escapes() {
        let m = Metrics::parse(
            "# HELP x y\nx_total{a=\"1\",b=\"q\\\"u\\\\o\"} 3\nup 1\nh_bucket{le=\"+Inf\"} 2\n",
        );
        assert_eq!(m.get("x_total", &[("a", "1"), ("b", "q\"u\\o")]), 3.0);
        assert_eq!(m.get("up", &[]), 1.0);
        assert_eq!(m.sum("h_bucket", &[("le", "+Inf")]), 2.0);
        assert_eq!(m.get("missing", &[]), 0.0);
    }

    #[test]
    fn missed_completions_from_every_output() {
        let m = Metrics::parse(
            "tracerd_events_lost_total{reason=\"missed_completion\"} 2\ntracerd_events_lost_total{reason=\"stale_request\"} 1\ntracerd_events_lost_total{reason=\"ringbuf_full\"} 5\n",
        );
        assert_eq!(missed_completions(&m), 3);
        assert_eq!(missed_in_lost(&serde_json::json!({"missed_completion": 1, "ringbuf_full": 4})), 1);
        assert_eq!(
            missed_in_text("x\nlost events: \x1b[31mmissed_completion 2, stale_request 1\x1b[39m\n"),
            3
        );
        assert_eq!(missed_in_text("WARN lost events: [(\"missed_completion\", 4)]"), 4);
        assert_eq!(missed_in_text("lost events: none"), 0);
    }
}
