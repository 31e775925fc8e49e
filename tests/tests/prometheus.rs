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
