//! A real Prometheus server for the tests: Debian's `prometheus` on a loopback port, scraping
//! the given targets every second, with its data in a temporary directory removed on drop.

use std::{
    fs,
    io::Write,
    path::PathBuf,
    process::{Child, Command, Stdio},
};

use serde_json::Value;

use crate::{HANG, eventually, free_port, http_get, unique};

pub struct Prometheus {
    child: Child,
    dir: PathBuf,
    pub addr: String,
}

/// The servers the tests need, with how to get them.
pub fn require_prometheus() {
    for tool in ["prometheus", "promtool"] {
        let found = Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success());
        assert!(
            found,
            "{tool} is missing: `sudo cargo xtask setup --test` installs Debian's prometheus package"
        );
    }
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` ((job, host:port) pairs) every second; waits
    /// until it is ready.
    pub fn start(targets: &[(&str, &str)]) -> Prometheus {
        Prometheus::start_with(targets, &[])
    }

    /// `start`, with feature flags (`exemplar-storage`, `native-histograms`).
    pub fn start_with(targets: &[(&str, &str)], features: &[&str]) -> Prometheus {
        Prometheus::start_full(targets, features, None)
    }

    /// `start`, with a rule file (YAML, `groups:` at its top), evaluated every second.
    pub fn start_with_rules(targets: &[(&str, &str)], rules: &str) -> Prometheus {
        Prometheus::start_full(targets, &[], Some(rules))
    }

    fn start_full(targets: &[(&str, &str)], features: &[&str], rules: Option<&str>) -> Prometheus {
        let dir = std::env::temp_dir().join(unique("tracerd-prometheus"));
        fs::create_dir_all(&dir).unwrap();
        let mut config = String::from("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n");
        if let Some(rules) = rules {
            fs::write(dir.join("rules.yml"), rules).unwrap();
            config += &format!("rule_files:\n  - {}\n", dir.join("rules.yml").display());
        }
        config += "scrape_configs:\n";
        for (job, target) in targets {
            config += &format!("  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n");
        }
        fs::write(dir.join("prometheus.yml"), config).unwrap();
        let addr = format!("127.0.0.1:{}", free_port());
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .args(features.iter().map(|f| format!("--enable-feature={f}")))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(dir.join("prometheus.log")).unwrap())
            .spawn()
            .expect("start prometheus");
        let p = Prometheus { child, dir, addr };
        let ready = eventually(|| http_get(&p.addr, "/-/ready").map(|(s, _)| s) == Some(200));
        assert!(ready, "prometheus never became ready (waited {HANG:?}: a hang):\n{}", p.log());
        p
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// An instant query through the HTTP API: the `data.result` array. Panics on a query error
    /// (bad PromQL), with Prometheus's message.
    pub fn query(&self, expr: &str) -> Vec<Value> {
        let (status, body) = http_get(&self.addr, &format!("/api/v1/query?query={}", url_encode(expr)))
            .unwrap_or_else(|| panic!("no answer from prometheus for {expr}"));
        let v: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{expr}: bad JSON ({e}): {body}"));
        assert!(status == 200 && v["status"] == "success", "query {expr} failed ({status}): {body}");
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// Exemplars of the series `expr` selects, over the last `span_s` seconds: the
    /// `data` array of /api/v1/query_exemplars.
    pub fn exemplars(&self, expr: &str, span_s: u64) -> Vec<Value> {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let path = format!(
            "/api/v1/query_exemplars?query={}&start={}&end={}",
            url_encode(expr),
            now - span_s,
            now + 60
        );
        let (status, body) =
            http_get(&self.addr, &path).unwrap_or_else(|| panic!("no answer for exemplars of {expr}"));
        let v: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{expr}: bad JSON ({e}): {body}"));
        assert!(status == 200 && v["status"] == "success", "exemplars of {expr} failed ({status}): {body}");
        v["data"].as_array().cloned().unwrap_or_default()
    }

    /// The value of a query that yields one series (None if it yields none).
    pub fn value(&self, expr: &str) -> Option<f64> {
        let result = self.query(expr);
        assert!(result.len() <= 1, "{expr} yields {} series: {result:?}", result.len());
        result.first().map(|s| s["value"][1].as_str().unwrap().parse().unwrap())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Runs `promtool check metrics` on an exposition text: Ok, or promtool's complaints.
pub fn promtool_check_metrics(text: &str) -> Result<(), String> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() { Ok(()) } else { Err(said) }
}
