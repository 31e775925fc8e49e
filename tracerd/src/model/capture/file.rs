//! A capture on disk: reading it (every field checked, so a damaged, foreign or newer file is a
//! clear error that names the problem, never a panic or a wrong diff) and writing it.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use serde_json::Value;

use super::*;

/// Why a text is not a capture this tracerd can read. Each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    #[error("the file is empty (was the capture interrupted while it was written?); {}", SAVE_AGAIN)]
    Empty,
    #[error(
        "truncated or not JSON (byte {0} is not UTF-8 text); a capture is the JSON file that \
         `tracerd report --save FILE` writes"
    )]
    NotText(usize),
    #[error(
        "truncated or not JSON ({0}); a capture is the JSON file that `tracerd report --save FILE` writes"
    )]
    NotJson(String),
    #[error("not a tracerd capture: {0}; diff takes files written by `tracerd report --save FILE`")]
    NotCapture(String),
    #[error("{0}")]
    Version(String),
    #[error(
        "its histograms are {0}, but version-1 captures use 100 ns to 60 s at 3 significant digits: \
         the file was edited or damaged; {save}",
        save = SAVE_AGAIN
    )]
    HistogramConfig(String),
    #[error("not a valid capture: {0}; the file was edited or damaged: {save}", save = SAVE_AGAIN)]
    Invalid(String),
}

/// A capture that could not be loaded or saved: the file and what went wrong.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    // `error`, not `source`: the message already includes it, and anyhow would print it twice.
    #[error("cannot read capture {}: {error}; check the path and its permissions", .path.display())]
    Unreadable { path: PathBuf, error: io::Error },
    #[error("capture {}: {problem}", .path.display())]
    Invalid { path: PathBuf, problem: Problem },
    #[error(
        "cannot save a capture to {}: {why}; give --save a path in an existing directory",
        .path.display()
    )]
    SaveTarget { path: PathBuf, why: String },
    #[error("cannot write capture {}: {error}", .path.display())]
    Write { path: PathBuf, error: io::Error },
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl Capture {
    /// Reads and checks a capture file.
    pub fn load(path: &Path) -> Result<Capture, CaptureError> {
        let bytes =
            fs::read(path).map_err(|error| CaptureError::Unreadable { path: path.to_owned(), error })?;
        let invalid = |problem| CaptureError::Invalid { path: path.to_owned(), problem };
        let text = std::str::from_utf8(&bytes).map_err(|e| invalid(Problem::NotText(e.valid_up_to())))?;
        Capture::parse(text).map_err(invalid)
    }

    /// Checks a capture's text in the order that gives the most useful error: JSON at all, a
    /// capture at all, a version this tracerd reads, then every field and histogram.
    pub fn parse(text: &str) -> Result<Capture, Problem> {
        if text.trim().is_empty() {
            return Err(Problem::Empty);
        }
        let value: Value = serde_json::from_str(text).map_err(|e| Problem::NotJson(e.to_string()))?;
        let Some(top) = value.as_object() else {
            return Err(Problem::NotCapture(format!(
                "it is {}, not an object with \"format\": \"{FORMAT}\"",
                json_kind(&value)
            )));
        };
        match top.get("format") {
            Some(Value::String(f)) if f == FORMAT => {}
            Some(other) => return Err(Problem::NotCapture(format!("its \"format\" is {other}"))),
            None if top.contains_key("schema_version") => {
                return Err(Problem::NotCapture(
                    "this looks like `tracerd report --json` output, which has no histograms".into(),
                ));
            }
            None => return Err(Problem::NotCapture("it has no \"format\" field".into())),
        }
        let writer = top.get("tracerd_version").and_then(Value::as_str).unwrap_or("unknown");
        let ours = env!("CARGO_PKG_VERSION");
        match top.get("version").and_then(Value::as_u64) {
            Some(VERSION) => {}
            Some(v) if v > VERSION => {
                return Err(Problem::Version(format!(
                    "capture format version {v} was written by a newer tracerd ({writer}); this tracerd \
                     ({ours}) reads version {VERSION}: use a tracerd at least as new as the one that wrote it"
                )));
            }
            Some(v) => {
                return Err(Problem::Version(format!(
                    "capture format version {v} was written by an older tracerd ({writer}); this tracerd \
                     ({ours}) reads version {VERSION}: diff it with the tracerd that wrote it"
                )));
            }
            None => {
                let found = top.get("version").map_or_else(|| "missing".to_owned(), Value::to_string);
                return Err(Problem::Version(format!(
                    "the capture's \"version\" is {found}, not a format version; this tracerd reads \
                     version {VERSION}: {SAVE_AGAIN}"
                )));
            }
        }
        match top.get("histograms").map(|h| serde_json::from_value::<HistogramConfig>(h.clone())) {
            Some(Ok(c)) if c == HistogramConfig::CURRENT => {}
            Some(Ok(c)) => {
                return Err(Problem::HistogramConfig(format!(
                    "{} ns to {} ns at {} significant digits",
                    c.lowest_ns, c.highest_ns, c.significant_digits
                )));
            }
            Some(Err(e)) => return Err(Problem::Invalid(format!("\"histograms\": {e}"))),
            None => return Err(Problem::Invalid("the \"histograms\" field is missing".into())),
        }
        // Parsed again from the text, not the Value, so errors say line and column.
        let capture: Capture = serde_json::from_str(text).map_err(|e| Problem::Invalid(e.to_string()))?;
        capture.validate().map_err(Problem::Invalid)?;
        Ok(capture)
    }

    /// What serde cannot check: numbers in range, names given and not repeated.
    fn validate(&self) -> Result<(), String> {
        for (name, v) in [("started_unix_s", self.started_unix_s), ("duration_s", self.duration_s)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("\"{name}\" is {v}, not a time"));
            }
        }
        let mut devices = BTreeSet::new();
        for d in &self.devices {
            if d.device.is_empty() {
                return Err("a device has an empty name".into());
            }
            if !devices.insert(d.device.as_str()) {
                return Err(format!("device {} appears twice", d.device));
            }
            let mut ops = BTreeSet::new();
            for op in &d.ops {
                if !ops.insert(op.op) {
                    return Err(format!("{} {} appears twice", d.device, op.op.as_str()));
                }
            }
        }
        Ok(())
    }

    /// Fails now, before a capture is taken, if `path` cannot be saved to later.
    pub fn check_save_path(path: &Path) -> Result<(), CaptureError> {
        let why = |why: String| CaptureError::SaveTarget { path: path.to_owned(), why };
        if path.is_dir() {
            return Err(why("that is a directory; name a file in it".into()));
        }
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            return Err(why(format!("the directory {} does not exist", dir.display())));
        }
        Ok(())
    }

    /// Writes the capture to `path` atomically: to `path.tmp`, then renamed over `path`, so a
    /// reader never sees half a capture.
    pub fn save(&self, path: &Path) -> Result<(), CaptureError> {
        Capture::check_save_path(path)?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let write_err = |error| CaptureError::Write { path: path.to_owned(), error };
        // Compact: a histogram has up to thousands of buckets, one line each would be unreadable
        // anyway; `jq` shows it.
        let mut json = serde_json::to_vec(self).map_err(|e| write_err(io::Error::other(e)))?;
        json.push(b'\n');
        fs::write(&tmp, &json).and_then(|()| fs::rename(&tmp, path)).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            write_err(e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{
        capture::tests::{Rng, capture},
        topology::tests::tempdir,
    };

    fn problem(text: &str) -> String {
        Capture::parse(text).expect_err("must be refused").to_string()
    }

    /// A valid capture's JSON with `f` applied to it.
    fn edited(f: impl FnOnce(&mut Value)) -> String {
        let mut v = serde_json::to_value(capture(100)).unwrap();
        f(&mut v);
        v.to_string()
    }

    #[test]
    fn each_kind_of_bad_file_gets_its_own_message() {
        assert!(problem("").contains("the file is empty"));
        assert!(problem(" \n").contains("the file is empty"));
        let e = problem("hello");
        assert!(e.contains("truncated or not JSON") && e.contains("line 1 column 1"), "{e}");
        let full = serde_json::to_string(&capture(100)).unwrap();
        let e = problem(&full[..full.len() / 2]);
        assert!(e.contains("truncated or not JSON") && e.contains("EOF"), "{e}");
        assert!(problem("[1, 2]").contains("not a tracerd capture: it is an array"));
        assert!(problem("{}").contains("not a tracerd capture: it has no \"format\" field"));
        assert!(problem("{\"format\": \"pcap\"}").contains("its \"format\" is \"pcap\""));
        let e = problem("{\"schema_version\": 1, \"devices\": []}");
        assert!(e.contains("`tracerd report --json` output"), "{e}");
        let e = problem(&edited(|v| {
            v["version"] = 2.into();
            v["tracerd_version"] = "0.9.0".into();
        }));
        assert!(e.contains("version 2 was written by a newer tracerd (0.9.0)"), "{e}");
        assert!(e.contains("reads version 1"), "{e}");
        assert!(problem(&edited(|v| v["version"] = 0.into())).contains("older tracerd"));
        let e = problem(&edited(|v| v["version"] = "1".into()));
        assert!(e.contains("\"version\" is \"1\", not a format version"), "{e}");
        let e = problem(&edited(|v| v["histograms"]["significant_digits"] = 5.into()));
        assert!(e.contains("100 ns to 60000000000 ns at 5 significant digits"), "{e}");
    }

    fn stage_hist(v: &mut Value) -> &mut Value {
        &mut v["devices"][1]["ops"][0]["stages"]["d2c"]
    }

    #[test]
    fn damaged_histograms_and_fields_are_refused_with_the_reason() {
        type Edit = Box<dyn FnOnce(&mut Value)>;
        let cases: [(&str, Edit); 9] = [
            ("beyond the histogram's range", Box::new(|v| stage_hist(v)["buckets"][0][0] = u64::MAX.into())),
            ("count is 1 but the buckets add up to", Box::new(|v| stage_hist(v)["count"] = 1.into())),
            ("has a count of 0", Box::new(|v| stage_hist(v)["buckets"][0][1] = 0.into())),
            (
                "bucket values must increase",
                Box::new(|v| stage_hist(v)["buckets"].as_array_mut().unwrap().reverse()),
            ),
            ("cannot be the sum", Box::new(|v| stage_hist(v)["sum_ns"] = 3.into())),
            ("invalid value: integer `-5`, expected u64", Box::new(|v| stage_hist(v)["count"] = (-5).into())),
            (
                "more than 1125899906842624 samples",
                Box::new(|v| stage_hist(v)["buckets"][0][1] = u64::MAX.into()),
            ),
            (
                "unknown variant `readwrite`",
                Box::new(|v| v["devices"][1]["ops"][0]["op"] = "readwrite".into()),
            ),
            ("\"duration_s\" is -1, not a time", Box::new(|v| v["duration_s"] = (-1.0).into())),
        ];
        for (want, edit) in cases {
            let e = problem(&edited(edit));
            assert!(e.contains("not a valid capture") && e.contains(want), "want '{want}' in: {e}");
            assert!(e.contains("tracerd report --save"), "says what to do: {e}");
        }
        let e = problem(&edited(|v| {
            let d = v["devices"][1].clone();
            v["devices"].as_array_mut().unwrap().push(d);
        }));
        assert!(e.contains("device loop0 appears twice"), "{e}");
        let e = problem(&edited(|v| {
            v["devices"][1]["ops"][0]["stages"]["d2c"]["buckets"] = Value::Array(vec![])
        }));
        assert!(e.contains("no buckets"), "{e}");
        // serde's errors point into the file.
        let e = problem(&edited(|v| stage_hist(v)["count"] = 1.into()));
        assert!(e.contains("at line 1 column"), "{e}");
    }

    #[test]
    fn load_names_the_file_and_handles_unreadable_and_binary_files() {
        let dir = tempdir::Dir::new();
        let missing = dir.0.join("nope.json");
        let e = Capture::load(&missing).unwrap_err().to_string();
        assert!(e.contains("cannot read capture") && e.contains("nope.json"), "{e}");
        let garbage = dir.0.join("garbage.bin");
        let mut rng = Rng(42);
        let bytes: Vec<u8> = (0..4096).map(|_| rng.next() as u8).collect();
        fs::write(&garbage, &bytes).unwrap();
        let e = Capture::load(&garbage).unwrap_err().to_string();
        assert!(e.starts_with(&format!("capture {}: truncated or not JSON", garbage.display())), "{e}");
        let empty = dir.0.join("empty.json");
        fs::write(&empty, "").unwrap();
        assert!(Capture::load(&empty).unwrap_err().to_string().contains("empty.json: the file is empty"));
    }

    #[test]
    fn save_refuses_a_missing_directory_before_capturing() {
        let dir = tempdir::Dir::new();
        let e = Capture::check_save_path(&dir.0.join("no/such/dir/a.json")).unwrap_err().to_string();
        assert!(e.contains("directory") && e.contains("does not exist") && e.contains("--save"), "{e}");
        let e = Capture::check_save_path(&dir.0).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        assert!(Capture::check_save_path(Path::new("relative.json")).is_ok());
        // Overwriting a previous capture is fine.
        let path = dir.0.join("a.json");
        capture(10).save(&path).unwrap();
        capture(20).save(&path).unwrap();
        assert_eq!(Capture::load(&path).unwrap().devices[1].ops[0].requests, 20);
    }

    #[test]
    fn garbage_never_panics() {
        let mut rng = Rng(7);
        for len in [1usize, 2, 7, 100, 5000] {
            for _ in 0..20 {
                let text: String =
                    (0..len).map(|_| char::from_u32(rng.next() as u32 % 0x250).unwrap_or('x')).collect();
                assert!(Capture::parse(&text).is_err());
            }
        }
        let full = serde_json::to_string(&capture(200)).unwrap();
        for cut in (0..full.len()).step_by(97) {
            assert!(Capture::parse(&full[..cut]).is_err(), "a capture cut at {cut} must be refused");
        }
        for text in ["null", "0", "\"x\"", "[]", "{}", "{\"format\":\"tracerd-capture\"}", "[[[[[[[[[["] {
            assert!(Capture::parse(text).is_err(), "{text}");
        }
        assert!(
            Capture::parse(&"[".repeat(100_000)).is_err(),
            "deep nesting is an error, not a stack overflow"
        );
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        /// Every leaf of a JSON value, as a JSON pointer.
        fn leaves(v: &Value, at: String, out: &mut Vec<String>) {
            match v {
                Value::Object(m) if !m.is_empty() => m.iter().for_each(|(k, v)| {
                    leaves(v, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), out)
                }),
                Value::Array(a) if !a.is_empty() => {
                    a.iter().enumerate().for_each(|(i, v)| leaves(v, format!("{at}/{i}"), out))
                }
                _ => out.push(at),
            }
        }

        fn any_json() -> impl Strategy<Value = Value> {
            prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::from),
                any::<u64>().prop_map(Value::from),
                any::<i64>().prop_map(Value::from),
                any::<f64>().prop_map(Value::from),
                (0u64..100_000).prop_map(Value::from),
                ".{0,12}".prop_map(Value::from),
                Just(Value::Array(vec![])),
                Just(serde_json::json!([[100, 1]])),
                Just(serde_json::json!({})),
            ]
        }

        static VALID: std::sync::LazyLock<String> =
            std::sync::LazyLock::new(|| serde_json::to_string(&capture(50)).unwrap());

        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

            #[test]
            fn arbitrary_text_is_refused_without_panic(text in any::<String>()) {
                prop_assert!(Capture::parse(&text).is_err());
            }

            #[test]
            fn byte_edits_of_a_capture_never_panic(
                at in any::<prop::sample::Index>(),
                cut in any::<prop::sample::Index>(),
                insert in ".{0,8}",
            ) {
                let valid = VALID.as_bytes();
                let (i, j) = (at.index(valid.len()), cut.index(valid.len()));
                let (from, to) = (i.min(j), i.max(j).min(i.min(j) + 16));
                let mut bytes = valid[..from].to_vec();
                bytes.extend_from_slice(insert.as_bytes());
                bytes.extend_from_slice(&valid[to..]);
                let _ = Capture::parse(&String::from_utf8_lossy(&bytes));
            }

            #[test]
            fn field_edits_of_a_capture_are_ok_or_err_never_panic(
                which in any::<prop::sample::Index>(),
                replacement in any_json(),
            ) {
                let mut v: Value = serde_json::from_str(&VALID).unwrap();
                let mut paths = vec![];
                leaves(&v, String::new(), &mut paths);
                let path = &paths[which.index(paths.len())];
                *v.pointer_mut(path).unwrap() = replacement;
                if let Ok(c) = Capture::parse(&v.to_string()) {
                    // Whatever loads is usable: every histogram rebuilds and answers quantiles.
                    for d in &c.devices {
                        for op in &d.ops {
                            for h in op.stages.values() {
                                prop_assert_eq!(h.histogram().len(), h.count);
                            }
                        }
                    }
                }
            }
        }
    }
}
