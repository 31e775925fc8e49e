//! The wait families (config `causes`): sleeps of a submitter inside its IO's phases, by
//! device, op, phase and cause.

use super::{
    State,
    family::{family, labels, number},
};
use crate::{model::causes::WaitTotals, serve::exposition::Family, serve::exposition::Kind};

pub(super) fn families(out: &mut Vec<Family>, state: &State, totals: &WaitTotals) {
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
    let mut rows: Vec<(&str, _, _, _, &(u64, u64))> = totals
        .iter()
        .map(|((dev, op, phase, cause), t)| (state.agg.name(*dev), op, phase, cause, t))
        .collect();
    rows.sort_by(|a, b| (a.0, a.1, a.2, a.3).cmp(&(b.0, b.1, b.2, b.3)));
    for (device, op, phase, cause, (n, ns)) in rows {
        let l = labels([
            ("device", device),
            ("op", op.as_str()),
            ("phase", phase.name()),
            ("cause", cause.name()),
        ]);
        number(&mut seconds, l.clone(), *ns as f64 / 1e9);
        number(&mut waits, l, *n as f64);
    }
    out.push(seconds);
    out.push(waits);
}
