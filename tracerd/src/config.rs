//! The config file (TOML): every setting, documented in `tracerd.example.toml`. Command-line
//! flags win over the file, the file over the defaults. Bad values are refused at start with
//! the key and the reason; unknown keys too (a typo must not silently fall back to a default).
//!
//! This file holds the settings (`Config`), the flags and the defaults, and reads the file;
//! `file` is the file as written, `resolve` checks it and lays the flags over it.

mod file;
mod resolve;

use std::{net::SocketAddr, path::Path, time::Duration};

use anyhow::{Context, Result};

pub use file::{
    ApiSection, CgroupsSection, DevicesSection, File, HistogramSection, HttpSection, InFlightSection,
    RecorderSection, SeriesSection, StoreSection, parse,
};
pub use resolve::{resolve, ring_size};

use crate::{
    cli::DEFAULT_LISTEN,
    kernel::tracer::Attach,
    model::aggregate::{HistogramRange, SeriesLimits},
    model::cgroups::CgroupLimits,
    model::recorder::RecorderLimits,
    serve::api,
    serve::http::HttpSecurity,
    store::StoreLimits,
};

/// What the command line says (None / empty: not given).
#[derive(Debug, Default, Clone)]
pub struct Flags {
    pub listen: Option<SocketAddr>,
    pub ring_buffer_bytes: Option<u32>,
    pub attach: Option<Attach>,
    /// `--no-kprobes`.
    pub no_kprobes: bool,
    /// `--causes`.
    pub causes: bool,
    pub devices: Vec<String>,
    pub exclude: Vec<String>,
    pub socket: Option<std::path::PathBuf>,
    /// `--store DIR` / `--no-store` (the agent's).
    pub store: Option<std::path::PathBuf>,
    pub no_store: bool,
}

/// Every setting, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub listen: SocketAddr,
    /// None keeps the built-in size.
    pub ring_buffer_bytes: Option<u32>,
    /// How the tracepoint hooks attach.
    pub attach: Attach,
    /// Load the submit-path kprobes where the kernel has kprobes.
    pub kprobes: bool,
    /// Time rq-qos waits (wbt, io.latency, io.cost) inside Q2G, with kprobes.
    pub rq_qos: bool,
    /// Record the waits inside IO phases and their wakers (the scheduler hooks).
    pub causes: bool,
    /// Tracepoints left unattached (their stages go unmeasured, and their cost unpaid).
    pub skip_hooks: Vec<String>,
    /// Devices to trace; empty means every block device.
    pub include: Vec<String>,
    /// Devices never traced (kernel names; `*` matches any run of characters).
    pub exclude: Vec<String>,
    pub histogram: HistogramRange,
    pub series: SeriesLimits,
    pub http: HttpSecurity,
    /// An in-flight entry older than this is taken as a missed completion: evicted, counted.
    pub stale_after: Duration,
    /// The agent's flight recorder.
    pub recorder: RecorderLimits,
    /// The recorder's store on disk; None keeps history in memory only.
    pub store: Option<StoreLimits>,
    /// The agent's API socket (served by `run`, used by the views).
    pub socket: std::path::PathBuf,
    /// Also serve the API read-only on the HTTP listener (`/api/v1/...`).
    pub api_http: bool,
    /// The opt-in `cgroup` label and its bound.
    pub cgroups: CgroupLimits,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            listen: DEFAULT_LISTEN.parse().expect("valid default"),
            ring_buffer_bytes: None,
            attach: Attach::Auto,
            kprobes: true,
            rq_qos: false,
            causes: false,
            skip_hooks: Vec::new(),
            include: Vec::new(),
            exclude: Vec::new(),
            histogram: HistogramRange::default(),
            series: SeriesLimits::default(),
            http: HttpSecurity::default(),
            stale_after: Duration::from_secs(120),
            recorder: RecorderLimits::default(),
            store: Some(StoreLimits::new(StoreLimits::DEFAULT_DIR.into())),
            socket: api::DEFAULT_SOCKET.into(),
            api_http: false,
            cgroups: CgroupLimits::default(),
        }
    }
}

impl Config {
    /// Reads `path` (if given) and lays `flags` over it.
    pub fn load(path: Option<&Path>, flags: Flags) -> Result<Config> {
        let Some(p) = path else { return resolve(File::default(), flags) };
        let bytes =
            std::fs::read(p).with_context(|| format!("cannot read the config file {}", p.display()))?;
        let text = String::from_utf8(bytes).map_err(|_| {
            anyhow::anyhow!("config file {}: not a valid tracerd config: it is not UTF-8 text", p.display())
        })?;
        parse(&text)
            .and_then(|file| resolve(file, flags))
            .with_context(|| format!("config file {}", p.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn from(text: &str) -> Result<Config> {
        resolve(parse(text)?, Flags::default())
    }

    #[test]
    fn the_example_file_is_valid_and_says_the_defaults() {
        let text = include_str!("../../tracerd.example.toml");
        let c = from(text).unwrap();
        assert_eq!(c.listen, Config::default().listen);
        assert_eq!(c.histogram, HistogramRange::default());
        assert_eq!(c.series, SeriesLimits::default());
        assert_eq!(c.ring_buffer_bytes, Some(8 << 20));
        assert_eq!(c.recorder, RecorderLimits::default());
        assert_eq!(c.socket, Config::default().socket);
        assert_eq!(c.cgroups, CgroupLimits::default());
        assert_eq!(c.attach, Attach::Auto);
    }

    /// Every key `File` accepts (`section.key`), read from its serde definition: a deserializer
    /// that offers each struct field in turn and records the optional ones, which are the keys.
    mod keys {
        use serde::de::{
            self, DeserializeSeed, Deserializer, IntoDeserializer, MapAccess, Visitor, value::Error,
        };
        use std::{cell::RefCell, rc::Rc};

        pub fn of<'de, T: serde::Deserialize<'de>>() -> Vec<String> {
            let out = Rc::new(RefCell::new(Vec::new()));
            T::deserialize(Keys { key: String::new(), out: out.clone() }).expect("sections of optional keys");
            out.take()
        }

        struct Keys {
            key: String,
            out: Rc<RefCell<Vec<String>>>,
        }

        impl<'de> Deserializer<'de> for Keys {
            type Error = Error;

            fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
                Err(de::Error::custom(format!("{}: neither an optional key nor a section", self.key)))
            }

            fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
                self.out.borrow_mut().push(self.key);
                v.visit_none()
            }

            fn deserialize_struct<V: Visitor<'de>>(
                self,
                _: &'static str,
                fields: &'static [&'static str],
                v: V,
            ) -> Result<V::Value, Error> {
                v.visit_map(Fields { keys: self, fields, next: 0 })
            }

            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
                unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
            }
        }

        struct Fields {
            keys: Keys,
            fields: &'static [&'static str],
            next: usize,
        }

        impl<'de> MapAccess<'de> for Fields {
            type Error = Error;

            fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, Error> {
                let Some(&field) = self.fields.get(self.next) else { return Ok(None) };
                seed.deserialize(IntoDeserializer::<Error>::into_deserializer(field)).map(Some)
            }

            fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
                let field = self.fields[self.next];
                self.next += 1;
                let key = match self.keys.key.as_str() {
                    "" => field.to_owned(),
                    section => format!("{section}.{field}"),
                };
                seed.deserialize(Keys { key, out: self.keys.out.clone() })
            }
        }
    }

    /// docs/reference/config.md: (key, default as TOML text, or None where it is unset).
    fn documented_keys() -> Vec<(String, Option<String>)> {
        include_str!("../../docs/reference/config.md")
            .lines()
            .filter(|l| l.starts_with("| `"))
            .map(|l| {
                let cells: Vec<&str> = l.split(" | ").collect();
                let key = cells[0].trim_start_matches("| ").trim_matches('`').to_owned();
                let default = cells[1].trim();
                (key, (default != "unset").then(|| default.trim_matches('`').to_owned()))
            })
            .collect()
    }

    /// The TOML text of `key = value` pairs, each under its section.
    fn toml_of(pairs: &[(String, String)]) -> String {
        let mut text = String::new();
        let mut sections: Vec<&str> = vec![""];
        for (key, _) in pairs {
            if let Some((section, _)) = key.split_once('.')
                && !sections.contains(&section)
            {
                sections.push(section);
            }
        }
        for section in sections {
            if !section.is_empty() {
                text.push_str(&format!("[{section}]\n"));
            }
            for (key, value) in pairs {
                let (s, k) = key.split_once('.').unwrap_or(("", key));
                if s == section {
                    text.push_str(&format!("{k} = {value}\n"));
                }
            }
        }
        text
    }

    /// tracerd.example.toml: its keys set (`section.key` -> value text) and its commented-out keys.
    fn example_keys() -> (Vec<(String, String)>, Vec<String>) {
        let (mut set, mut commented, mut section) = (Vec::new(), Vec::new(), String::new());
        for line in include_str!("../../tracerd.example.toml").lines() {
            let line = line.trim();
            if let Some(s) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = format!("{s}.");
            } else if let Some((k, v)) = line.split_once(" = ") {
                let (commented_out, k) = match k.strip_prefix("# ") {
                    Some(k) => (true, k),
                    None => (false, k),
                };
                if k.contains(' ') || k.starts_with('#') {
                    continue;
                }
                let key = format!("{section}{k}");
                if commented_out {
                    commented.push(key);
                } else {
                    set.push((key, v.trim().to_owned()));
                }
            }
        }
        (set, commented)
    }

    #[test]
    fn config_reference_and_example_list_every_key_with_its_real_default() {
        let fix = "fix docs/reference/config.md and tracerd.example.toml (or the code)";
        let keys = keys::of::<File>();
        assert!(keys.len() > 20 && keys.contains(&"cgroups.top".to_owned()), "{keys:?}");
        let documented = documented_keys();
        let names: Vec<&String> = documented.iter().map(|(k, _)| k).collect();
        for key in &keys {
            assert!(names.contains(&key), "config key {key} is not in the config reference: {fix}");
        }
        for name in &names {
            assert!(keys.contains(name), "{name} is in the config reference but no config key: {fix}");
        }
        assert_eq!(names.len(), keys.len(), "a key listed twice in the config reference");

        // The documented defaults are the code's: a file of all of them resolves to the default.
        let defaults: Vec<(String, String)> =
            documented.iter().filter_map(|(k, d)| Some((k.clone(), d.clone()?))).collect();
        let mut c =
            from(&toml_of(&defaults)).unwrap_or_else(|e| panic!("the documented defaults: {e:#}; {fix}"));
        let ring = tracer_common::limits::RINGBUF_BYTES;
        assert_eq!(c.ring_buffer_bytes.unwrap_or(ring), ring, "ring_buffer_bytes: {fix}");
        c.ring_buffer_bytes = None;
        assert_eq!(c, Config::default(), "the documented defaults: {fix}");

        // The example says the same, and comments out the keys that have no default.
        let (set, commented) = example_keys();
        for (key, default) in &documented {
            match default {
                Some(d) => {
                    let v = set.iter().find(|(k, _)| k == key).map(|(_, v)| v);
                    assert_eq!(v, Some(d), "{key} in tracerd.example.toml: {fix}");
                }
                None => assert!(commented.contains(key), "{key}: a commented-out example line; {fix}"),
            }
        }
        for (key, _) in &set {
            assert!(
                names.contains(&key),
                "tracerd.example.toml sets {key}, which the reference lacks: {fix}"
            );
        }
        // The ring buffer's size is explained by the record's.
        let record = format!("Each record takes {} bytes", size_of::<tracer_common::IoRecord>());
        for (file, text) in [
            ("docs/reference/config.md", include_str!("../../docs/reference/config.md")),
            ("tracerd.example.toml", include_str!("../../tracerd.example.toml")),
        ] {
            assert!(text.contains(&record), "{file} must say \"{record}\"");
        }
    }
}
