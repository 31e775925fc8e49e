//! The shipped systemd unit, and tracerd under exactly the capabilities it names.

use std::{collections::BTreeSet, path::Path, process::Command};

use serde_json::Value;
use tracerd_tests::{LoopDevice, Tracerd, Workload, require_root, tracerd_bin};

const UNIT: &str = "deploy/systemd/tracerd.service";

fn unit_text() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(UNIT)).unwrap()
}

/// Values of `key=` lines (space-separated words, all lines of that key).
fn words(unit: &str, key: &str) -> BTreeSet<String> {
    unit.lines()
        .filter_map(|l| l.strip_prefix(&format!("{key}=")))
        .flat_map(|v| v.split_whitespace().map(str::to_owned))
        .collect()
}

#[test]
fn systemd_unit_is_hardened_and_verifies() {
    let unit = unit_text();
    let caps: BTreeSet<String> = ["CAP_BPF", "CAP_PERFMON", "CAP_SYS_RESOURCE"].map(String::from).into();
    assert_eq!(words(&unit, "CapabilityBoundingSet"), caps, "bounding set");
    assert_eq!(words(&unit, "AmbientCapabilities"), caps, "ambient set");
    for (key, want) in [("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes")] {
        assert_eq!(words(&unit, key), BTreeSet::from([want.to_string()]), "{key}");
    }
    // systemd-analyze checks the executable exists: point the unit at the binary under test.
    let dir = std::env::temp_dir().join(format!("tracerd-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tracerd.service");
    std::fs::write(&path, unit.replace("/usr/local/bin/tracerd", &tracerd_bin().display().to_string()))
        .unwrap();
    let out = Command::new("systemd-analyze").arg("verify").arg(&path).output().expect("systemd-analyze");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "systemd-analyze verify failed:\n{said}");
    assert!(!said.contains("tracerd.service"), "systemd-analyze complains about the unit:\n{said}");
}

/// Effective capabilities of a process, as a bit mask.
fn cap_eff(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:")).unwrap().trim();
    u64::from_str_radix(hex, 16).unwrap()
}

#[test]
fn tracerd_traces_as_nobody_with_only_bpf_and_perfmon() {
    require_root();
    const CAP_PERFMON: u64 = 1 << 38;
    const CAP_BPF: u64 = 1 << 39;
    let dev = LoopDevice::new(64);
    // CAP_SYS_RESOURCE (the unit's third) only raises RLIMIT_MEMLOCK for kernels before 5.11;
    // this one does not need it, and a container may not hold it to give.
    let caps = "-all,+bpf,+perfmon";
    let wrapper = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        &format!("--inh-caps={caps}"),
        &format!("--ambient-caps={caps}"),
        &format!("--bounding-set={caps}"),
    ];
    let mut t =
        Tracerd::spawn_under(&wrapper, &["report", "--json", "--duration", "600", "--device", &dev.name]);
    assert_eq!(cap_eff(t.pid()), CAP_BPF | CAP_PERFMON, "tracerd holds exactly CAP_BPF and CAP_PERFMON");
    let w = Workload { write: false, count: 300, size: 4096, qd: 4 };
    w.run(&dev);
    assert!(t.stop(libc::SIGINT).success(), "{}", t.stderr_text());
    let report: Value = serde_json::from_str(&t.stdout_text()).unwrap();
    let ops = &report["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"] == dev.name.as_str())
        .unwrap()["ops"];
    let read = ops.as_array().unwrap().iter().find(|o| o["op"] == "read").unwrap();
    assert_eq!(read["requests"], w.count, "{read}");
    assert!(report["lost"].as_object().unwrap().values().all(|v| v == 0), "{}", report["lost"]);
}
