//! Human-readable numbers for terminal output: the unit is chosen per value.

/// Nanoseconds as `850ns`, `12.3µs`, `4.56ms`, `1.23s`.
pub fn duration_ns(ns: f64) -> String {
    if ns < 1e3 {
        format!("{ns:.0}ns")
    } else if ns < 1e6 {
        format!("{:.1}µs", ns / 1e3)
    } else if ns < 1e9 {
        format!("{:.2}ms", ns / 1e6)
    } else {
        format!("{:.2}s", ns / 1e9)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_follow_the_value() {
        assert_eq!(duration_ns(850.0), "850ns");
        assert_eq!(duration_ns(12_345.0), "12.3µs");
        assert_eq!(duration_ns(4_560_000.0), "4.56ms");
        assert_eq!(duration_ns(1.234e9), "1.23s");
        assert_eq!(bytes(512.0), "512B");
        assert_eq!(bytes(4096.0), "4.0KiB");
        assert_eq!(bytes(1.5 * 1024.0 * 1024.0), "1.5MiB");
    }
}
