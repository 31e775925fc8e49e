//! The doctor scenario: what `tracerd doctor` chooses on this kernel.

use serde_json::Value;

use crate::{console, ran, release, section};

/// The doctor's load test in this kernel: the layout paths and hook variants it must get
/// (tests/src/kernels.rs), every tracepoint and kprobe attached.
#[test]
fn doctor_chooses_what_this_kernel_must_get() {
    if !ran("doctor") {
        return;
    }
    let release = release();
    let out = section("doctor_json");
    assert!(console().contains("tracerd doctor exit status: 0"), "doctor failed on {release}:\n{out}");
    let checks: Vec<Value> =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("doctor --json is not JSON ({e}):\n{out}"));
    let log = tracerd_tests::kernels::assert_doctor_chose(&release, &checks).unwrap_or_else(|| {
        panic!("kernel {release} is not in tests/src/kernels.rs: add what tracerd must choose there")
    });
    let load = checks.iter().find(|c| c["name"] == "load").expect("load check");
    let tracepoints = tracerd::kernel::hooks::HOOKS.len();
    // The stacked devices' kprobes, and blk-throttle's (H).
    let kprobes = tracerd::kernel::hooks::KPROBES.len() + 1;
    let want = format!(
        "loaded and attached {tracepoints} of {tracepoints} tracepoints (tp_btf {tracepoints}, raw_tp 0) \
         and {kprobes} of {kprobes} kprobes"
    );
    assert!(load["detail"].as_str().unwrap().contains(&want), "{release}: {load}");
    // Every kernel of the VM has blk-throttle's check as a function, and kprobes.
    let throttle = checks.iter().find(|c| c["name"] == "kprobe:__blk_throtl_bio").expect("H's check");
    assert_eq!(throttle["status"], "ok", "{release}: {throttle}");
    assert!(throttle["detail"].as_str().unwrap().starts_with("attached (kprobe)"), "{release}: {throttle}");
    // And the functions where the rq-qos policies wait, so Q2G can be split (config rq_qos).
    let rq_qos = checks.iter().find(|c| c["name"] == "rq_qos").expect("the rq_qos check");
    assert_eq!(rq_qos["status"], "ok", "{release}: {rq_qos}");
    assert!(
        rq_qos["detail"].as_str().unwrap().starts_with("rq_qos_wait and ioc_rqos_throttle in BTF"),
        "{release}: {rq_qos}"
    );
    // The stacked drivers' structs, from their modules' BTF (loaded by the prologue).
    for module in ["dm_mod", "dm_mod/request", "dm_crypt", "md_mod", "raid1", "raid10", "raid456"] {
        let c = checks.iter().find(|c| c["name"] == format!("module_btf:{module}")).expect(module);
        assert_eq!(c["status"], "ok", "{release}: {c}");
        assert!(c["detail"].as_str().unwrap().starts_with("links "), "{release}: {c}");
        eprintln!("  module_btf:{module}: {}", c["detail"].as_str().unwrap());
    }
    // The verifier's work on the most complex program of what `run` loads, which every kernel
    // of the VM reports: a warning from 80 % of its limit. Every kernel here has room to spare
    // (6.1's verifier explores the most; a loop it walked once per path into it took the
    // completion program to 94 % there).
    let verifier = checks.iter().find(|c| c["name"] == "verifier").expect("the verifier check");
    let (_, _, percent) = tracerd_tests::verifier_figures(verifier);
    assert!(percent < 50, "{release}: the verifier's work nears its limit: {verifier}");
    assert_eq!(verifier["status"], "ok", "{release}: {verifier}");
    eprintln!("  verifier: {}", verifier["detail"].as_str().unwrap());
    eprintln!("{}", log.join("\n"));
}
