//! tracerd behind a real Prometheus (Debian's package): the series a known workload must
//! produce, read back through Prometheus's HTTP API, and `promtool check metrics`.

use tracerd_tests::{
    HANG, LoopDevice, Tracerd, Workload, eventually,
    prometheus::{Prometheus, promtool_check_metrics, require_prometheus},
    require_root,
};

const READS: Workload = Workload { write: false, count: 400, size: 4096, qd: 4 };
const WRITES: Workload = Workload { write: true, count: 150, size: 8192, qd: 1 };

#[test]
fn prometheus_scrapes_every_io_and_promtool_accepts_the_exposition() {
    require_root();
    require_prometheus();
    let dev = LoopDevice::new(128);
    let agent = Tracerd::run(&["--device", &dev.name]);
    let addr = agent.addr.clone().unwrap();
    let prom = Prometheus::start(&[("tracerd", &addr)]);
    READS.run(&dev);
    WRITES.run(&dev);

    let d = &dev.name;
    let sel = |op: &str| format!(r#"{{job="tracerd",device="{d}",op="{op}"}}"#);
    let scraped = eventually(|| {
        [(READS.op(), READS.count), (WRITES.op(), WRITES.count)]
            .iter()
            .all(|(op, n)| prom.value(&format!("tracerd_io_requests_total{}", sel(op))) == Some(*n as f64))
    });
    assert!(scraped, "Prometheus never saw the issued requests (waited {HANG:?}):\n{}", prom.log());
    assert_eq!(prom.value(r#"up{job="tracerd"}"#), Some(1.0));
    for w in [READS, WRITES] {
        let s = sel(w.op());
        let n = Some(w.count as f64);
        assert_eq!(prom.value(&format!("tracerd_io_bytes_total{s}")), Some(w.bytes() as f64), "{s}");
        assert_eq!(prom.value(&format!("tracerd_io_merged_bios_total{s}")), Some(0.0), "{s}");
        for stage in ["q2c", "d2c", "q2d"] {
            let st = format!(r#"{{job="tracerd",device="{d}",op="{}",stage="{stage}"}}"#, w.op());
            assert_eq!(prom.value(&format!("tracerd_io_stage_seconds_count{st}")), n, "{stage} count {st}");
            let inf = format!(r#"{{job="tracerd",device="{d}",op="{}",stage="{stage}",le="+Inf"}}"#, w.op());
            assert_eq!(
                prom.value(&format!("tracerd_io_stage_seconds_bucket{inf}")),
                n,
                "{stage} +Inf bucket"
            );
            let p99 = prom.value(&format!(
                "histogram_quantile(0.99, sum by (le) (tracerd_io_stage_seconds_bucket{st}))"
            ));
            assert!(p99.is_some_and(|v| v > 0.0 && v < 60.0), "{stage} p99 {p99:?}");
        }
        assert_eq!(prom.value(&format!("tracerd_io_queue_depth_count{s}")), n, "queue depths {s}");
        let over = format!(r#"{{job="tracerd",device="{d}",op="{}",le="{}"}}"#, w.op(), w.qd);
        assert_eq!(prom.value(&format!("tracerd_io_queue_depth_bucket{over}")), n, "depth <= {}", w.qd);
    }
    assert_eq!(prom.value(r#"sum(tracerd_events_lost_total{job="tracerd"})"#), Some(0.0), "lost events");
    assert!(prom.value(r#"process_resident_memory_bytes{job="tracerd"}"#).is_some_and(|v| v > 1e6));
    assert_eq!(prom.query(r#"tracerd_build_info{job="tracerd"}"#).len(), 1);

    let (_, text) = tracerd_tests::http_get(&addr, "/metrics").unwrap();
    if let Err(said) = promtool_check_metrics(&text) {
        panic!("promtool check metrics rejects tracerd's /metrics:\n{said}");
    }
}

/// Classic bounds of tracerd_io_stage_seconds (seconds).
const CLASSIC_S: [f64; 25] = [
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5,
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 60.0,
];

#[test]
fn exemplars_and_native_histograms_reach_a_real_prometheus() {
    require_root();
    require_prometheus();
    let dev = LoopDevice::new(128);
    let dir = tracerd_tests::TempDir::new();
    let cfg = dir.file("tracerd.toml");
    // Per-cgroup series, every IO aggregated from its record: every bucket an IO fell in has
    // an exemplar (with the in-kernel aggregation, only the slow IOs' buckets do).
    std::fs::write(&cfg, "[cgroups]\nlabel = \"path\"\n").unwrap();
    let agent = Tracerd::run(&["--config", &cfg, "--device", &dev.name, "--aggregation", "records"]);
    let addr = agent.addr.clone().unwrap();
    // One server per exposition: OpenMetrics text with exemplars, and protobuf with native
    // histograms (Prometheus 2.42 ingests a histogram with native buckets as native only).
    let om = Prometheus::start_with(&[("tracerd", &addr)], &["exemplar-storage"]);
    let native = Prometheus::start_with(&[("tracerd", &addr)], &["native-histograms", "exemplar-storage"]);
    READS.run(&dev);

    let d = &dev.name;
    let sel = format!(r#"{{job="tracerd",device="{d}",op="read",stage="q2c"}}"#);
    let classic_count = format!("sum(tracerd_io_stage_seconds_count{sel})");
    let native_count = format!("histogram_count(sum(tracerd_io_stage_seconds{sel}))");
    let n = Some(READS.count as f64);
    let scraped = eventually(|| om.value(&classic_count) == n && native.value(&native_count) == n);
    assert!(
        scraped,
        "never {n:?} reads in both: classic {:?}, native {:?}\n{}\n{}",
        om.value(&classic_count),
        native.value(&native_count),
        om.log(),
        native.log()
    );

    // Exemplars: who did the IO and where, on the dashboard's own expressions too.
    let exemplars = om.exemplars(&format!("tracerd_io_stage_seconds_bucket{sel}"), 600);
    assert!(!exemplars.is_empty(), "no exemplars:\n{}", om.log());
    for series in &exemplars {
        for e in series["exemplars"].as_array().unwrap() {
            let l = &e["labels"];
            assert_eq!((l["device"].as_str(), l["comm"].as_str()), (Some(d.as_str()), Some("iogen")), "{e}");
            assert!(l["pid"].as_str().unwrap().parse::<u32>().unwrap() > 0, "{e}");
            assert!(l["sector"].as_str().unwrap().parse::<u64>().is_ok(), "{e}");
            assert!(l["cgroup"].as_str().is_some_and(|c| c.starts_with('/')), "{e}");
            // The exemplar's time lies in its bucket.
            let le: f64 = series["seriesLabels"]["le"].as_str().unwrap().parse().unwrap();
            let v: f64 = e["value"].as_str().unwrap().parse().unwrap();
            let below = CLASSIC_S.iter().rev().find(|&&b| b < le).copied().unwrap_or(0.0);
            assert!(v > below && v <= le, "exemplar {v} s in bucket le={le}");
        }
    }
    let dashboard: serde_json::Value =
        serde_json::from_str(include_str!("../../deploy/grafana/tracerd-dashboard.json")).unwrap();
    let mut shown = 0;
    let mut targets = vec![&dashboard];
    while let Some(v) = targets.pop() {
        match v {
            serde_json::Value::Object(o) if o.get("exemplar") == Some(&serde_json::Value::Bool(true)) => {
                // The exemplars Grafana asks for with a panel's query: those of its series.
                let expr = o["expr"].as_str().unwrap();
                let at = expr.find("tracerd_io_stage_seconds_bucket{").unwrap();
                let inner = &expr[at..=at + expr[at..].find('}').unwrap()];
                let inner = inner.replace("$instance", ".*").replace("$device", d).replace("$stage", "q2c");
                assert!(!om.exemplars(&inner, 600).is_empty(), "no exemplars for the dashboard's {inner}");
                shown += 1;
            }
            serde_json::Value::Object(o) => targets.extend(o.values()),
            serde_json::Value::Array(a) => targets.extend(a.iter()),
            _ => {}
        }
    }
    assert!(shown >= 3, "the dashboard shows exemplars on {shown} queries");

    // Native and classic quantiles agree: the native p50 lies in the classic bucket that
    // holds the classic p50 (give or take a native bucket, 9 %).
    for q in [0.5, 0.9, 0.99] {
        let classic = om
            .value(&format!("histogram_quantile({q}, sum by (le) (tracerd_io_stage_seconds_bucket{sel}))"))
            .unwrap();
        let nat =
            native.value(&format!("histogram_quantile({q}, sum(tracerd_io_stage_seconds{sel}))")).unwrap();
        let hi = CLASSIC_S.iter().copied().find(|&b| classic <= b).unwrap();
        let lo = CLASSIC_S.iter().rev().copied().find(|&b| b < hi).unwrap_or(0.0);
        println!("p{}: classic {classic:.7} s (bucket {lo}..{hi}), native {nat:.7} s", q * 100.0);
        assert!(
            nat > lo / 1.1 && nat <= hi * 1.1,
            "p{q}: native {nat} s outside the classic bucket {lo}..{hi}"
        );
    }
    let sum = |p: &Prometheus, e: &str| p.value(e).unwrap();
    let (cs, ns) = (
        sum(&om, &format!("sum(tracerd_io_stage_seconds_sum{sel})")),
        sum(&native, &format!("histogram_sum(sum(tracerd_io_stage_seconds{sel}))")),
    );
    assert!((cs - ns).abs() <= cs * 1e-9, "sums: classic {cs}, native {ns}");
}

/// The pod join of docs/guide/cgroups.md: tracerd's `cgroup` label (pod UID and container id,
/// from the kubelet's cgroup path) joined on `uid` to kube-state-metrics' `kube_pod_info`, which
/// a recording rule stands in for here, so that no cluster is needed.
const POD_REQUESTS: &str = r#"sum by (namespace, pod, device, op) (
    label_replace(tracerd_io_requests_total{cgroup!="other"}, "uid", "$1", "cgroup", "([^/]+)(/.*)?")
  * on (uid) group_left (namespace, pod) kube_pod_info
)"#;
const POD_Q2C_P99: &str = r#"histogram_quantile(0.99, sum by (le, namespace, pod) (
    label_replace(rate(tracerd_io_stage_seconds_bucket{stage="q2c", cgroup!="other"}[5m]),
                  "uid", "$1", "cgroup", "([^/]+)(/.*)?")
  * on (uid) group_left (namespace, pod) kube_pod_info
))"#;

/// kube-state-metrics' series for two pods, as a recording rule.
fn kube_pod_info_rule(pods: &[(&str, &str, &str)]) -> String {
    let mut rules = String::from("groups:\n  - name: kube-state-metrics\n    rules:\n");
    for (uid, namespace, pod) in pods {
        let expr = format!(
            r#"label_replace(label_replace(label_replace(vector(1), "uid", "{uid}", "", ""), "namespace", "{namespace}", "", ""), "pod", "{pod}", "", "")"#
        );
        rules += &format!("      - record: kube_pod_info\n        expr: '{expr}'\n");
    }
    rules
}

#[test]
fn pods_are_named_by_joining_kube_pod_info_on_their_uid() {
    require_root();
    require_prometheus();
    for (name, query) in [("POD_REQUESTS", POD_REQUESTS), ("POD_Q2C_P99", POD_Q2C_P99)] {
        let guide = include_str!("../../docs/guide/cgroups.md");
        assert!(guide.contains(query), "docs/guide/cgroups.md must show {name} as this test runs it");
    }
    let uid = format!("8c6b3f0e-2a41-4f7b-9d3c-{:012x}", std::process::id());
    let cid = "3f2e".repeat(16);
    // The kubelet's cgroupfs layout, in the hierarchy that charges IO here: v1 blkio where the
    // machine mounts it, else v2.
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let root = mountinfo
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mut r = right.split(' ');
            let (fstype, opts) = (r.next()?, r.nth(1).unwrap_or(""));
            let blkio = fstype == "cgroup" && opts.split(',').any(|o| o == "blkio");
            (blkio || fstype == "cgroup2").then(|| (blkio, left.split(' ').nth(4).unwrap().to_owned()))
        })
        .max()
        .map(|(_, p)| std::path::PathBuf::from(p))
        .expect("a cgroup hierarchy");
    let kubepods = root.join(format!("kubepods-tracerd-test-{}", std::process::id()));
    let container = kubepods.join("besteffort").join(format!("pod{uid}")).join(&cid);
    std::fs::create_dir_all(&container).unwrap();
    // The label reads /kubepods...: tracerd takes the first component's `kubepods` prefix.
    let dev = LoopDevice::new(64);
    let tmp = tracerd_tests::TempDir::new();
    let cfg = tmp.file("tracerd.toml");
    std::fs::write(&cfg, "[cgroups]\nlabel = \"pod\"\n").unwrap();
    let agent = Tracerd::run(&["--config", &cfg, "--device", &dev.name]);
    let addr = agent.addr.clone().unwrap();
    let rules = kube_pod_info_rule(&[
        (&uid, "shop", "cart-5d8f9"),
        ("0a1b2c3d-0000-4000-8000-000000000000", "x", "y"),
    ]);
    let prom = Prometheus::start_with_rules(&[("tracerd", &addr)], &rules);
    let procs = container.join("cgroup.procs");
    let iogen = tracerd_tests::iogen_bin();
    let reads = || {
        let ok = std::process::Command::new("sh")
            .args(["-c", &format!("echo $$ > {} && exec \"$@\"", procs.display()), "sh"])
            .args([iogen.to_str().unwrap(), &dev.path, "read", "300", "4096", "4"])
            .status()
            .unwrap();
        assert!(ok.success(), "iogen in {}", container.display());
    };
    reads();

    let mut joined = Vec::new();
    let found = eventually(|| {
        joined = prom.query(POD_REQUESTS);
        joined.iter().any(|s| s["metric"]["device"] == dev.name.as_str() && s["value"][1] == "300")
    });
    assert!(found, "the join never named 300 reads of {}: {joined:#?}\n{}", dev.name, prom.log());
    let ours: Vec<_> = joined.iter().filter(|s| s["metric"]["device"] == dev.name.as_str()).collect();
    assert_eq!(ours.len(), 1, "{ours:#?}");
    let m = &ours[0]["metric"];
    assert_eq!(
        (m["namespace"].as_str(), m["pod"].as_str(), m["op"].as_str()),
        (Some("shop"), Some("cart-5d8f9"), Some("read"))
    );
    // A rate needs the counters to move between scrapes: the series began with the first reads.
    reads();
    let mut p99 = Vec::new();
    let latency = eventually(|| {
        p99 = prom.query(POD_Q2C_P99);
        p99.iter().any(|s| {
            s["metric"]["pod"] == "cart-5d8f9"
                && s["value"][1].as_str().is_some_and(|v| v.parse::<f64>().is_ok_and(|v| v > 0.0 && v < 60.0))
        })
    });
    assert!(latency, "no Q2C p99 for the pod: {p99:#?}");
    println!("{POD_REQUESTS}\n=> {ours:?}\n{POD_Q2C_P99}\n=> {p99:?}");
    drop(agent);
    for dir in container.ancestors().take(4) {
        let _ = eventually(|| std::fs::remove_dir(dir).is_ok() || !dir.exists());
    }
}
