//! The config file as written: every key optional, each table a section, unknown keys
//! refused (serde), and the parse that reports syntax, type and key errors.

use anyhow::Result;
use serde::Deserialize;

/// The file as written: every key optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct File {
    pub listen: Option<String>,
    pub ring_buffer_bytes: Option<u64>,
    pub attach: Option<String>,
    pub kprobes: Option<bool>,
    pub skip_hooks: Option<Vec<String>>,
    pub rq_qos: Option<bool>,
    pub causes: Option<bool>,
    #[serde(default)]
    pub devices: DevicesSection,
    #[serde(default)]
    pub histogram: HistogramSection,
    #[serde(default)]
    pub series: SeriesSection,
    #[serde(default)]
    pub http: HttpSection,
    #[serde(default)]
    pub in_flight: InFlightSection,
    #[serde(default)]
    pub recorder: RecorderSection,
    #[serde(default)]
    pub store: StoreSection,
    #[serde(default)]
    pub api: ApiSection,
    #[serde(default)]
    pub cgroups: CgroupsSection,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CgroupsSection {
    pub label: Option<String>,
    pub include: Option<Vec<String>>,
    pub exclude: Option<Vec<String>>,
    pub top: Option<usize>,
    pub expire_after_s: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecorderSection {
    pub resolution_s: Option<u64>,
    pub retention_s: Option<u64>,
    pub max_bytes: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSection {
    pub path: Option<std::path::PathBuf>,
    pub retention_s: Option<u64>,
    pub max_bytes: Option<u64>,
    pub sync_every_s: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiSection {
    pub socket: Option<std::path::PathBuf>,
    pub http: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InFlightSection {
    pub stale_after_s: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSection {
    pub tls_cert_file: Option<std::path::PathBuf>,
    pub tls_key_file: Option<std::path::PathBuf>,
    pub basic_auth_username: Option<String>,
    pub basic_auth_password_file: Option<std::path::PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DevicesSection {
    pub include: Option<Vec<String>>,
    pub exclude: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HistogramSection {
    pub lowest_ns: Option<u64>,
    pub highest_ns: Option<u64>,
    pub significant_digits: Option<u8>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeriesSection {
    pub expire_after_s: Option<u64>,
    pub max_devices: Option<usize>,
}

/// Parses the TOML text (syntax, types and unknown keys).
pub fn parse(text: &str) -> Result<File> {
    toml::from_str(text).map_err(|e| {
        anyhow::anyhow!("{}", e.to_string().trim_end())
            .context("not a valid tracerd config (see tracerd.example.toml for every key)")
    })
}
