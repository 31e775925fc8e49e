//! Exemplars for the stage histograms: per series and stage, the latest IO seen whole in each
//! Prometheus bucket, with who did it (pid, comm, cgroup) and where (device, sector). IOs are
//! seen whole as records: every IO where the agent aggregates records, and in the kernel's
//! aggregation the slowest of each minute (the slow-IO bar), so there the exemplars are the
//! recent slow IOs.

use std::{collections::HashMap, sync::Arc};

use tracer_common::IoRecord;

use crate::{
    model::op::Op,
    model::stage::Stage,
    serve::exposition::{BUCKETS_S, Exemplar, Labels},
};

/// Buckets per histogram: the classic bounds and +Inf.
const SLOTS: usize = BUCKETS_S.len() + 1;

/// One IO kept as an exemplar.
#[derive(Clone, Debug)]
struct Kept {
    pid: u32,
    comm: Option<Arc<str>>,
    cgroup: Arc<str>,
    sector: u64,
    ns: u64,
    unix_s: f64,
}

/// A series: (device, op, cgroup label where the series carry one).
pub type SeriesKey = (u32, Op, Option<Arc<str>>);

#[derive(Debug, Default)]
pub struct Exemplars {
    by_series: HashMap<SeriesKey, Box<[[Option<Kept>; SLOTS]; Stage::COUNT]>>,
}

/// OpenMetrics bounds an exemplar's label names and values to 128 characters together.
const MAX_LABEL_CHARS: usize = 128;

impl Exemplars {
    /// Keeps `rec` as the exemplar of each stage's bucket it fell in.
    pub fn offer(
        &mut self,
        key: SeriesKey,
        rec: &IoRecord,
        comm: Option<Arc<str>>,
        cgroup: Arc<str>,
        unix_s: f64,
    ) {
        let slots = self
            .by_series
            .entry(key)
            .or_insert_with(|| Box::new(std::array::from_fn(|_| std::array::from_fn(|_| None))));
        Stage::each_of(rec, |stage, ns| {
            let b = bucket(ns);
            slots[stage.index()][b] = Some(Kept {
                pid: rec.pid,
                comm: comm.clone(),
                cgroup: cgroup.clone(),
                sector: rec.sector,
                ns,
                unix_s,
            });
        });
    }

    /// Forgets the exemplars of series that are gone.
    pub fn retain(&mut self, mut keep: impl FnMut(&SeriesKey) -> bool) {
        self.by_series.retain(|k, _| keep(k));
    }

    pub fn series(&self) -> usize {
        self.by_series.len()
    }

    /// The exemplars of one histogram, one per bucket (None where none is kept).
    pub fn of(&self, key: &SeriesKey, stage: Stage, device: &str) -> Vec<Option<Exemplar>> {
        let Some(slots) = self.by_series.get(key) else { return vec![] };
        slots[stage.index()]
            .iter()
            .map(|k| {
                k.as_ref().map(|k| {
                    let mut labels: Labels = vec![
                        ("device", device.to_owned()),
                        ("pid", k.pid.to_string()),
                        ("sector", k.sector.to_string()),
                    ];
                    if let Some(c) = &k.comm {
                        labels.push(("comm", c.to_string()));
                    }
                    let used: usize = labels.iter().map(|(n, v)| n.chars().count() + v.chars().count()).sum();
                    labels.push((
                        "cgroup",
                        crate::units::keep_end(
                            &k.cgroup,
                            MAX_LABEL_CHARS.saturating_sub(used + "cgroup".len()),
                        ),
                    ));
                    Exemplar { labels, value: k.ns as f64 / 1e9, unix_s: k.unix_s }
                })
            })
            .collect()
    }
}

/// The Prometheus bucket of `ns` (index into the bounds; the last is +Inf).
fn bucket(ns: u64) -> usize {
    let s = ns as f64 / 1e9;
    BUCKETS_S.iter().position(|&le| s <= le).unwrap_or(SLOTS - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracer_common::{event, kind};

    #[test]
    fn the_latest_io_of_each_bucket_is_kept_with_who_and_where() {
        let mut e = Exemplars::default();
        let key: SeriesKey = (7, Op::Read, None);
        for (pid, d2c_us) in [(1, 3u64), (2, 30), (3, 4)] {
            let mut r = IoRecord { kind: kind::REQUEST, pid, sector: 80 + pid as u64, ..Default::default() };
            (r.ts[event::D], r.ts[event::C]) = (1000, 1000 + d2c_us * 1000);
            e.offer(key.clone(), &r, Some("dd".into()), "/a".into(), 100.0 + pid as f64);
        }
        let d2c = e.of(&key, Stage::D2c, "loop0");
        assert_eq!(d2c.len(), SLOTS);
        // 3 µs and 4 µs share the (2 µs, 5 µs] bucket: the later one stays.
        let five_us = d2c[2].as_ref().unwrap();
        assert_eq!(five_us.value, 4e-6);
        assert!(
            five_us.labels.contains(&("pid", "3".into()))
                && five_us.labels.contains(&("sector", "83".into()))
        );
        assert!(
            five_us.labels.contains(&("cgroup", "/a".into()))
                && five_us.labels.contains(&("comm", "dd".into()))
        );
        assert_eq!(d2c[5].as_ref().unwrap().value, 30e-6, "(20 µs, 50 µs]");
        assert_eq!(d2c.iter().flatten().count(), 2);
        assert!(e.of(&key, Stage::Q2g, "loop0").iter().all(Option::is_none), "no Q: no Q2G");
        e.retain(|_| false);
        assert_eq!(e.series(), 0);
    }

    #[test]
    fn labels_fit_openmetrics_bound_keeping_the_end_of_the_path() {
        let mut e = Exemplars::default();
        let key: SeriesKey = (7, Op::Write, None);
        let mut r = IoRecord { kind: kind::REQUEST, pid: 4_000_000, sector: u64::MAX, ..Default::default() };
        (r.ts[event::D], r.ts[event::C]) = (1000, 9000);
        let long = format!("/kubepods.slice/{}/cri-containerd-{}.scope", "x".repeat(80), "f".repeat(64));
        e.offer(key.clone(), &r, Some("a-fifteen-chars".into()), long.into(), 1.0);
        let x = e.of(&key, Stage::D2c, "nvme10n1p12")[3].clone().unwrap();
        let chars: usize = x.labels.iter().map(|(n, v)| n.chars().count() + v.chars().count()).sum();
        assert!(chars <= MAX_LABEL_CHARS, "{chars}: {:?}", x.labels);
        let cgroup = &x.labels.iter().find(|l| l.0 == "cgroup").unwrap().1;
        assert!(cgroup.starts_with('…') && cgroup.ends_with("ffff.scope"), "{cgroup}");
    }
}
