//! The families about the cgroup label itself: what was folded into `other`, how many labels
//! have series, which series ended, and the names held.

use super::family::{family, labels, number};
use crate::{
    model::cgroups::CgroupSeries,
    serve::exposition::{Family, Kind},
};

/// The cgroup label's families, served only with the label on.
pub(super) fn families(out: &mut Vec<Family>, c: &CgroupSeries) {
    let mut f = family(
        "tracerd_cgroup_folded_requests_total",
        Kind::Counter,
        "IOs counted under the cgroup label other, by reason: top (past config cgroups.top), \
         excluded (cgroups.include/exclude), unnamed (the cgroup went before it was named).",
    );
    for (reason, n) in c.folded.reasons() {
        number(&mut f, labels([("reason", reason)]), n as f64);
    }
    out.push(f);
    let mut f = family(
        "tracerd_cgroup_labels",
        Kind::Gauge,
        "Cgroup labels with series of their own (state=used), and the bound (state=limit, config \
         cgroups.top).",
    );
    number(&mut f, labels([("state", "used")]), c.labels() as f64);
    number(&mut f, labels([("state", "limit")]), c.limits.top as f64);
    out.push(f);
    let mut f = family(
        "tracerd_cgroup_series_ended_total",
        Kind::Counter,
        "Cgroup labels whose series ended: expired (no IO for cgroups.expire_after_s) or displaced \
         (a busier cgroup took the place).",
    );
    number(&mut f, labels([("reason", "expired")]), c.expired as f64);
    number(&mut f, labels([("reason", "displaced")]), c.displaced as f64);
    out.push(f);
    let mut f = family(
        "tracerd_cgroup_names",
        Kind::Gauge,
        "Cgroup ids tracerd holds a name for (forgotten after cgroups.expire_after_s unused).",
    );
    number(&mut f, vec![], c.names_cached as f64);
    out.push(f);
}
