//! A biolatency-style log2 histogram of one stage's HdrHistogram: one row per power-of-two
//! range of nanoseconds, with its count, percentage and a bar of `*` scaled to the largest count.
//!
//! Bucket edges. Row `[from, to)` holds the values v with from <= v < to; `to` is twice `from`.
//! Counts come from the HdrHistogram's own buckets (`iter_recorded`), each assigned to the row
//! holding its lowest value. That is exact: an HdrHistogram bucket spans a power-of-two width w
//! starting at a multiple of w, so a power of two strictly inside it would have to be smaller
//! than w, which only happens in the histogram's first bucket [0, unit) (unit: the histogram's
//! resolution at zero, 64 ns for the default 100 ns lowest value). That bucket is the first row,
//! `0ns -> 64ns`; every other row is [2^k, 2^(k+1)) ns and counts exactly the IOs in it. Values
//! above the histogram's highest trackable value (60 s by default) were recorded at that value,
//! so they count in its row. Rows run from the first non-empty range to the last, with the empty
//! ranges between them printed too, so the shape of the distribution shows.

use std::{collections::BTreeMap, fmt::Write as _};

use hdrhistogram::Histogram;
use serde::{Serialize, Serializer, ser::SerializeStruct};

use crate::{units, view::style::Style};

/// Width of the bar of the row with the largest count.
pub const BAR_WIDTH: usize = 40;

/// One row: the IOs that took from `from_ns` (inclusive) to `to_ns` (exclusive).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Log2Bucket {
    pub from_ns: u64,
    pub to_ns: u64,
    pub count: u64,
}

/// In `report --json` as `{"from_s", "to_s", "count"}`: the report's times are seconds.
impl Serialize for Log2Bucket {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Log2Bucket", 3)?;
        st.serialize_field("from_s", &(self.from_ns as f64 / 1e9))?;
        st.serialize_field("to_s", &(self.to_ns as f64 / 1e9))?;
        st.serialize_field("count", &self.count)?;
        st.end()
    }
}

/// Row 0 is [0, unit); row i >= 1 is [unit 2^(i-1), unit 2^i).
fn row_of(value: u64, unit: u64) -> u32 {
    if value < unit { 0 } else { value.ilog2() - unit.ilog2() + 1 }
}

fn edges(row: u32, unit: u64) -> (u64, u64) {
    // Saturating: the top row of a histogram reaching 2^63 ns ends at u64::MAX.
    let pow = |i: u32| if unit.ilog2() + i >= 64 { u64::MAX } else { unit << i };
    if row == 0 { (0, unit) } else { (pow(row - 1), pow(row)) }
}

/// The log2 rows of a histogram (empty for an empty one).
pub fn buckets(h: &Histogram<u64>) -> Vec<Log2Bucket> {
    // The first HdrHistogram bucket's width: 2^unit_magnitude.
    let unit = h.highest_equivalent(0) + 1;
    let mut counts: BTreeMap<u32, u64> = BTreeMap::new();
    for v in h.iter_recorded() {
        let lowest = h.lowest_equivalent(v.value_iterated_to());
        *counts.entry(row_of(lowest, unit)).or_default() += v.count_at_value();
    }
    let (Some(&first), Some(&last)) = (counts.keys().next(), counts.keys().next_back()) else {
        return vec![];
    };
    (first..=last)
        .map(|row| {
            let (from_ns, to_ns) = edges(row, unit);
            Log2Bucket { from_ns, to_ns, count: counts.get(&row).copied().unwrap_or(0) }
        })
        .collect()
}

/// The histogram as text, without colour.
pub fn render(h: &Histogram<u64>) -> String {
    render_buckets(&buckets(h), Style::PLAIN)
}

/// Rows as text, indented two spaces like report's tables:
///
/// ```text
///   range                count percent  distribution
///     4.1µs -> 8.2µs        12    0.3%  |                                        |
///    8.2µs -> 16.4µs      3012   75.3%  |****************************************|
/// ```
///
/// The edges use the tables' units (so 4096 ns shows as 4.1µs); the arrows line up.
pub fn render_buckets(rows: &[Log2Bucket], style: Style) -> String {
    let mut out = String::new();
    if rows.is_empty() {
        let _ = writeln!(out, "  (no samples)");
        return out;
    }
    let total: u64 = rows.iter().map(|r| r.count).sum();
    let max = rows.iter().map(|r| r.count).max().unwrap_or(0).max(1);
    let labels: Vec<(String, String)> = rows
        .iter()
        .map(|r| (units::duration_ns(r.from_ns as f64), units::duration_ns(r.to_ns as f64)))
        .collect();
    let chars = |s: &String| s.chars().count();
    let wf = labels.iter().map(|(f, _)| chars(f)).max().unwrap_or(0);
    let wt = labels.iter().map(|(_, t)| chars(t)).max().unwrap_or(0);
    let wc = rows.iter().map(|r| r.count.to_string().len()).max().unwrap_or(0).max("count".len());
    let header =
        format!("  {:<w$}  {:>wc$}  {:>7}  distribution", "range", "count", "percent", w = wf + 4 + wt);
    let _ = writeln!(out, "{}", style.bold(&header));
    for (r, (from, to)) in rows.iter().zip(&labels) {
        // Integer arithmetic: the largest row gets exactly BAR_WIDTH stars.
        let stars = (r.count as u128 * BAR_WIDTH as u128 / max as u128) as usize;
        let pct = 100.0 * r.count as f64 / total.max(1) as f64;
        let _ = writeln!(
            out,
            "  {from:>wf$} -> {to:<wt$}  {:>wc$}  {pct:>6.1}%  |{}{}|",
            r.count,
            style.cyan(&"*".repeat(stars)),
            " ".repeat(BAR_WIDTH - stars)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::aggregate::{HIGHEST_NS, LOWEST_NS, SIGFIG};

    fn hist(values: &[(u64, u64)]) -> Histogram<u64> {
        let mut h = Histogram::new_with_bounds(LOWEST_NS, HIGHEST_NS, SIGFIG).unwrap();
        for &(v, n) in values {
            h.saturating_record_n(v, n);
        }
        h
    }

    fn rows(h: &Histogram<u64>) -> Vec<(u64, u64, u64)> {
        buckets(h).iter().map(|b| (b.from_ns, b.to_ns, b.count)).collect()
    }

    #[test]
    fn counts_are_exact_per_power_of_two_range_edges_included() {
        // On both sides of the edges 2048 and 4096 ns (multiples of the 64 ns resolution there),
        // and of 131072 ns, where HdrHistogram's buckets double to 128 ns.
        let h = hist(&[
            (2047, 3),
            (2048, 5),
            (3000, 1),
            (4095, 2),
            (4096, 7),
            (131_071, 4),
            (131_072, 6),
            (262_143, 1),
        ]);
        assert_eq!(
            rows(&h),
            vec![
                (1024, 2048, 3),
                (2048, 4096, 8),
                (4096, 8192, 7),
                (8192, 16384, 0),
                (16384, 32768, 0),
                (32768, 65536, 0),
                (65536, 131_072, 4),
                (131_072, 262_144, 7),
            ]
        );
        // The same counts straight from the histogram, range by range.
        for b in buckets(&h) {
            assert_eq!(h.count_between(b.from_ns, b.to_ns - 1), b.count, "{b:?}");
        }
        let text = render(&h);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "  range               count  percent  distribution");
        assert_eq!(
            lines[1],
            "    1.0µs -> 2.0µs        3    10.3%  |***************                         |"
        );
        assert_eq!(
            lines[2],
            "    2.0µs -> 4.1µs        8    27.6%  |****************************************|"
        );
        assert_eq!(
            lines[4],
            "    8.2µs -> 16.4µs       0     0.0%  |                                        |"
        );
        assert_eq!(
            lines[8],
            "  131.1µs -> 262.1µs      7    24.1%  |***********************************     |"
        );
        assert_eq!(lines.len(), 9);
    }

    #[test]
    fn an_empty_histogram_says_so() {
        let h = hist(&[]);
        assert!(buckets(&h).is_empty());
        assert_eq!(render(&h), "  (no samples)\n");
    }

    #[test]
    fn a_single_value_is_one_full_row() {
        let h = hist(&[(20_000, 1)]);
        assert_eq!(rows(&h), vec![(16384, 32768, 1)]);
        assert_eq!(
            render(&h),
            "  range             count  percent  distribution\n  \
             16.4µs -> 32.8µs      1   100.0%  |****************************************|\n"
        );
    }

    #[test]
    fn values_from_nanoseconds_to_minutes() {
        // 10 ns lands in the first bucket [0, 64); 5 minutes is above the 60 s top and counts at it.
        let h =
            hist(&[(10, 2), (100, 3), (1_500, 1), (2_000_000, 4), (3_000_000_000, 5), (300_000_000_000, 6)]);
        let b = buckets(&h);
        assert_eq!(b.first().map(|b| (b.from_ns, b.to_ns, b.count)), Some((0, 64, 2)));
        assert_eq!((b[1].from_ns, b[1].count), (64, 3));
        // 60 s lies in [2^35, 2^36) ns.
        assert_eq!(b.last().map(|b| (b.from_ns, b.to_ns, b.count)), Some((1 << 35, 1 << 36, 6)));
        assert_eq!(b.len(), 31, "every range from [0, 64 ns) to [34.36 s, 68.72 s)");
        assert_eq!(b.iter().map(|b| b.count).sum::<u64>(), h.len());
        assert!(b.windows(2).all(|w| w[0].to_ns == w[1].from_ns), "contiguous");
        let text = render(&h);
        assert!(text.contains("\n       0ns -> 64ns          2     9.5%  |*************   "), "{text}");
        assert!(text.contains(
            "\n    34.36s -> 68.72s        6    28.6%  |****************************************|"
        ));
        // Every row has its arrow, count and bar at the same (character) columns.
        let at = |line: &str, pat: &str| line.find(pat).map(|i| line[..i].chars().count());
        let lines: Vec<&str> = text.lines().skip(1).collect();
        for pat in [" -> ", "%  |"] {
            let cols: Vec<_> = lines.iter().map(|l| at(l, pat)).collect();
            assert!(cols.iter().all(|c| c.is_some() && *c == cols[0]), "{pat}: {cols:?}\n{text}");
        }
        assert!(lines.iter().all(|l| l.chars().count() == lines[0].chars().count()), "{text}");
    }

    #[test]
    fn a_finer_histogram_starts_at_its_own_resolution() {
        // lowest 1 ns: single-nanosecond resolution at the bottom, so rows start at [0, 1), [1, 2).
        let mut h = Histogram::<u64>::new_with_bounds(1, HIGHEST_NS, SIGFIG).unwrap();
        for v in [0, 1, 3, 1000] {
            h.record(v).unwrap();
        }
        let r = rows(&h);
        assert_eq!(&r[..3], &[(0, 1, 1), (1, 2, 1), (2, 4, 1)]);
        assert_eq!(r.last(), Some(&(512, 1024, 1)));
    }

    #[test]
    fn colour_touches_only_the_bars_and_the_header() {
        let h = hist(&[(5_000, 10), (70_000, 1)]);
        let coloured = render_buckets(&buckets(&h), Style::COLOR);
        assert_ne!(coloured, render(&h));
        assert_eq!(crate::view::style::strip(&coloured), render(&h));
        assert!(coloured.contains("|\x1b[36m****"), "{coloured}");
    }

    #[test]
    fn json_rows_are_seconds() {
        let b = Log2Bucket { from_ns: 2048, to_ns: 4096, count: 3 };
        assert_eq!(
            serde_json::to_value(b).unwrap(),
            serde_json::json!({"from_s": 2.048e-6, "to_s": 4.096e-6, "count": 3})
        );
    }
}
