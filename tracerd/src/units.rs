//! Human-readable numbers for terminal output: the unit is chosen per value.

/// Nanoseconds as `850ns`, `12.3µs`, `4.56ms`, `1.23s`, without allocating; honours width and
/// alignment (`{:>8}`).
pub struct Duration(pub f64);

impl Duration {
    /// The text into `buf`, by integer arithmetic (rounding halves up): float formatting was
    /// most of what `snoop` cost per IO.
    pub fn text(self, buf: &mut [u8; 32]) -> &str {
        let ns = self.0;
        if !ns.is_finite() || ns < 0.0 {
            let s = format!("{ns}ns");
            let n = s.len().min(buf.len());
            buf[..n].copy_from_slice(&s.as_bytes()[..n]);
            return std::str::from_utf8(&buf[..n]).unwrap_or("?");
        }
        // In ns, tenths of a µs, or hundredths of a ms or s, rounded; a value that would round
        // up to 1000 of a unit is shown in the next.
        let (scale, decimals, unit) = if ns < 999.5 {
            (1.0, 0, "ns")
        } else if ns < 999_950.0 {
            (1e2, 1, "µs")
        } else if ns < 999_995_000.0 {
            (1e4, 2, "ms")
        } else {
            (1e7, 2, "s")
        };
        let v = (ns / scale).round() as u64;
        let mut n = 0;
        let mut put = |bytes: &[u8]| {
            buf[n..n + bytes.len()].copy_from_slice(bytes);
            n += bytes.len();
        };
        let mut digits = [0u8; 20];
        let pow = [1, 10, 100][decimals];
        put(decimal(v / pow, &mut digits).as_bytes());
        if decimals > 0 {
            put(b".");
            let frac = v % pow;
            if decimals == 2 && frac < 10 {
                put(b"0");
            }
            put(decimal(frac, &mut digits).as_bytes());
        }
        put(unit.as_bytes());
        std::str::from_utf8(&buf[..n]).unwrap_or("?")
    }
}

impl std::fmt::Display for Duration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(Duration(self.0).text(&mut [0; 32]))
    }
}

/// `v` in decimal, into `buf`.
pub fn decimal(mut v: u64, buf: &mut [u8; 20]) -> &str {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    std::str::from_utf8(&buf[i..]).unwrap_or("?")
}

/// [`Duration`] as a `String`.
pub fn duration_ns(ns: f64) -> String {
    Duration(ns).to_string()
}

/// Bytes with binary prefixes: `512B`, `4.0KiB`, `1.5MiB`.
pub fn bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 { format!("{v:.0}B") } else { format!("{v:.1}{}", UNITS[i]) }
}

/// Seconds since the Unix epoch as `2025-11-30 05:40:12 UTC`.
pub fn utc(unix_s: f64) -> String {
    // Saturating: NaN and negative times show as the epoch.
    let secs = unix_s as u64;
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's days_from_civil, inverted).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + (month <= 2) as i64;
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_follow_the_value() {
        assert_eq!(duration_ns(850.0), "850ns");
        assert_eq!(duration_ns(12_345.0), "12.3µs");
        assert_eq!(duration_ns(4_560_000.0), "4.56ms");
        assert_eq!(duration_ns(1.234e9), "1.23s");
        assert_eq!(duration_ns(999.4), "999ns");
        assert_eq!(duration_ns(999.6), "1.0µs");
        assert_eq!(duration_ns(999_949.0), "999.9µs");
        assert_eq!(duration_ns(999_960.0), "1.00ms");
        assert_eq!(duration_ns(999_996_000.0), "1.00s");
        assert_eq!(duration_ns(1_005_000.0), "1.01ms");
        assert_eq!(format!("[{:>8}]", Duration(12_345.0)), "[  12.3µs]");
        assert_eq!(duration_ns(4_050_000.0), "4.05ms");
        assert_eq!(duration_ns(0.0), "0ns");
        assert_eq!(decimal(u64::MAX, &mut [0; 20]), u64::MAX.to_string());
        assert_eq!(bytes(512.0), "512B");
        assert_eq!(bytes(4096.0), "4.0KiB");
        assert_eq!(bytes(1.5 * 1024.0 * 1024.0), "1.5MiB");
        assert_eq!(utc(0.0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400.5), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_700_000_000.0), "2023-11-14 22:13:20 UTC");
        assert_eq!(utc(-5.0), "1970-01-01 00:00:00 UTC");
    }
}
