//! What `cargo xtask dist` ships, installed and run the way a fleet does: the Debian package
//! with dpkg, the OCI image under podman. Both trace a loop device of this machine exactly.
//! `cargo xtask test` builds the artifacts first; alone, run `cargo xtask dist`.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use tracerd_tests::{
    LoopDevice, Metrics, TempDir, Tracerd, Workload, eventually, free_port, http_get, require_root,
};

const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The image's name, as `xtask/src/dist.rs` gives it and the DaemonSet runs it.
const IMAGE: &str = "localhost/tracerd";

fn dist_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/dist")
}

/// An artifact of `cargo xtask dist`; a clear failure where it was not built.
fn artifact(name: &str) -> PathBuf {
    let path = dist_dir().join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask dist` first (`cargo xtask test` does)",
        path.display()
    );
    path
}

/// Runs a command to success; its stdout.
fn sh(program: &str, args: &[&str]) -> String {
    let out =
        Command::new(program).args(args).output().unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn installed() -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", "tracerd"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("ok installed"))
}

/// Reads on a loop device, counted by an agent whose /metrics is at `addr`: exactly `n`.
fn reads_counted(metrics: impl Fn() -> Option<Metrics>, dev: &LoopDevice, n: u64) -> f64 {
    Workload { write: false, count: n, size: 4096, qd: 4 }.run(dev);
    let requests = || {
        metrics().map_or(-1.0, |m| {
            m.get("tracerd_io_requests_total", &[("device", dev.name.as_str()), ("op", "read")])
        })
    };
    eventually(|| requests() == n as f64);
    requests()
}

/// A copy of the package at another version: the upgrade's "newer package".
fn repacked(deb: &Path, version: &str, dir: &TempDir) -> PathBuf {
    let root = dir.0.join("root");
    sh("dpkg-deb", &["-R", deb.to_str().unwrap(), root.to_str().unwrap()]);
    let control = root.join("DEBIAN/control");
    let text = fs::read_to_string(&control)
        .unwrap()
        .replace(&format!("Version: {VERSION}\n"), &format!("Version: {version}\n"));
    fs::write(&control, text).unwrap();
    let out = dir.0.join(format!("tracerd_{version}_amd64.deb"));
    sh("dpkg-deb", &["--root-owner-group", "--build", root.to_str().unwrap(), out.to_str().unwrap()]);
    out
}

/// The package: installed with dpkg, its binary passes doctor and traces a loop device
/// exactly, its man page renders and its bash completion loads; an upgrade keeps the
/// operator's config; `dpkg -r` leaves the config alone, `dpkg -P` nothing.
#[test]
fn the_package_installs_traces_upgrades_and_removes_cleanly() {
    require_root();
    let deb = artifact(&format!("tracerd_{VERSION}_amd64.deb"));
    assert!(
        !installed(),
        "a tracerd package is installed already: remove it (dpkg -P tracerd) to run this test"
    );
    // Debian's checks, with the overrides the package carries (each says why).
    let lintian = sh("lintian", &["--fail-on", "error,warning,info", deb.to_str().unwrap()]);
    assert!(lintian.trim().is_empty(), "lintian: {lintian}");
    // Whatever fails below, the machine is left without the package.
    struct Purge;
    impl Drop for Purge {
        fn drop(&mut self) {
            let _ = Command::new("dpkg").args(["-P", "tracerd"]).output();
        }
    }
    let _purge = Purge;
    sh("dpkg", &["-i", deb.to_str().unwrap()]);
    let files: Vec<PathBuf> =
        sh("dpkg-query", &["-L", "tracerd"]).lines().map(PathBuf::from).filter(|p| p.is_file()).collect();
    let bin = Path::new("/usr/bin/tracerd");
    let version = sh(bin.to_str().unwrap(), &["--version"]);
    assert!(version.starts_with(&format!("tracerd {VERSION} (commit ")), "{version}");

    let (status, doctor) = {
        let o = Command::new(bin).arg("doctor").output().unwrap();
        (o.status, String::from_utf8_lossy(&o.stdout).into_owned())
    };
    assert!(status.success(), "the installed tracerd's doctor failed:\n{doctor}");

    let dev = LoopDevice::new(16);
    let agent = Tracerd::run_binary(bin, &["--device", &dev.name]);
    let counted = reads_counted(|| Some(agent.metrics()), &dev, 300);
    assert_eq!(counted, 300.0, "the installed tracerd counted {counted} of 300 reads on {}", dev.name);
    drop(agent);

    let man =
        Command::new("man").args(["-P", "cat", "tracerd-report"]).env("MANWIDTH", "80").output().unwrap();
    let page = String::from_utf8_lossy(&man.stdout);
    assert!(man.status.success() && page.contains("tracerd-report"), "man tracerd-report: {page}");
    let completion =
        sh("bash", &["-c", "source /usr/share/bash-completion/completions/tracerd && complete -p tracerd"]);
    assert!(completion.contains("tracerd"), "the bash completion registered nothing: {completion}");

    // An upgrade over a changed config keeps the operator's file.
    let config = Path::new("/etc/tracerd/tracerd.toml");
    let mine = format!("{}\n# the operator's own line\n", fs::read_to_string(config).unwrap());
    fs::write(config, &mine).unwrap();
    let tmp = TempDir::new();
    let newer = repacked(&deb, &format!("{VERSION}+1"), &tmp);
    sh("dpkg", &["-i", newer.to_str().unwrap()]);
    assert!(sh("dpkg-query", &["-W", "-f=${Version}", "tracerd"]).ends_with("+1"));
    assert_eq!(fs::read_to_string(config).unwrap(), mine, "the upgrade replaced the operator's config");

    sh("dpkg", &["-r", "tracerd"]);
    let left: Vec<&PathBuf> = files.iter().filter(|p| p.exists()).collect();
    assert_eq!(left, [&config.to_path_buf()], "dpkg -r left more than the config");
    sh("dpkg", &["-P", "tracerd"]);
    let left: Vec<&PathBuf> = files.iter().filter(|p| p.exists()).collect();
    assert!(left.is_empty(), "dpkg -P left {left:?}");
    assert!(!Path::new("/etc/tracerd").exists(), "dpkg -P left /etc/tracerd");
}

/// The image, run as the DaemonSet runs it: only CAP_BPF, CAP_PERFMON and CAP_SYS_RESOURCE, a
/// read-only root, the host's /sys read-only. /metrics, scraped from outside through a
/// published port, counts the reads of a loop device of the host exactly.
///
/// Three flags fit podman to this kind of machine, none of them the image's concern: runc,
/// as crun refuses hosts whose cgroups are hybrid (v1 controllers beside a v2 mount with
/// controllers); lower RLIMIT_NOFILE and RLIMIT_NPROC, as podman raises both for root and
/// this machine forbids raising a hard limit; and no seccomp filter, as Kubernetes runs pods
/// by default (podman's own profile allows bpf(2) only with CAP_SYS_ADMIN).
#[test]
fn the_image_traces_the_hosts_disks_with_the_daemonsets_privileges() {
    require_root();
    let archive = artifact(&format!("tracerd-{VERSION}-oci.tar"));
    let image = format!("{IMAGE}:{VERSION}");
    sh("podman", &["load", "-q", "-i", archive.to_str().unwrap()]);
    let labels = sh("podman", &["image", "inspect", "-f", "{{json .Labels}}", &image]);
    let labels: serde_json::Value = serde_json::from_str(&labels).unwrap();
    assert_eq!(labels["org.opencontainers.image.version"], VERSION, "{labels}");
    assert!(labels["org.opencontainers.image.revision"].as_str().is_some_and(|r| r.len() == 40), "{labels}");

    let name = format!("tracerd-test-{}", std::process::id());
    struct Remove(String);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = Command::new("podman").args(["rm", "-f", &self.0]).output();
        }
    }
    let _remove = Remove(name.clone());
    let dev = LoopDevice::new(16);
    let port = free_port();
    let publish = format!("127.0.0.1:{port}:9560");
    // The recorder's store on a host directory, as the DaemonSet's hostPath keeps it.
    let state = TempDir::new();
    let state_volume = format!("{}:/var/lib/tracerd", state.0.display());
    sh(
        "podman",
        &[
            "--runtime",
            "runc",
            "run",
            "-d",
            "--name",
            &name,
            "--cap-drop",
            "all",
            "--cap-add",
            "BPF,PERFMON,SYS_RESOURCE",
            "--read-only",
            "-v",
            "/sys:/sys:ro",
            "-v",
            &state_volume,
            "--security-opt",
            "seccomp=unconfined",
            "--ulimit",
            "nofile=4096:4096",
            "--ulimit",
            "nproc=4096:4096",
            "-p",
            &publish,
            &image,
            "run",
            "--listen",
            "0.0.0.0:9560",
            "--device",
            &dev.name,
        ],
    );
    let addr = format!("127.0.0.1:{port}");
    let logs = || sh("podman", &["logs", &name]);
    let up = eventually(|| http_get(&addr, "/healthz").map(|(s, _)| s) == Some(200));
    assert!(up, "the container never answered /healthz on {addr}:\n{}", logs());
    let scrape = || http_get(&addr, "/metrics").map(|(_, body)| Metrics::parse(&body));
    // What the DaemonSet adds, less what this machine cannot give (it may lack
    // CAP_SYS_RESOURCE itself; a container gets no capability its runtime lacks).
    let caps = sh("podman", &["inspect", "-f", "{{.EffectiveCaps}}", &name]);
    let expected = if has_cap(CAP_SYS_RESOURCE) {
        "[CAP_BPF CAP_PERFMON CAP_SYS_RESOURCE]"
    } else {
        "[CAP_BPF CAP_PERFMON]"
    };
    assert_eq!(caps.trim(), expected, "the container's capabilities");
    let counted = reads_counted(scrape, &dev, 300);
    assert_eq!(counted, 300.0, "the container counted {counted} of 300 reads on {}:\n{}", dev.name, logs());
    // Its history is on the host, where the next container (or `report --store`) reads it.
    let segments = || {
        fs::read_dir(state.0.join("recorder"))
            .map(|d| {
                d.filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".tdr")).count()
            })
            .unwrap_or(0)
    };
    assert!(eventually(|| segments() > 0), "no store segment under {}:\n{}", state.0.display(), logs());
}

const CAP_SYS_RESOURCE: u32 = 24;

/// Whether this process's bounding set holds capability `cap`.
fn has_cap(cap: u32) -> bool {
    let status = fs::read_to_string("/proc/self/status").unwrap();
    let bounding =
        status.lines().find_map(|l| l.strip_prefix("CapBnd:")).expect("CapBnd in /proc/self/status");
    u64::from_str_radix(bounding.trim(), 16).unwrap() & 1 << cap != 0
}

/// The DaemonSet runs the image `dist` builds, by its name and this version's tag.
#[test]
fn the_daemonset_runs_the_image_dist_builds() {
    let yaml = fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/daemonset.yaml"),
    )
    .unwrap();
    let images: Vec<&str> = yaml.lines().filter_map(|l| l.trim().strip_prefix("image: ")).collect();
    assert_eq!(images, [format!("{IMAGE}:{VERSION}")], "daemonset.yaml's images");
}
