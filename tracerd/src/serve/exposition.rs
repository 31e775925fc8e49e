//! The three exposition formats of one set of metric families, chosen per scrape by the
//! `Accept` header: Prometheus text 0.0.4 (the default), OpenMetrics 1.0 text (exemplars on
//! histogram buckets), and the delimited protobuf `io.prometheus.client.MetricFamily` (native,
//! exponential histograms beside the classic buckets). The metrics are built once as
//! [`Family`]s; each format only writes them.

use std::fmt::Write;

/// The classic histograms' bucket upper bounds (seconds), shared by the series and their
/// exemplars: 1-2-5 steps from 1 µs to 50 s, then 60 s (the range top).
pub const BUCKETS_S: [f64; 25] = [
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5,
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 60.0,
];

/// A scrape's format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Text,
    OpenMetrics,
    Protobuf,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Protobuf => {
                "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited"
            }
        }
    }

    /// The format an `Accept` header prefers (by q-value, then in its own order); text when
    /// it names none tracerd serves.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else { return Format::Text };
        let mut best = (Format::Text, 0.0f64);
        for range in accept.split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let params: Vec<(String, String)> = parts
                .filter_map(|p| p.split_once('='))
                .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().trim_matches('"').to_owned()))
                .collect();
            let param = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
            let q = param("q").and_then(|q| q.parse().ok()).unwrap_or(1.0);
            let format = match media.as_str() {
                "application/vnd.google.protobuf"
                    if param("proto") == Some("io.prometheus.client.MetricFamily")
                        && param("encoding") == Some("delimited") =>
                {
                    Format::Protobuf
                }
                "application/openmetrics-text"
                    if matches!(param("version"), None | Some("1.0.0" | "0.0.1")) =>
                {
                    Format::OpenMetrics
                }
                "text/plain" | "*/*" | "text/*" => Format::Text,
                _ => continue,
            };
            if q > best.1 {
                best = (format, q);
            }
        }
        best.0
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

pub type Labels = Vec<(&'static str, String)>;

/// One metric family: its samples share a name, help and type. Counter names end in `_total`
/// (the text format's convention; OpenMetrics names the family without it).
#[derive(Debug)]
pub struct Family {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub samples: Vec<Sample>,
}

#[derive(Debug)]
pub struct Sample {
    pub labels: Labels,
    pub value: Value,
}

#[derive(Debug)]
pub enum Value {
    Number(f64),
    Histogram(Box<Hist>),
}

/// A histogram sample: classic cumulative buckets (the `+Inf` one is `count`), an exemplar
/// per bucket where one is known (index `buckets.len()` is `+Inf`'s), and the native buckets
/// when the scrape asked for them.
#[derive(Debug, Default)]
pub struct Hist {
    /// (upper bound, cumulative count).
    pub buckets: Vec<(f64, u64)>,
    pub count: u64,
    pub sum: f64,
    pub exemplars: Vec<Option<Exemplar>>,
    pub native: Option<Native>,
}

/// An IO that fell in a bucket: who did it, and its time in seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Exemplar {
    pub labels: Labels,
    pub value: f64,
    pub unix_s: f64,
}

/// Native histogram buckets of one schema: bucket `i` holds values in (base^(i-1), base^i],
/// base = 2^(2^-schema).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Native {
    pub schema: i32,
    pub zero_count: u64,
    /// (index, count), ascending, counts non-zero.
    pub buckets: Vec<(i32, u64)>,
}

/// Resolution of the native histograms: 8 buckets per power of two (each 9 % wide), finer
/// than the kernel's buckets (at most 28 %) and than Prometheus's default of schema 3 needs.
pub const SCHEMA: i32 = 3;
/// Values at or below this are in the zero bucket (client_golang's default).
pub const ZERO_THRESHOLD: f64 = 2.938_735_877_055_719e-39;

impl Native {
    /// The bucket index of `v` (seconds, > the zero threshold).
    pub fn index(schema: i32, v: f64) -> i32 {
        (v.log2() * f64::from(1 << schema)).ceil() as i32
    }

    /// Upper bound of bucket `i`.
    pub fn upper(schema: i32, i: i32) -> f64 {
        (f64::from(i) / f64::from(1 << schema)).exp2()
    }

    /// Builds the buckets from (value in seconds, count) pairs in any order.
    pub fn from_values(values: impl IntoIterator<Item = (f64, u64)>) -> Native {
        let mut n = Native { schema: SCHEMA, ..Default::default() };
        let mut by_index = std::collections::BTreeMap::new();
        for (v, c) in values {
            if c == 0 {
                continue;
            }
            if v <= ZERO_THRESHOLD {
                n.zero_count += c;
            } else {
                *by_index.entry(Native::index(SCHEMA, v)).or_insert(0) += c;
            }
        }
        n.buckets = by_index.into_iter().collect();
        n
    }
}

/// Label text `a="x",b="y"` (escaped).
fn label_text(labels: &[(&'static str, String)]) -> String {
    let mut s = String::new();
    for (i, (k, v)) in labels.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{k}=\"{}\"", escape(v));
    }
    s
}

/// Escapes a label value (backslash, double quote, newline).
pub fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

fn sample_line(
    out: &mut String,
    name: &str,
    labels: &str,
    extra: Option<(&str, &str)>,
    value: impl std::fmt::Display,
) {
    match (labels.is_empty(), extra) {
        (true, None) => {
            let _ = write!(out, "{name} {value}");
        }
        (true, Some((k, v))) => {
            let _ = write!(out, "{name}{{{k}=\"{v}\"}} {value}");
        }
        (false, None) => {
            let _ = write!(out, "{name}{{{labels}}} {value}");
        }
        (false, Some((k, v))) => {
            let _ = write!(out, "{name}{{{labels},{k}=\"{v}\"}} {value}");
        }
    }
}

/// The Prometheus text format (0.0.4), or OpenMetrics text with exemplars.
pub fn text(families: &[Family], openmetrics: bool) -> String {
    let mut out = String::with_capacity(64 * 1024);
    for f in families {
        let family = match (openmetrics, f.kind) {
            (true, Kind::Counter) => f.name.strip_suffix("_total").unwrap_or(f.name),
            _ => f.name,
        };
        let kind = match f.kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        };
        // OpenMetrics escapes double quotes in HELP too.
        let help = if openmetrics { f.help.replace('"', "\\\"") } else { f.help.to_owned() };
        let _ = writeln!(out, "# HELP {family} {help}\n# TYPE {family} {kind}");
        for s in &f.samples {
            let labels = label_text(&s.labels);
            match &s.value {
                Value::Number(v) => {
                    sample_line(&mut out, f.name, &labels, None, v);
                    out.push('\n');
                }
                Value::Histogram(h) => {
                    let bucket = format!("{}_bucket", f.name);
                    let les: Vec<String> =
                        h.buckets.iter().map(|(le, _)| le.to_string()).chain(["+Inf".to_owned()]).collect();
                    let counts = h.buckets.iter().map(|(_, n)| *n).chain([h.count]);
                    for (i, (le, n)) in les.iter().zip(counts).enumerate() {
                        sample_line(&mut out, &bucket, &labels, Some(("le", le)), n);
                        if let (true, Some(Some(e))) = (openmetrics, h.exemplars.get(i)) {
                            let _ =
                                write!(out, " # {{{}}} {} {:.3}", label_text(&e.labels), e.value, e.unix_s);
                        }
                        out.push('\n');
                    }
                    sample_line(&mut out, &format!("{}_sum", f.name), &labels, None, h.sum);
                    out.push('\n');
                    sample_line(&mut out, &format!("{}_count", f.name), &labels, None, h.count);
                    out.push('\n');
                }
            }
        }
    }
    if openmetrics {
        out.push_str("# EOF\n");
    }
    out
}

/// Protobuf wire format, by hand: the few message types of metrics.proto need no generated
/// code (and no protoc at build time).
mod pb {
    pub fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push(v as u8 | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
        varint(out, u64::from(field) << 3 | u64::from(wire));
    }

    pub fn uint(out: &mut Vec<u8>, field: u32, v: u64) {
        key(out, field, 0);
        varint(out, v);
    }

    pub fn sint(out: &mut Vec<u8>, field: u32, v: i64) {
        key(out, field, 0);
        varint(out, ((v << 1) ^ (v >> 63)) as u64);
    }

    pub fn double(out: &mut Vec<u8>, field: u32, v: f64) {
        key(out, field, 1);
        out.extend_from_slice(&v.to_le_bytes());
    }

    pub fn bytes(out: &mut Vec<u8>, field: u32, b: &[u8]) {
        key(out, field, 2);
        varint(out, b.len() as u64);
        out.extend_from_slice(b);
    }

    /// A nested message, written by `f`.
    pub fn message(out: &mut Vec<u8>, field: u32, f: impl FnOnce(&mut Vec<u8>)) {
        let mut inner = Vec::new();
        f(&mut inner);
        bytes(out, field, &inner);
    }
}

fn pb_labels(out: &mut Vec<u8>, field: u32, labels: &[(&'static str, String)]) {
    for (k, v) in labels {
        pb::message(out, field, |l| {
            pb::bytes(l, 1, k.as_bytes());
            pb::bytes(l, 2, v.as_bytes());
        });
    }
}

fn pb_exemplar(out: &mut Vec<u8>, field: u32, e: &Exemplar) {
    pb::message(out, field, |m| {
        pb_labels(m, 1, &e.labels);
        pb::double(m, 2, e.value);
        pb::message(m, 3, |t| {
            pb::uint(t, 1, e.unix_s.trunc() as u64);
            pb::uint(t, 2, (e.unix_s.fract() * 1e9) as u64);
        });
    });
}

/// Delimited `io.prometheus.client.MetricFamily` messages.
pub fn protobuf(families: &[Family]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 * 1024);
    for f in families {
        let mut fam = Vec::new();
        pb::bytes(&mut fam, 1, f.name.as_bytes());
        pb::bytes(&mut fam, 2, f.help.as_bytes());
        // MetricType: COUNTER 0, GAUGE 1, HISTOGRAM 4.
        pb::uint(
            &mut fam,
            3,
            match f.kind {
                Kind::Counter => 0,
                Kind::Gauge => 1,
                Kind::Histogram => 4,
            },
        );
        for s in &f.samples {
            pb::message(&mut fam, 4, |m| {
                pb_labels(m, 1, &s.labels);
                match (&s.value, f.kind) {
                    (Value::Number(v), Kind::Counter) => pb::message(m, 3, |c| pb::double(c, 1, *v)),
                    (Value::Number(v), _) => pb::message(m, 2, |g| pb::double(g, 1, *v)),
                    (Value::Histogram(h), _) => pb::message(m, 7, |hm| pb_histogram(hm, h)),
                }
            });
        }
        pb::varint(&mut out, fam.len() as u64);
        out.extend_from_slice(&fam);
    }
    out
}

fn pb_histogram(out: &mut Vec<u8>, h: &Hist) {
    pb::uint(out, 1, h.count);
    pb::double(out, 2, h.sum);
    for (i, (le, n)) in h.buckets.iter().enumerate() {
        pb::message(out, 3, |b| {
            pb::uint(b, 1, *n);
            pb::double(b, 2, *le);
            if let Some(Some(e)) = h.exemplars.get(i) {
                pb_exemplar(b, 3, e);
            }
        });
    }
    let Some(n) = &h.native else { return };
    pb::sint(out, 5, i64::from(n.schema));
    pb::double(out, 6, ZERO_THRESHOLD);
    pb::uint(out, 7, n.zero_count);
    // Spans of consecutive indices; a histogram without observations gets a no-op span, or
    // it would read as a classic one.
    let mut spans: Vec<(i32, u32)> = Vec::new();
    let mut last: Option<i32> = None;
    for &(i, _) in &n.buckets {
        match (last, spans.last_mut()) {
            (Some(l), Some(span)) if i == l + 1 => span.1 += 1,
            (Some(l), _) => spans.push((i - l - 1, 1)),
            (None, _) => spans.push((i, 1)),
        }
        last = Some(i);
    }
    if spans.is_empty() {
        spans.push((0, 0));
    }
    for (offset, length) in spans {
        pb::message(out, 12, |s| {
            pb::sint(s, 1, i64::from(offset));
            pb::uint(s, 2, u64::from(length));
        });
    }
    let mut previous = 0i64;
    for &(_, count) in &n.buckets {
        pb::sint(out, 13, count as i64 - previous);
        previous = count as i64;
    }
    // Native histograms carry their exemplars apart (with timestamps, which ours have).
    for e in h.exemplars.iter().flatten() {
        pb_exemplar(out, 16, e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_headers_choose_the_format() {
        assert_eq!(Format::negotiate(None), Format::Text);
        assert_eq!(Format::negotiate(Some("text/plain;version=0.0.4")), Format::Text);
        // Prometheus 2.x, classic: OpenMetrics first.
        let om = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(Format::negotiate(Some(om)), Format::OpenMetrics);
        // With native histograms: protobuf first.
        let pb = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.7,text/plain;version=0.0.4;q=0.3";
        assert_eq!(Format::negotiate(Some(pb)), Format::Protobuf);
        assert_eq!(
            Format::negotiate(Some("application/vnd.google.protobuf;q=1,text/plain;q=0.1")),
            Format::Text
        );
        assert_eq!(Format::negotiate(Some("application/json")), Format::Text);
    }

    #[test]
    fn native_buckets_are_upper_inclusive_powers_of_the_base() {
        assert_eq!(Native::index(3, 1.0), 0);
        assert_eq!(Native::index(3, 1.0001), 1);
        assert_eq!(Native::index(3, 0.5), -8);
        for i in [-200, -80, -1, 0, 5] {
            let up = Native::upper(3, i);
            assert_eq!(Native::index(3, up * 0.999), i);
            assert_eq!(Native::index(3, up * 1.001), i + 1);
        }
        let n = Native::from_values([(20e-6, 3), (21e-6, 1), (1e-3, 2), (0.0, 1)]);
        assert_eq!(n.zero_count, 1);
        assert_eq!(n.buckets.iter().map(|b| b.1).sum::<u64>(), 6);
    }

    fn hist_family(native: Option<Native>) -> Vec<Family> {
        let e =
            Exemplar { labels: vec![("pid", "7".into()), ("comm", "dd".into())], value: 3e-6, unix_s: 1.5 };
        vec![
            Family {
                name: "x_seconds",
                help: "h \"q\"",
                kind: Kind::Histogram,
                samples: vec![Sample {
                    labels: vec![("device", "loop0".into())],
                    value: Value::Histogram(Box::new(Hist {
                        buckets: vec![(1e-6, 0), (5e-6, 1)],
                        count: 2,
                        sum: 0.5,
                        exemplars: vec![None, Some(e), None],
                        native,
                    })),
                }],
            },
            Family {
                name: "y_total",
                help: "c",
                kind: Kind::Counter,
                samples: vec![Sample { labels: vec![], value: Value::Number(4.0) }],
            },
        ]
    }

    #[test]
    fn openmetrics_names_counter_families_without_total_and_carries_exemplars() {
        let text = text(&hist_family(None), true);
        assert!(text.contains("# TYPE y counter\ny_total 4\n"), "{text}");
        assert!(text.contains("# HELP x_seconds h \\\"q\\\"\n"));
        assert!(text.contains("x_seconds_bucket{device=\"loop0\",le=\"0.000005\"} 1 # {pid=\"7\",comm=\"dd\"} 0.000003 1.500\n"), "{text}");
        assert!(text.contains("x_seconds_bucket{device=\"loop0\",le=\"+Inf\"} 2\n"));
        assert!(text.ends_with("# EOF\n"));
        let classic = super::text(&hist_family(None), false);
        assert!(
            !classic.contains(" # {")
                && !classic.contains("# EOF")
                && classic.contains("# TYPE y_total counter")
        );
    }

    fn varint(b: &mut &[u8]) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let byte = b[0];
            *b = &b[1..];
            v |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return v;
            }
            shift += 7;
        }
    }

    /// Splits delimited messages.
    fn delimited(mut b: &[u8]) -> Vec<Vec<u8>> {
        let mut out = vec![];
        while !b.is_empty() {
            let n = varint(&mut b) as usize;
            out.push(b[..n].to_vec());
            b = &b[n..];
        }
        out
    }

    /// Reads back what `protobuf` wrote: (field, wire type, payload) triples.
    fn fields(mut b: &[u8]) -> Vec<(u32, u8, Vec<u8>)> {
        let mut out = vec![];
        while !b.is_empty() {
            let key = varint(&mut b);
            let (field, wire) = ((key >> 3) as u32, (key & 7) as u8);
            let payload = match wire {
                0 => varint(&mut b).to_le_bytes().to_vec(),
                1 => {
                    let p = b[..8].to_vec();
                    b = &b[8..];
                    p
                }
                2 => {
                    let n = varint(&mut b) as usize;
                    let p = b[..n].to_vec();
                    b = &b[n..];
                    p
                }
                w => panic!("wire type {w}"),
            };
            out.push((field, wire, payload));
        }
        out
    }

    #[test]
    fn protobuf_is_delimited_metric_families_with_native_spans_and_deltas() {
        let native = Native { schema: 3, zero_count: 0, buckets: vec![(-150, 1), (-149, 3), (-140, 2)] };
        let families = delimited(&protobuf(&hist_family(Some(native))));
        assert_eq!(families.len(), 2);
        let family = fields(&families[0]);
        assert_eq!(family[0], (1, 2, b"x_seconds".to_vec()));
        assert_eq!((family[2].0, family[2].2[0]), (3, 4), "HISTOGRAM");
        let metric = fields(&family[3].2);
        let hist = fields(&metric.iter().find(|f| f.0 == 7).unwrap().2);
        let get = |n: u32| hist.iter().filter(|f| f.0 == n).map(|f| f.2.clone()).collect::<Vec<_>>();
        assert_eq!(u64::from_le_bytes(get(1)[0][..8].try_into().unwrap()), 2, "count");
        assert_eq!(get(3).len(), 2, "classic buckets stay");
        assert_eq!(u64::from_le_bytes(get(5)[0][..8].try_into().unwrap()), 6, "schema 3, zigzag");
        let spans: Vec<_> = get(12).iter().map(|s| fields(s)).collect();
        let unzig = |p: &[u8]| {
            let v = u64::from_le_bytes(p[..8].try_into().unwrap());
            (v >> 1) as i64 ^ -((v & 1) as i64)
        };
        assert_eq!(spans.len(), 2);
        assert_eq!(
            (unzig(&spans[0][0].2), u64::from_le_bytes(spans[0][1].2[..8].try_into().unwrap())),
            (-150, 2)
        );
        assert_eq!(
            (unzig(&spans[1][0].2), u64::from_le_bytes(spans[1][1].2[..8].try_into().unwrap())),
            (8, 1)
        );
        let deltas: Vec<i64> = get(13).iter().map(|d| unzig(d)).collect();
        assert_eq!(deltas, [1, 2, -1]);
        assert_eq!(get(16).len(), 1, "the exemplar, timestamped");
        assert_eq!(fields(&families[1])[0], (1, 2, b"y_total".to_vec()));
    }
}
