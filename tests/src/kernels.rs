//! What start-up detection must choose on each kernel tracerd is tested on (docs/reference/kernels.md's support
//! matrix): asserted against `tracerd doctor --json` on the host (host_kernel.rs) and in each
//! VM kernel (vm.rs). The rows are written out per kernel, not derived from its version: a
//! detection change that moves one kernel to another path fails here.

use serde_json::Value;

/// One tested kernel series and what tracerd must pick there.
pub struct Expected {
    /// `6.1`, `6.12`, `6.12-rt`, `6.12-cloud`, `6.18`.
    pub series: &'static str,
    /// Phrases of the `layout` check: the struct paths chosen.
    pub layout: &'static [&'static str],
    /// Per tracepoint hook, the argument that holds its bio or request: the variant `a<N>`.
    pub variants: &'static [(&'static str, usize)],
    /// How every tracepoint hook attaches.
    pub attach: &'static str,
    /// A PREEMPT_RT build.
    pub preempt_rt: bool,
    /// The kernel counts skipped program runs (`recursion_misses`, 5.12+).
    pub recursion_misses: bool,
}

/// Since 5.11 the block tracepoints take no request_queue; block_bio_complete still does.
const SINCE_5_11: &[(&str, usize)] = &[
    ("block_bio_queue", 0),
    ("block_getrq", 0),
    ("block_split", 0),
    ("block_bio_backmerge", 0),
    ("block_bio_frontmerge", 0),
    ("block_rq_insert", 0),
    ("block_rq_issue", 0),
    ("block_rq_requeue", 0),
    ("block_rq_merge", 0),
    ("block_rq_complete", 0),
    ("block_bio_remap", 0),
    ("block_rq_remap", 0),
    ("block_bio_complete", 1),
];

const SINCE_5_17: &[&str] = &[
    "bio->bi_bdev (5.12+)",
    "rq->q->disk (5.17+)",
    "cgroup: bio->bi_blkg (CONFIG_BLK_CGROUP)",
    "request timestamps: start_time_ns+io_start_time_ns",
];

pub const TESTED: &[Expected] = &[
    Expected {
        series: "6.1",
        layout: SINCE_5_17,
        variants: SINCE_5_11,
        attach: "tp_btf",
        preempt_rt: false,
        recursion_misses: true,
    },
    Expected {
        series: "6.12",
        layout: SINCE_5_17,
        variants: SINCE_5_11,
        attach: "tp_btf",
        preempt_rt: false,
        recursion_misses: true,
    },
    Expected {
        series: "6.12-rt",
        layout: SINCE_5_17,
        variants: SINCE_5_11,
        attach: "tp_btf",
        preempt_rt: true,
        recursion_misses: true,
    },
    Expected {
        series: "6.12-cloud",
        layout: SINCE_5_17,
        variants: SINCE_5_11,
        attach: "tp_btf",
        preempt_rt: false,
        recursion_misses: true,
    },
    Expected {
        series: "6.18",
        layout: SINCE_5_17,
        variants: SINCE_5_11,
        attach: "tp_btf",
        preempt_rt: false,
        recursion_misses: true,
    },
];

/// The series of a release: `6.1.0-57-amd64` is 6.1, `6.12.117+deb12-rt-amd64` 6.12-rt.
pub fn series(release: &str) -> String {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let (major, minor) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let flavour = ["rt", "cloud"].into_iter().find(|f| release.ends_with(&format!("-{f}-amd64")));
    match flavour {
        Some(f) => format!("{major}.{minor}-{f}"),
        None => format!("{major}.{minor}"),
    }
}

pub fn expected(release: &str) -> Option<&'static Expected> {
    let s = series(release);
    TESTED.iter().find(|e| e.series == s)
}

fn check<'a>(checks: &'a [Value], name: &str) -> &'a Value {
    checks.iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("no check {name} in {checks:#?}"))
}

fn detail<'a>(checks: &'a [Value], name: &str) -> &'a str {
    check(checks, name)["detail"].as_str().unwrap_or_default()
}

/// Asserts that `doctor --json` (with its load test) on `release` chose what the table says;
/// returns one line per choice for the test log. None: the kernel is not in the table.
pub fn assert_doctor_chose(release: &str, checks: &[Value]) -> Option<Vec<String>> {
    let want = expected(release)?;
    let mut log = vec![format!("kernel {release} (series {})", want.series)];
    let layout = detail(checks, "layout");
    assert_eq!(check(checks, "layout")["status"], "ok", "{release}: {layout}");
    for phrase in want.layout {
        assert!(layout.contains(phrase), "{release}: the layout must use {phrase}: {layout}");
    }
    log.push(format!("  layout: {layout}"));
    for (tracepoint, arg) in want.variants {
        let name = format!("tracepoint:{tracepoint}");
        let d = detail(checks, &name);
        let variant = format!("at argument {arg}: variant a{arg}; attached as {}", want.attach);
        assert!(d.contains(&variant), "{release}: {name} must be {variant}: {d}");
        log.push(format!("  {tracepoint}: a{arg} {}", want.attach));
    }
    let kernel = detail(checks, "kernel");
    assert_eq!(kernel.contains("PREEMPT_RT"), want.preempt_rt, "{release}: PREEMPT_RT in {kernel:?}");
    log.push(format!("  kernel: {kernel}"));
    let recursion = check(checks, "recursion_misses");
    assert_eq!(recursion["status"] == "ok", want.recursion_misses, "{release}: {recursion}");
    log.push(format!("  recursion_misses: {}", recursion["detail"].as_str().unwrap_or_default()));
    Some(log)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_map_to_their_series() {
        assert_eq!(series("6.1.0-57-amd64"), "6.1");
        assert_eq!(series("6.12.117+deb12-amd64"), "6.12");
        assert_eq!(series("6.12.117+deb12-rt-amd64"), "6.12-rt");
        assert_eq!(series("6.12.117+deb12-cloud-amd64"), "6.12-cloud");
        assert_eq!(series("6.18.44-fc-v595"), "6.18");
        assert!(expected("5.15.0-91-generic").is_none(), "untested kernels are not guessed");
    }
}
