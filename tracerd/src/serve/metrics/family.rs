//! The few moves every family is built from: a family, its labels, a number or histogram
//! sample, and a family of one unlabelled number.

use crate::serve::exposition::{Family, Hist, Kind, Labels, Sample, Value};

/// A family under construction.
pub(super) fn family(name: &'static str, kind: Kind, help: &'static str) -> Family {
    Family { name, help, kind, samples: Vec::new() }
}

pub(super) fn labels<const N: usize>(pairs: [(&'static str, &str); N]) -> Labels {
    pairs.into_iter().map(|(k, v)| (k, v.to_owned())).collect()
}

pub(super) fn number(f: &mut Family, labels: Labels, v: f64) {
    f.samples.push(Sample { labels, value: Value::Number(v) });
}

pub(super) fn histogram(f: &mut Family, labels: Labels, h: Hist) {
    f.samples.push(Sample { labels, value: Value::Histogram(Box::new(h)) });
}

/// A family of one sample without labels.
pub(super) fn single(out: &mut Vec<Family>, name: &'static str, kind: Kind, help: &'static str, v: f64) {
    let mut f = family(name, kind, help);
    number(&mut f, vec![], v);
    out.push(f);
}
