//! Human-readable numbers for terminal output (the unit is chosen per value), and times as
//! people type them on the command line.

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
        let n = compose(v, decimals, unit, buf);
        std::str::from_utf8(&buf[..n]).unwrap_or("?")
    }
}

/// A whole number of nanoseconds as [`Duration`] shows it, by integer arithmetic only (snoop's
/// text, per IO): the bytes, and how many characters wide they are.
pub fn ns_text(ns: u64, buf: &mut [u8; 32]) -> (&[u8], usize) {
    // The bounds are Duration's (999.5, 999_950, 999_995_000) for whole numbers.
    let (scale, decimals, unit) = if ns < 1000 {
        (1, 0, "ns")
    } else if ns < 999_950 {
        (100, 1, "µs")
    } else if ns < 999_995_000 {
        (10_000, 2, "ms")
    } else {
        (10_000_000, 2, "s")
    };
    // Halves up, as f64::round does for positive numbers.
    let v = ns / scale + u64::from(ns % scale >= scale.div_ceil(2));
    let n = compose(v, decimals, unit, buf);
    let chars = n - unit.len() + unit.chars().count();
    (&buf[..n], chars)
}

/// `v` with `decimals` of its digits after the point, then `unit`, into `buf`; the length.
/// Digits go straight to their place: a copy of a few bytes is a call to memcpy.
fn compose(v: u64, decimals: usize, unit: &str, buf: &mut [u8; 32]) -> usize {
    let pow = [1, 10, 100][decimals];
    let mut n = put_digits(buf, 0, v / pow);
    if decimals > 0 {
        buf[n] = b'.';
        let mut frac = v % pow;
        for i in (n + 1..=n + decimals).rev() {
            buf[i] = b'0' + (frac % 10) as u8;
            frac /= 10;
        }
        n += 1 + decimals;
    }
    for &b in unit.as_bytes() {
        buf[n] = b;
        n += 1;
    }
    n
}

/// `v`'s decimal digits into `buf` from `at`; where they end.
fn put_digits(buf: &mut [u8; 32], at: usize, v: u64) -> usize {
    let mut len = 1;
    let mut x = v / 10;
    while x > 0 {
        len += 1;
        x /= 10;
    }
    let mut x = v;
    for i in (at..at + len).rev() {
        buf[i] = b'0' + (x % 10) as u8;
        x /= 10;
    }
    at + len
}

impl std::fmt::Display for Duration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(Duration(self.0).text(&mut [0; 32]))
    }
}

/// `v` in decimal, into `buf`.
pub fn decimal(v: u64, buf: &mut [u8; 20]) -> &str {
    std::str::from_utf8(digits(v, buf)).unwrap_or("?")
}

/// `v`'s decimal digits (ASCII), into `buf`.
pub fn digits(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    &buf[i..]
}

/// Now, in ms since the Unix epoch (the recorder's clock: views ask in wall-clock time).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
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

/// A length of time as people type it: `90s`, `10m`, `1h30m`, `2d`, `1.5h`, or plain seconds.
pub fn parse_span(text: &str) -> Result<f64, String> {
    let bad = || format!("'{text}' is not a length of time: give it as 30s, 10m, 1h30m or 2d");
    let s = text.trim();
    if let Ok(v) = s.parse::<f64>() {
        return (v > 0.0 && v.is_finite()).then_some(v).ok_or_else(bad);
    }
    let (mut total, mut rest) = (0.0, s);
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).ok_or_else(bad)?;
        let number: f64 = rest[..digits].parse().map_err(|_| bad())?;
        let unit_len = rest[digits..].find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len() - digits);
        let scale = match rest[digits..digits + unit_len].trim() {
            "s" | "sec" | "secs" => 1.0,
            "m" | "min" | "mins" => 60.0,
            "h" | "hour" | "hours" => 3600.0,
            "d" | "day" | "days" => 86_400.0,
            _ => return Err(bad()),
        };
        total += number * scale;
        rest = &rest[digits + unit_len..];
    }
    (total > 0.0 && total.is_finite()).then_some(total).ok_or_else(bad)
}

/// A latency as people type it, in ns: `5ms`, `250us` (or `µs`), `1.5s`, `800ns`.
pub fn parse_latency(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let at = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let scale = match s[at..].trim() {
        "ns" => 1.0,
        "us" | "µs" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        _ => {
            return Err(format!(
                "'{text}' is not a latency: give it with its unit, as 800ns, 250us, 5ms or 1.5s"
            ));
        }
    };
    match s[..at].parse::<f64>() {
        Ok(v) if v >= 0.0 && v.is_finite() => Ok((v * scale).round() as u64),
        _ => Err(format!("'{text}' is not a latency: give it with its unit, as 800ns, 250us, 5ms or 1.5s")),
    }
}

/// A point in time, in seconds since the Unix epoch: RFC 3339 (`2026-11-30T15:04:05Z`,
/// `2026-11-30T16:04:05+01:00`), `now`, or a length of time ago (`10m`, `10m ago`, `-10m`).
pub fn parse_time(text: &str, now: f64) -> Result<f64, String> {
    let s = text.trim();
    if s == "now" {
        return Ok(now);
    }
    if s.len() >= 19 && s.as_bytes()[4] == b'-' {
        return parse_rfc3339(s).ok_or_else(|| {
            format!(
                "'{text}' is not an RFC 3339 time such as 2026-11-30T15:04:05Z or 2026-11-30T16:04:05+01:00"
            )
        });
    }
    let ago = s.strip_prefix('-').or_else(|| s.strip_suffix("ago")).unwrap_or(s);
    parse_span(ago).map(|span| now - span).map_err(|_| {
        format!(
            "'{text}' is not a time: give RFC 3339 (2026-11-30T15:04:05Z), `now`, or a time ago (10m, 1h ago)"
        )
    })
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
    era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468
}

fn parse_rfc3339(s: &str) -> Option<f64> {
    let b = s.as_bytes();
    let num = |from: usize, len: usize| -> Option<i64> {
        let part = s.get(from..from + len)?;
        part.bytes().all(|c| c.is_ascii_digit()).then(|| part.parse().ok())?
    };
    let sep = |at: usize, c: &[u8]| b.get(at).is_some_and(|x| c.contains(x));
    if !(sep(4, b"-") && sep(7, b"-") && sep(10, b"Tt ") && sep(13, b":") && sep(16, b":")) {
        return None;
    }
    let (y, mo, d, h, mi, sec) = (num(0, 4)?, num(5, 2)?, num(8, 2)?, num(11, 2)?, num(14, 2)?, num(17, 2)?);
    let leap = y % 4 == 0 && (y % 100 != 0 || y % 400 == 0);
    let month_days = [31, if leap { 29 } else { 28 }, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    if !(1..=12).contains(&mo) || d < 1 || d > month_days[mo as usize - 1] || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let mut rest = &s[19..];
    let mut frac = 0.0;
    if let Some(f) = rest.strip_prefix('.') {
        let n = f.find(|c: char| !c.is_ascii_digit()).unwrap_or(f.len());
        if n == 0 {
            return None;
        }
        frac = format!("0.{}", &f[..n]).parse().ok()?;
        rest = &f[n..];
    }
    let offset = match rest {
        "Z" | "z" => 0,
        _ => {
            let sign = match rest.as_bytes().first()? {
                b'+' => 1,
                b'-' => -1,
                _ => return None,
            };
            let (oh, om) = (rest.get(1..3)?.parse::<i64>().ok()?, rest.get(4..6)?.parse::<i64>().ok()?);
            if rest.len() != 6 || &rest[3..4] != ":" || oh > 23 || om > 59 {
                return None;
            }
            sign * (oh * 3600 + om * 60)
        }
    };
    Some((days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + sec - offset) as f64 + frac)
}

/// Seconds since the Unix epoch as RFC 3339 in UTC, to the second (`2026-11-30T15:04:05Z`).
pub fn rfc3339(unix_s: f64) -> String {
    let secs = unix_s.floor() as i64;
    let (days, day_s) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // The inverse of days_from_civil (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", day_s / 3600, day_s % 3600 / 60, day_s % 60)
}

/// `s` in at most `max` characters: where longer, its end (a cgroup path's end names it: the
/// unit, the container), marked with a leading `…`.
pub fn keep_end(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        return s.to_owned();
    }
    std::iter::once('…').chain(s.chars().skip(n - max.saturating_sub(1))).collect()
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

    #[test]
    fn whole_nanoseconds_read_as_duration_shows_them() {
        let bounds = [0, 1, 999, 1000, 1049, 1050, 1051, 99_949, 99_950, 999_949, 999_950, 999_951];
        let more = [1_004_999, 1_005_000, 999_994_999, 999_995_000, 1_234_567_890, 1_000_000_000_000];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let sweep = (0..10_000).map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % 10u64.pow(1 + (x % 11) as u32)
        });
        for ns in bounds.into_iter().chain(more).chain(sweep) {
            let mut buf = [0; 32];
            let (text, chars) = ns_text(ns, &mut buf);
            let want = duration_ns(ns as f64);
            assert_eq!(std::str::from_utf8(text), Ok(want.as_str()), "{ns}");
            assert_eq!(chars, want.chars().count(), "{ns}");
        }
    }

    #[test]
    fn spans_and_times_as_people_type_them() {
        assert_eq!(parse_span("30"), Ok(30.0));
        assert_eq!(parse_span("90s"), Ok(90.0));
        assert_eq!(parse_span("10m"), Ok(600.0));
        assert_eq!(parse_span("1h30m"), Ok(5400.0));
        assert_eq!(parse_span("1.5h"), Ok(5400.0));
        assert_eq!(parse_span("2d"), Ok(172_800.0));
        for bad in ["", "0", "-5", "10x", "m", "1h30", "ten minutes"] {
            assert!(parse_span(bad).unwrap_err().contains("30s, 10m, 1h30m"), "{bad}");
        }
        let now = 1_764_515_045.0; // 2025-11-30T15:04:05Z
        assert_eq!(rfc3339(now), "2025-11-30T15:04:05Z");
        assert_eq!(parse_time("2025-11-30T15:04:05Z", 0.0), Ok(now));
        assert_eq!(parse_time("2025-11-30T16:04:05+01:00", 0.0), Ok(now));
        assert_eq!(parse_time("2025-11-30t15:04:05.25z", 0.0), Ok(now + 0.25));
        assert_eq!(parse_time("1970-01-01T00:00:00Z", 5.0), Ok(0.0));
        assert_eq!(parse_time("2024-02-29T00:00:00Z", 0.0).map(rfc3339), Ok("2024-02-29T00:00:00Z".into()));
        assert_eq!(parse_time("now", now), Ok(now));
        for ago in ["10m", "10m ago", "-10m", " 10 m ago"] {
            assert_eq!(parse_time(ago, now), Ok(now - 600.0), "{ago}");
        }
        for bad in
            ["2025-02-29T00:00:00Z", "2025-11-30T25:00:00Z", "2025-11-30T15:04:05", "2025-11-30T15:04:05+1"]
        {
            assert!(parse_time(bad, now).unwrap_err().contains("RFC 3339"), "{bad}");
        }
        assert!(parse_time("yesterday", now).unwrap_err().contains("not a time"));
        assert_eq!(rfc3339(-1.0), "1969-12-31T23:59:59Z");
        assert_eq!(parse_latency("5ms"), Ok(5_000_000));
        assert_eq!(parse_latency("250us"), Ok(250_000));
        assert_eq!(parse_latency("250µs"), Ok(250_000));
        assert_eq!(parse_latency("1.5s"), Ok(1_500_000_000));
        assert_eq!(parse_latency("800ns"), Ok(800));
        for bad in ["5", "ms", "-1ms", "5 hours"] {
            assert!(parse_latency(bad).unwrap_err().contains("with its unit"), "{bad}");
        }
    }
}
