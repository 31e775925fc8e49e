//! Every PromQL expression of the shipped Grafana dashboard, with its variables substituted,
//! returns data from a real Prometheus scraping two real tracerd expositions: the host's agent
//! during a known workload on a loop device, and the one the VM test captured from its agent
//! during the dm-linear scenario (stacked-device series exist only there). Run after
//! `cargo xtask vm-test`: it reads that console log from TRACERD_VM_CONSOLE.

use std::{
    io::{Read, Write},
    net::TcpListener,
    path::Path,
};

use serde_json::Value;
use tracerd_tests::{
    HANG, LoopDevice, Tracerd, Workload, eventually, missed_completions,
    prometheus::{Prometheus, require_prometheus},
    require_root,
};

const DASHBOARD: &str = "deploy/grafana/tracerd-dashboard.json";

/// Every `expr` under the dashboard's panels (rows nest panels).
fn expressions(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", Value::String(e)) => out.push(e.clone()),
                    ("templating", _) => {} // Grafana's label_values(), not PromQL
                    _ => expressions(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| expressions(v, out)),
        _ => {}
    }
}

fn substitute(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("${instance}", ".*")
        .replace("$instance", ".*")
        .replace("${device}", ".*")
        .replace("$device", ".*")
        .replace("${stage}", "d2c")
        .replace("$stage", "d2c")
}

/// The guest agent's /metrics text from the VM console log.
fn vm_exposition() -> String {
    let path = std::env::var("TRACERD_VM_CONSOLE")
        .expect("TRACERD_VM_CONSOLE is unset: run this after the VM test (`cargo xtask test` does)");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let lines = xtask::vm::console::section_lines(&text, "dm_linear_metrics")
        .unwrap_or_else(|e| panic!("dm_linear_metrics in the VM console log: {e:?}"));
    let body = lines.iter().map(|l| format!("{l}\n")).collect::<String>();
    assert!(body.contains("tracerd_io_layer_seconds_bucket"), "the guest's exposition has no layer series");
    body
}

/// Serves `body` at /metrics on a loopback port, forever (the test process ends it).
fn serve(body: String) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf);
            let head = format!(
                "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes()).and_then(|_| stream.write_all(body.as_bytes()));
        }
    });
    addr
}

#[test]
fn every_dashboard_expression_returns_data() {
    require_root();
    require_prometheus();
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(DASHBOARD);
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let mut exprs = Vec::new();
    expressions(&dashboard["panels"], &mut exprs);
    assert!(exprs.len() >= 10, "only {} expressions in {DASHBOARD}", exprs.len());

    let dev = LoopDevice::new(128);
    let agent = Tracerd::run(&["--device", &dev.name]);
    let vm = serve(vm_exposition());
    let prom = Prometheus::start(&[("tracerd", agent.addr.as_deref().unwrap()), ("tracerd-vm", &vm)]);
    Workload { write: false, count: 2000, size: 4096, qd: 8 }.run(&dev);
    Workload { write: true, count: 500, size: 4096, qd: 2 }.run(&dev);
    let sel = format!(r#"tracerd_io_requests_total{{device="{}",op="read"}}"#, dev.name);
    // Plus any reads the kernel skipped the completion program for (missed_completions).
    let reads = || prom.value(&sel).map(|v| v + missed_completions(&agent.metrics()) as f64);
    assert!(
        eventually(|| reads().is_some_and(|n| n >= 2000.0)),
        "Prometheus never saw the workload (waited {HANG:?}):\n{}",
        prom.log()
    );
    // rate() needs two samples of each series in its window: ask until every expression has
    // data, however long the scrapes take to come.
    let empty = || -> Vec<String> {
        exprs.iter().map(|e| substitute(e)).filter(|q| prom.query(q).is_empty()).collect()
    };
    assert!(
        eventually(|| empty().is_empty()),
        "dashboard expressions with no data after {HANG:?}:\n{}",
        empty().join("\n")
    );
    eprintln!("{} dashboard expressions, each returned data:\n{}", exprs.len(), exprs.join("\n"));
}
