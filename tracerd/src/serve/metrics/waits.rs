//! The wait families (config `causes`): sleeps of a submitter inside its IO's phases, by
//! device, op, phase and cause.

use super::family::{family, labels, number};
use crate::{model::aggregate::OpStats, model::op::Op, serve::exposition::Family, serve::exposition::Kind};

/// `series` sorted by device and op (`Aggregator::sorted`).
pub(super) fn families(out: &mut Vec<Family>, series: &[(&str, Op, &OpStats)]) {
    let mut seconds = family(
        "tracerd_io_wait_seconds_total",
        Kind::Counter,
        "Time submitters slept (or waited for a CPU) inside their IOs' phases, by the cause their kernel stack names.",
    );
    let mut waits = family(
        "tracerd_io_waits_total",
        Kind::Counter,
        "Sleeps of submitters inside their IOs' phases, by the cause their kernel stack names.",
    );
    for (device, op, s) in series {
        for ((phase, cause), sum) in &s.waits {
            let l = labels([
                ("device", device),
                ("op", op.as_str()),
                ("phase", phase.name()),
                ("cause", cause.name()),
            ]);
            number(&mut seconds, l.clone(), sum.ns as f64 / 1e9);
            number(&mut waits, l, sum.waits as f64);
        }
    }
    out.push(seconds);
    out.push(waits);
}
