//! The settings resolved: each checked (an error names the flag or key, the value, and what
//! it must be) and laid flags over file over defaults.

use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::{
    Config, Flags,
    file::{File, StoreSection},
};
use crate::{
    kernel::{hooks::HOOKS, tracer::Attach},
    model::aggregate::{HistogramRange, SeriesLimits},
    model::cgroups::CgroupLimits,
    model::cgroups::LabelForm,
    model::recorder::RecorderLimits,
    model::selection::name_matches,
    serve::http::HttpSecurity,
    store::StoreLimits,
};

/// Checks every value and lays the flags over the file over the defaults.
pub fn resolve(file: File, flags: Flags) -> Result<Config> {
    let d = Config::default();
    let listen = match (flags.listen, file.listen) {
        (Some(a), _) => a,
        (None, Some(s)) => s.parse().map_err(|_| {
            anyhow::anyhow!("listen = \"{s}\": not an address and port (for example \"127.0.0.1:9560\")")
        })?,
        (None, None) => d.listen,
    };
    let ring_buffer_bytes = match (flags.ring_buffer_bytes, file.ring_buffer_bytes) {
        (Some(b), _) => Some(b),
        (None, Some(b)) => Some(ring_size(b)?),
        (None, None) => None,
    };
    let attach = match (flags.attach, file.attach.as_deref()) {
        (Some(a), _) => a,
        // The flag's own names (clap's), so the file and --attach take the same words.
        (None, Some(s)) => <Attach as clap::ValueEnum>::from_str(s, false)
            .map_err(|_| anyhow::anyhow!("attach = \"{s}\": must be auto (tp_btf, else raw_tp) or raw_tp"))?,
        (None, None) => d.attach,
    };
    let kprobes = !flags.no_kprobes && file.kprobes.unwrap_or(d.kprobes);
    let rq_qos = kprobes && file.rq_qos.unwrap_or(d.rq_qos);
    let causes = flags.causes || file.causes.unwrap_or(d.causes);
    let skip_hooks = file.skip_hooks.unwrap_or_default();
    for name in &skip_hooks {
        let skippable = || {
            let names: Vec<&str> = HOOKS.iter().filter(|h| !h.required).map(|h| h.tracepoint).collect();
            names.join(", ")
        };
        match HOOKS.iter().find(|h| h.tracepoint == name) {
            None => bail!(
                "skip_hooks \"{name}\": not a tracepoint tracerd hooks; these can be skipped: {}",
                skippable()
            ),
            Some(h) if h.required => bail!(
                "skip_hooks \"{name}\": every IO is timed and counted from {}, so it cannot be skipped; \
                 these can: {}",
                h.tracepoint,
                skippable()
            ),
            Some(_) => {}
        }
    }
    // Each list is checked where it came from, so the error names the flag or the key to fix.
    for (source, names) in [
        ("--device", flags.devices.as_slice()),
        ("--exclude", flags.exclude.as_slice()),
        ("devices.include", file.devices.include.as_deref().unwrap_or_default()),
        ("devices.exclude", file.devices.exclude.as_deref().unwrap_or_default()),
    ] {
        if let Some(bad) =
            names.iter().find(|n| n.trim().is_empty() || n.contains('/') && !n.starts_with('/'))
        {
            bail!(
                "{source} \"{bad}\": give kernel names (loop0, nvme0n1), device-mapper names (vg-lv) or \
                 absolute paths to device nodes (/dev/mapper/vg-lv, /dev/disk/by-id/...)"
            );
        }
    }
    let include =
        if flags.devices.is_empty() { file.devices.include.unwrap_or_default() } else { flags.devices };
    let mut exclude = file.devices.exclude.unwrap_or_default();
    exclude.extend(flags.exclude);
    if let Some(both) = include.iter().find(|n| exclude.iter().any(|p| name_matches(p, n))) {
        bail!("device \"{both}\" is both included and excluded (devices.include, devices.exclude)");
    }
    let h = &file.histogram;
    let histogram = HistogramRange {
        lowest_ns: h.lowest_ns.unwrap_or(d.histogram.lowest_ns),
        highest_ns: h.highest_ns.unwrap_or(d.histogram.highest_ns),
        significant_digits: h.significant_digits.unwrap_or(d.histogram.significant_digits),
    };
    if histogram.lowest_ns == 0 {
        bail!("histogram.lowest_ns = 0: must be at least 1 (ns)");
    }
    if histogram.highest_ns < 2 * histogram.lowest_ns {
        bail!(
            "histogram.highest_ns = {}: must be at least twice histogram.lowest_ns ({})",
            histogram.highest_ns,
            histogram.lowest_ns
        );
    }
    if !(1..=5).contains(&histogram.significant_digits) {
        bail!("histogram.significant_digits = {}: must be 1 to 5", histogram.significant_digits);
    }
    let s = &file.series;
    let series = SeriesLimits {
        expire_after: Duration::from_secs(s.expire_after_s.unwrap_or(d.series.expire_after.as_secs())),
        max_devices: s.max_devices.unwrap_or(d.series.max_devices),
    };
    if series.expire_after.is_zero() {
        bail!("series.expire_after_s = 0: must be at least 1 (seconds)");
    }
    if !(1..=65_536).contains(&series.max_devices) {
        bail!("series.max_devices = {}: must be 1 to 65536", series.max_devices);
    }
    let h = file.http;
    let tls = match (h.tls_cert_file, h.tls_key_file) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => bail!("http.tls_cert_file and http.tls_key_file go together: give both or neither"),
    };
    let basic_auth = match (h.basic_auth_username, h.basic_auth_password_file) {
        (Some(user), Some(file)) if !user.is_empty() && !user.contains(':') => Some((user, file)),
        (Some(user), Some(_)) => {
            bail!("http.basic_auth_username = \"{user}\": must be non-empty and without ':'")
        }
        (None, None) => None,
        _ => bail!(
            "http.basic_auth_username and http.basic_auth_password_file go together: give both or neither"
        ),
    };
    let http = HttpSecurity { tls, basic_auth };
    let stale_after = Duration::from_secs(file.in_flight.stale_after_s.unwrap_or(d.stale_after.as_secs()));
    if stale_after.as_secs() < 2 {
        bail!("in_flight.stale_after_s = {}: must be at least 2 (seconds)", stale_after.as_secs());
    }
    let r = &file.recorder;
    let recorder = RecorderLimits {
        resolution: Duration::from_secs(r.resolution_s.unwrap_or(d.recorder.resolution.as_secs())),
        retention: Duration::from_secs(r.retention_s.unwrap_or(d.recorder.retention.as_secs())),
        max_bytes: r.max_bytes.map_or(d.recorder.max_bytes, |b| b.min(usize::MAX as u64) as usize),
    };
    if !(1..=3600).contains(&recorder.resolution.as_secs()) {
        bail!("recorder.resolution_s = {}: must be 1 to 3600 (seconds)", recorder.resolution.as_secs());
    }
    if recorder.retention < recorder.resolution || recorder.retention.as_secs() > 7 * 86_400 {
        bail!(
            "recorder.retention_s = {}: must be at least recorder.resolution_s ({}) and at most 604800 (a week)",
            recorder.retention.as_secs(),
            recorder.resolution.as_secs()
        );
    }
    if recorder.max_bytes < 1 << 20 {
        bail!("recorder.max_bytes = {}: must be at least 1048576 (1 MiB)", recorder.max_bytes);
    }
    let store = resolve_store(file.store, flags.store, flags.no_store, &recorder)?;
    let flags_socket = flags.socket.is_some();
    let socket = match (flags.socket, file.api.socket) {
        (Some(p), _) | (None, Some(p)) => p,
        (None, None) => d.socket,
    };
    if !socket.is_absolute() {
        let source = if flags_socket { "--socket" } else { "api.socket =" };
        bail!("{source} \"{}\": give an absolute path", socket.display());
    }
    let c = file.cgroups;
    let cgroups = CgroupLimits {
        label: match c.label.as_deref() {
            None => d.cgroups.label,
            Some(l) => LabelForm::parse(l).with_context(|| {
                format!("cgroups.label = \"{l}\": must be none, path, unit (systemd) or pod (Kubernetes)")
            })?,
        },
        include: c.include.unwrap_or_default(),
        exclude: c.exclude.unwrap_or_default(),
        top: c.top.unwrap_or(d.cgroups.top),
        expire_after: Duration::from_secs(c.expire_after_s.unwrap_or(d.cgroups.expire_after.as_secs())),
    };
    if !(1..=10_000).contains(&cgroups.top) {
        bail!("cgroups.top = {}: must be 1 to 10000", cgroups.top);
    }
    if cgroups.expire_after.is_zero() {
        bail!("cgroups.expire_after_s = 0: must be at least 1 (seconds)");
    }
    if cgroups.label != LabelForm::None && skip_hooks.iter().any(|h| h == "block_bio_queue") {
        bail!(
            "cgroups.label with skip_hooks \"block_bio_queue\": an IO's cgroup is read at its Q; \
             drop one of the two"
        );
    }
    if let Some(p) =
        cgroups.include.iter().chain(&cgroups.exclude).find(|p| !p.starts_with('/') && !p.starts_with('*'))
    {
        bail!(
            "cgroups include/exclude pattern \"{p}\": patterns match cgroup paths, which start with / (or use *)"
        );
    }
    Ok(Config {
        listen,
        ring_buffer_bytes,
        attach,
        kprobes,
        rq_qos,
        causes,
        skip_hooks,
        include,
        exclude,
        histogram,
        series,
        http,
        stale_after,
        recorder,
        store,
        socket,
        api_http: file.api.http.unwrap_or(d.api_http),
        cgroups,
    })
}

/// `[store]` with `--store`/`--no-store` over it: an empty path turns the store off.
fn resolve_store(
    s: StoreSection,
    flag: Option<std::path::PathBuf>,
    no_store: bool,
    recorder: &RecorderLimits,
) -> Result<Option<StoreLimits>> {
    let from_flag = flag.is_some();
    let dir = match (flag, s.path) {
        _ if no_store => return Ok(None),
        (Some(p), _) | (None, Some(p)) => p,
        (None, None) => StoreLimits::DEFAULT_DIR.into(),
    };
    if dir.as_os_str().is_empty() {
        return Ok(None);
    }
    if !dir.is_absolute() {
        let source = if from_flag { "--store" } else { "store.path =" };
        bail!(
            "{source} \"{}\": give an absolute path (or \"\" to keep history in memory only)",
            dir.display()
        );
    }
    let d = StoreLimits::new(dir);
    let l = StoreLimits {
        retention: s.retention_s.map_or(d.retention, Duration::from_secs),
        max_bytes: s.max_bytes.unwrap_or(d.max_bytes),
        sync_every: s.sync_every_s.map_or(d.sync_every, Duration::from_secs),
        dir: d.dir,
    };
    if l.retention < recorder.resolution || l.retention.as_secs() > 366 * 86_400 {
        bail!(
            "store.retention_s = {}: must be at least recorder.resolution_s ({}) and at most 31622400 (a year)",
            l.retention.as_secs(),
            recorder.resolution.as_secs()
        );
    }
    if l.max_bytes < 4 << 20 {
        bail!("store.max_bytes = {}: must be at least 4194304 (4 MiB)", l.max_bytes);
    }
    if !(1..=600).contains(&l.sync_every.as_secs()) {
        bail!("store.sync_every_s = {}: must be 1 to 600 (seconds)", l.sync_every.as_secs());
    }
    Ok(Some(l))
}

/// A ring buffer size the kernel accepts: a power of two, at least a page.
pub fn ring_size(bytes: u64) -> Result<u32> {
    match u32::try_from(bytes) {
        Ok(b) if b >= 4096 && b.is_power_of_two() => Ok(b),
        _ => bail!("ring_buffer_bytes = {bytes}: must be a power of two from 4096 to 2147483648"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{parse, tests::from};

    fn err(text: &str) -> String {
        format!("{:#}", from(text).unwrap_err())
    }

    #[test]
    fn the_store_is_on_by_default_and_flags_win_over_its_section() {
        let c = from("").unwrap();
        assert_eq!(c.store, Some(StoreLimits::new(StoreLimits::DEFAULT_DIR.into())));
        assert_eq!(from("[store]\npath = \"\"").unwrap().store, None);
        let s = from("[store]\npath = \"/srv/t\"\nretention_s = 3600\nmax_bytes = 8388608\nsync_every_s = 2")
            .unwrap()
            .store
            .unwrap();
        assert_eq!(
            (s.dir.to_str().unwrap(), s.retention.as_secs(), s.max_bytes, s.sync_every.as_secs()),
            ("/srv/t", 3600, 8 << 20, 2)
        );
        let flags = |store: Option<&str>, no_store| Flags {
            store: store.map(Into::into),
            no_store,
            ..Default::default()
        };
        let file = || parse("[store]\npath = \"/srv/t\"").unwrap();
        assert_eq!(
            resolve(file(), flags(Some("/x"), false)).unwrap().store.unwrap().dir.to_str(),
            Some("/x")
        );
        assert_eq!(resolve(file(), flags(None, true)).unwrap().store, None);
        let e = format!("{:#}", resolve(file(), flags(Some("rel"), false)).unwrap_err());
        assert!(e.contains("--store \"rel\": give an absolute path"), "{e}");
        assert!(err("[store]\npath = \"rel\"").contains("store.path = \"rel\""));
        assert!(err("[store]\nmax_bytes = 1000").contains("store.max_bytes = 1000"));
        assert!(err("[store]\nsync_every_s = 0").contains("store.sync_every_s = 0"));
        assert!(err("[store]\nretention_s = 0").contains("store.retention_s = 0"));
    }

    #[test]
    fn flags_win_over_the_file_over_the_defaults() {
        let file =
            parse("listen = \"127.0.0.1:1\"\nring_buffer_bytes = 65536\n[devices]\ninclude = [\"loop0\"]\n")
                .unwrap();
        let flags = Flags {
            listen: Some("127.0.0.1:2".parse().unwrap()),
            devices: vec!["loop1".into()],
            ..Flags::default()
        };
        let c = resolve(file, flags).unwrap();
        assert_eq!((c.listen.port(), c.ring_buffer_bytes, c.include), (2, Some(65536), vec!["loop1".into()]));
        assert_eq!(from("").unwrap(), Config::default());
        assert_eq!(from("attach = \"raw_tp\"").unwrap().attach, Attach::RawTp);
        let flags = Flags { attach: Some(Attach::Auto), ..Flags::default() };
        assert_eq!(resolve(parse("attach = \"raw_tp\"").unwrap(), flags).unwrap().attach, Attach::Auto);
    }

    #[test]
    fn bad_values_name_the_key_and_the_reason() {
        assert!(err("lisen = \"x\"").contains("unknown field `lisen`"), "{}", err("lisen = \"x\""));
        assert!(err("[series]\nmax_devices = 0").contains("series.max_devices = 0: must be 1 to 65536"));
        assert!(err("[series]\nexpire_after_s = 0").contains("series.expire_after_s = 0"));
        assert!(
            err("[cgroups]\nlabel = \"pods\"").contains("cgroups.label = \"pods\": must be none, path, unit")
        );
        assert!(err("[cgroups]\ntop = 0").contains("cgroups.top = 0"));
        assert!(err("[cgroups]\nexclude = [\"system.slice\"]").contains("start with /"));
        assert!(err("[cgroups]\nlabels = \"path\"").contains("labels"), "unknown keys are refused");
        assert!(err("[in_flight]\nstale_after_s = 1").contains("in_flight.stale_after_s = 1"));
        assert!(err("ring_buffer_bytes = 5000").contains("ring_buffer_bytes = 5000: must be a power of two"));
        assert!(err("listen = \"nowhere\"").contains("listen = \"nowhere\": not an address"));
        assert!(err("[histogram]\nlowest_ns = 100\nhighest_ns = 150").contains("histogram.highest_ns = 150"));
        assert!(err("[histogram]\nsignificant_digits = 7").contains("histogram.significant_digits = 7"));
        assert!(
            err("[devices]\ninclude = [\"loop0\"]\nexclude = [\"loop*\"]")
                .contains("both included and excluded")
        );
        assert!(
            err("ring_buffer_bytes = \"big\"").contains("invalid type"),
            "{}",
            err("ring_buffer_bytes = \"big\"")
        );
        assert!(err("listen = ").contains("not a valid tracerd config"));
        assert!(err("[http]\ntls_cert_file = \"/c.pem\"").contains("give both or neither"));
        assert!(
            err("[http]\nbasic_auth_username = \"a:b\"\nbasic_auth_password_file = \"/p\"")
                .contains("without ':'")
        );
        assert!(err("[recorder]\nresolution_s = 0").contains("recorder.resolution_s = 0: must be 1 to 3600"));
        assert!(err("[recorder]\nresolution_s = 10\nretention_s = 5").contains("recorder.retention_s = 5"));
        assert!(err("[recorder]\nmax_bytes = 1000").contains("recorder.max_bytes = 1000"));
        assert!(
            err("[api]\nsocket = \"tracerd.sock\"")
                .contains("api.socket = \"tracerd.sock\": give an absolute")
        );
        let flag_err = |flags: Flags| format!("{:#}", resolve(parse("").unwrap(), flags).unwrap_err());
        let bad = flag_err(Flags { devices: vec!["mapper/vg-lv".into()], ..Flags::default() });
        assert!(bad.starts_with("--device \"mapper/vg-lv\": give kernel names"), "{bad}");
        let bad = flag_err(Flags { exclude: vec![" ".into()], ..Flags::default() });
        assert!(bad.starts_with("--exclude \" \""), "{bad}");
        let bad = flag_err(Flags { socket: Some("t.sock".into()), ..Flags::default() });
        assert!(bad.starts_with("--socket \"t.sock\": give an absolute path"), "{bad}");
        assert!(err("[devices]\ninclude = [\"a/b\"]").contains("devices.include \"a/b\""));
        assert!(err("[api]\nport = 1").contains("unknown field `port`"));
        assert!(
            err("attach = \"kprobe\"")
                .contains("attach = \"kprobe\": must be auto (tp_btf, else raw_tp) or raw_tp")
        );
        let bad = err("skip_hooks = [\"block_rq_issue\"]");
        assert!(bad.contains("skip_hooks \"block_rq_issue\": every IO is timed and counted from"), "{bad}");
        assert!(bad.contains("these can: block_bio_queue, block_getrq"), "{bad}");
        let bad = err("skip_hooks = [\"block_bio_queu\"]");
        assert!(bad.contains("skip_hooks \"block_bio_queu\": not a tracepoint tracerd hooks"), "{bad}");
    }

    #[test]
    fn skipped_hooks_are_the_ones_named() {
        let c = from("skip_hooks = [\"block_bio_queue\", \"block_getrq\"]").unwrap();
        assert_eq!(c.skip_hooks, ["block_bio_queue", "block_getrq"]);
        assert!(from("").unwrap().skip_hooks.is_empty());
        let both = "skip_hooks = [\"block_bio_queue\"]\n[cgroups]\nlabel = \"path\"";
        assert!(err(both).contains("an IO's cgroup is read at its Q"), "{}", err(both));
    }
}
