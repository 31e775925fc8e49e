//! Building a report from an aggregate: per device and op, its stages, layers and cgroups.

use std::collections::BTreeMap;

use crate::{
    kernel::hooks::HookStatus,
    model::aggregate::{Aggregator, Lost, OpStats},
    model::capture,
    model::layers::Phase,
    model::op::Op,
    model::stage::{self, Stage},
    model::topology::Topology,
    view::histogram,
};

use super::*;

impl OpReport {
    fn build(
        op: Op,
        s: &OpStats,
        duration_s: f64,
        hist: Option<Stage>,
        name: impl Fn(u32) -> String,
    ) -> OpReport {
        let (waits, unexplained_s) = waits(s);
        let mut stages = summaries(&s.stages);
        if let Some((summary, h)) = hist.and_then(|st| Some((stages.get_mut(&st)?, s.stage(st)?))) {
            summary.log2_buckets = Some(histogram::buckets(&h.hist));
        }
        OpReport {
            op,
            requests: s.requests,
            bytes: s.bytes,
            merged_bios: s.merged_bios,
            errors: s.errors,
            unlinked: s.unlinked,
            unlinked_kinds: capture::own_kinds(&s.own),
            iops: s.requests as f64 / duration_s,
            bytes_per_second: s.bytes as f64 / duration_s,
            queue_depth_mean: (s.queue_depth.count > 0)
                .then(|| s.queue_depth.sum as f64 / s.queue_depth.count as f64),
            paths: s
                .paths
                .iter()
                .enumerate()
                .filter(|(_, n)| **n > 0)
                .map(|(m, n)| (stage::path_of_mask(m), *n))
                .collect(),
            stages,
            by_queue_depth: s
                .by_qd
                .iter()
                .map(|(&queue_depth, st)| QueueDepthReport { queue_depth, stages: summaries(st) })
                .collect(),
            layers: s
                .layers
                .iter()
                .map(|(&lower, l)| LayerReport {
                    lower: name(lower),
                    ios: l.ios,
                    lower_ios: l.lower_ios,
                    phases: Phase::ALL
                        .iter()
                        .zip(&l.phases)
                        .map(|(p, h)| (*p, StageSummary::of(h)))
                        .collect(),
                })
                .collect(),
            submit_path: [("submit_bio", &s.submit), ("personality", &s.personality)]
                .into_iter()
                .filter_map(|(k, h)| Some((k, StageSummary::of(h.as_deref()?))))
                .collect(),
            qos_wait: s.qos.iter().map(|(&p, h)| (stage::qos_name(p), StageSummary::of(h))).collect(),
            waits,
            unexplained_s,
        }
    }
}

/// The series' waits, most time first, each with its share of the IOs' Q2C time, and the Q2C
/// time they leave unexplained.
fn waits(s: &OpStats) -> (Vec<WaitReport>, Option<f64>) {
    if s.waits.is_empty() {
        return (Vec::new(), None);
    }
    let q2c_ns = s.stage(Stage::Q2c).map_or(0, |h| h.sum_ns);
    let mut out: Vec<WaitReport> = s
        .waits
        .iter()
        .map(|(&(phase, cause), sum)| WaitReport {
            phase,
            cause,
            waits: sum.waits,
            wait_s: sum.ns as f64 / 1e9,
            share_of_q2c: if q2c_ns == 0 { 0.0 } else { sum.ns as f64 / q2c_ns as f64 },
        })
        .collect();
    out.sort_by(|a, b| b.wait_s.total_cmp(&a.wait_s).then((a.phase, a.cause).cmp(&(b.phase, b.cause))));
    let waited: u64 = s.waits.values().map(|w| w.ns).sum();
    (out, Some(q2c_ns.saturating_sub(waited) as f64 / 1e9))
}

impl Report {
    pub fn build(
        agg: &Aggregator,
        topo: &Topology,
        lost: &Lost,
        hooks: &[HookStatus],
        kernel: &str,
        duration_s: f64,
    ) -> Report {
        Report::build_with(agg, topo, lost, hooks, kernel, duration_s, None)
    }

    /// `build`, with the log2 histogram of stage `hist` in every op that has it.
    pub fn build_with(
        agg: &Aggregator,
        topo: &Topology,
        lost: &Lost,
        hooks: &[HookStatus],
        kernel: &str,
        duration_s: f64,
        hist: Option<Stage>,
    ) -> Report {
        let duration_s = duration_s.max(1e-9);
        let mut devices: Vec<DeviceReport> = Vec::new();
        for (device, op, stats) in agg.sorted() {
            let op_report = OpReport::build(op, stats, duration_s, hist, |d| agg.name(d).to_owned());
            match devices.last_mut() {
                Some(d) if d.device == device => d.ops.push(op_report),
                _ => {
                    let known = topo.by_name(device);
                    devices.push(DeviceReport {
                        device: device.to_owned(),
                        label: known.map_or_else(|| device.to_owned(), |d| d.label()),
                        lowers: known.map(|d| d.lowers.clone()).unwrap_or_default(),
                        uppers: known.map(|d| d.uppers.clone()).unwrap_or_default(),
                        ops: vec![op_report],
                        ahead: Vec::new(),
                    })
                }
            }
        }
        Report {
            schema_version: SCHEMA_VERSION,
            kernel: kernel.to_owned(),
            duration_s,
            devices,
            lost: lost.reasons().into_iter().collect(),
            hooks: hooks.to_vec(),
            hist,
            from_agent: None,
            slowest: vec![],
            by_cgroup: vec![],
        }
    }

    /// Adds who went ahead of each disk's waiting IOs, by group (config `causes`).
    pub fn with_ahead(mut self, ahead: &crate::model::ahead::Ahead, topo: &Topology) -> Report {
        for (disk, rows) in ahead.rows() {
            let name = topo.name_of(disk);
            match self.devices.iter_mut().find(|d| d.device == name) {
                Some(d) => d.ahead = rows,
                None => tracing::debug!("who went ahead: {name} has no table of its own"),
            }
        }
        self
    }

    /// Adds the tables of each cgroup's aggregate (`--by cgroup`).
    pub fn with_cgroups(
        mut self,
        cgroups: &BTreeMap<String, Aggregator>,
        topo: &Topology,
        hist: Option<Stage>,
    ) -> Report {
        let none = Lost::default();
        self.by_cgroup = cgroups
            .iter()
            .map(|(cgroup, agg)| CgroupReport {
                cgroup: cgroup.clone(),
                devices: Report::build_with(agg, topo, &none, &[], "", self.duration_s, hist).devices,
            })
            .collect();
        self
    }
}
