//! The families of stacked devices (md, dm): each IO's Q2C split against a lower device, the
//! time in the driver's submit function, and the lower devices' IOs that named no upper IO.

use tracer_common::own;

use super::{
    family::{family, histogram, labels, number},
    hist::stage_hist,
};
use crate::{
    model::aggregate::{Aggregator, OpStats},
    model::layers::Phase,
    model::op::Op,
    serve::exposition::{Family, Kind},
};

/// `tracerd_io_layer_seconds`.
pub(super) fn layer_seconds(
    out: &mut Vec<Family>,
    agg: &Aggregator,
    series: &[(&str, Op, &OpStats)],
    native: bool,
) {
    let mut f = family(
        "tracerd_io_layer_seconds",
        Kind::Histogram,
        "Stacked devices (md, dm): each IO's Q2C split against a lower device into phase=layer \
         (before the first lower IO), lower (in the lower device) and completion (after the last).",
    );
    for (device, op, stats) in series {
        for (lower, layer) in &stats.layers {
            for (phase, h) in Phase::ALL.iter().zip(&layer.phases) {
                let l = labels([
                    ("device", device),
                    ("lower", agg.name(*lower)),
                    ("op", op.as_str()),
                    ("phase", phase.as_str()),
                ]);
                histogram(&mut f, l, stage_hist(h, native));
            }
        }
    }
    out.push(f);
}

/// `tracerd_io_submit_seconds`.
pub(super) fn submit_seconds(out: &mut Vec<Family>, series: &[(&str, Op, &OpStats)], native: bool) {
    let mut f = family(
        "tracerd_io_submit_seconds",
        Kind::Histogram,
        "Stacked devices: time inside the driver's submit function (md_submit_bio, dm_submit_bio) \
         and the md personality's make_request.",
    );
    for (device, op, stats) in series {
        for (function, h) in [("submit_bio", &stats.submit), ("personality", &stats.personality)] {
            if let Some(h) = h {
                let l = labels([("device", device), ("op", op.as_str()), ("function", function)]);
                histogram(&mut f, l, stage_hist(h, native));
            }
        }
    }
    out.push(f);
}

/// `tracerd_io_unlinked_total`.
pub(super) fn unlinked(out: &mut Vec<Family>, series: &[(&str, Op, &OpStats)]) {
    let mut f = family(
        "tracerd_io_unlinked_total",
        Kind::Counter,
        "IOs of a device below a traced stacked device that named no upper IO, by kind: the \
         stacked driver's own IO where the kernel says what it is (parity, preread, resync, \
         superblock, dm_io, dm_bufio), else unstated (a link the kernel does not state).",
    );
    for (device, op, stats) in series.iter().filter(|(_, _, s)| s.unlinked != 0) {
        for (k, &n) in stats.own.iter().enumerate().filter(|(_, n)| **n != 0) {
            let l = labels([("device", device), ("op", op.as_str()), ("kind", own::name(k as u8))]);
            number(&mut f, l, n as f64);
        }
    }
    out.push(f);
}

#[cfg(test)]
mod tests {
    use crate::model::aggregate::Aggregator;
    use crate::model::op::Op;
    use crate::serve::metrics::{State, render};
    use tracer_common::{IoRecord, event, kind};

    #[test]
    fn layer_and_submit_histograms() {
        let mut agg = Aggregator::new(false);
        let mut r = IoRecord { kind: kind::BIO, submit_ns: 4000, ..Default::default() };
        (r.ts[event::Q], r.ts[event::C]) = (1000, 11_000);
        let split = crate::model::layers::LayerSplit {
            lower: 2,
            ios: 1,
            layer_ns: 1000,
            lower_ns: 8000,
            completion_ns: 1000,
        };
        agg.add(1, Op::Read, &r, &[split], |d| if d == 1 { "dm-0".into() } else { "ram2".into() });
        let text = render(&State { agg, ..Default::default() });
        for phase in ["layer", "lower", "completion"] {
            let line = format!(
                "tracerd_io_layer_seconds_count{{device=\"dm-0\",lower=\"ram2\",op=\"read\",phase=\"{phase}\"}} 1\n"
            );
            assert!(text.contains(&line), "{line} missing in\n{text}");
        }
        assert!(text.contains("tracerd_io_layer_seconds_sum{device=\"dm-0\",lower=\"ram2\",op=\"read\",phase=\"lower\"} 0.000008\n"));
        assert!(text.contains(
            "tracerd_io_submit_seconds_count{device=\"dm-0\",op=\"read\",function=\"submit_bio\"} 1\n"
        ));
        assert!(
            text.contains("tracerd_io_stage_seconds_count{device=\"dm-0\",op=\"read\",stage=\"q2c\"} 1\n")
        );
    }
}
