//! tracerd's own programs as a source: an aggregate reported and started afresh every
//! interval (`report --interval`, `top`), per cgroup where asked.

use std::{collections::BTreeMap, time::Instant};

use anyhow::Result;

use crate::{
    kernel::cgroupfs::CgroupNames,
    kernel::session::Io,
    kernel::session::Session,
    kernel::tracer::kernel_release,
    model::aggregate::{Aggregator, Lost},
    model::cgroups::{LabelForm, Named},
    model::op::Op,
    model::stage::Stage,
    model::topology::Topology,
    view::report::Report,
};

/// `--by cgroup`: an aggregate per cgroup label, beside the capture's own.
pub struct ByCgroup {
    pub form: Option<LabelForm>,
    pub names: Option<CgroupNames>,
    pub aggs: BTreeMap<String, Aggregator>,
}

impl ByCgroup {
    pub fn new(form: Option<LabelForm>) -> ByCgroup {
        ByCgroup { form, names: form.map(|_| CgroupNames::detect()), aggs: BTreeMap::new() }
    }

    pub fn add(&mut self, io: &Io, op: Op, topo: &Topology) {
        let (Some(form), Some(names)) = (self.form, &mut self.names) else { return };
        let label = match names.of(io.rec) {
            Named::Path(p) => form.label(&p),
            other => crate::view::io_line::cgroup_text(&other).to_owned(),
        };
        self.aggs.entry(label).or_default().add(io.target, op, io.rec, io.layers, |d| topo.name_of(d));
    }
}

/// An aggregate reported and started afresh every interval (`report --interval`, `top`).
pub struct Rolling {
    agg: Aggregator,
    /// Per-cgroup aggregates too, once asked for (`top`'s `c`).
    cgroups: ByCgroup,
    /// The lost-event counters when the interval began.
    base: Lost,
    started: Instant,
    kernel: String,
}

impl Rolling {
    pub fn new(session: &Session, by_qd: bool) -> Result<Rolling> {
        Ok(Rolling {
            agg: Aggregator::new(by_qd),
            cgroups: ByCgroup::new(None),
            base: session.lost()?,
            started: Instant::now(),
            kernel: kernel_release(),
        })
    }

    pub fn add(
        &mut self,
        io: &crate::kernel::session::Io,
        topo: &Topology,
        ops: &crate::model::op::OpDecoder,
    ) {
        self.agg.add(io.target, ops.op(io.rec.cmd_flags), io.rec, io.layers, |d| topo.name_of(d));
        self.cgroups.add(io, ops.op(io.rec.cmd_flags), topo);
    }

    /// Splits the following intervals per cgroup too (labelled by path), or stops.
    pub fn by_cgroup(&mut self, on: bool) {
        if on != self.cgroups.form.is_some() {
            self.cgroups = ByCgroup::new(on.then_some(LabelForm::Path));
        }
    }

    /// The interval so far as a report; the next one begins.
    pub fn roll(&mut self, session: &mut Session, hist: Option<Stage>) -> Result<Report> {
        let waits = session.take_waits();
        self.agg.add_waits(&waits, |d| session.topo.name_of(d));
        let now = session.lost()?;
        let lost = Lost { series_limit: self.agg.over_limit, ..now.since(&self.base) };
        let elapsed = self.started.elapsed().as_secs_f64();
        let report = Report::build_with(
            &self.agg,
            &session.topo,
            &lost,
            &session.tracer.hooks,
            &self.kernel,
            elapsed,
            hist,
        )
        .with_cgroups(&std::mem::take(&mut self.cgroups.aggs), &session.topo, hist);
        (self.agg, self.base, self.started) = (Aggregator::new(self.agg.by_qd), now, Instant::now());
        Ok(report)
    }
}
