//! The daemon's own resource use (`process_*` metrics, as Prometheus client libraries export
//! them), read from /proc/self.

/// A snapshot of this process.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcessStats {
    /// User + system CPU time.
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub open_fds: u64,
    /// Start time, seconds since the Unix epoch.
    pub start_time_seconds: f64,
}

impl ProcessStats {
    pub fn read() -> Option<ProcessStats> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let boot_time = std::fs::read_to_string("/proc/stat").ok().and_then(|s| boot_time(&s))?;
        let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
        // SAFETY: plain sysconf queries.
        let (ticks, page) = unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
        parse_stat(&stat, ticks.max(1) as f64, page.max(1) as u64, boot_time, open_fds)
    }
}

/// `btime` of /proc/stat: boot time in seconds since the epoch.
fn boot_time(proc_stat: &str) -> Option<f64> {
    proc_stat.lines().find_map(|l| l.strip_prefix("btime "))?.trim().parse().ok()
}

/// Fields of /proc/self/stat after the command name (which may hold spaces and parentheses).
fn parse_stat(stat: &str, ticks: f64, page: u64, boot_time: f64, open_fds: u64) -> Option<ProcessStats> {
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // proc(5) numbers fields from 1 (pid); `rest` starts at field 3 (state).
    let field = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    Some(ProcessStats {
        cpu_seconds: (field(14)? + field(15)?) as f64 / ticks,
        resident_bytes: field(24)? * page,
        open_fds,
        start_time_seconds: boot_time + field(22)? as f64 / ticks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_command_names() {
        let stat = "4242 (trace (d) x) S 1 4242 4242 0 -1 4194560 500 0 0 0 250 50 0 0 20 0 3 0 1000 \
                    123456789 2048 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        let p = parse_stat(stat, 100.0, 4096, 1_700_000_000.0, 9).unwrap();
        assert_eq!(p.cpu_seconds, 3.0);
        assert_eq!(p.resident_bytes, 2048 * 4096);
        assert_eq!(p.start_time_seconds, 1_700_000_010.0);
        assert_eq!(p.open_fds, 9);
        assert_eq!(boot_time("cpu 1 2\nbtime 1700000000\n"), Some(1_700_000_000.0));
    }

    #[test]
    fn reads_this_process() {
        let p = ProcessStats::read().unwrap();
        assert!(p.resident_bytes > 0 && p.open_fds > 0 && p.start_time_seconds > 1e9, "{p:?}");
    }
}
