//! The flight recorder's families, and those of its store on disk: memory and disk against
//! their bounds, the span kept, and what was dropped or could not be written.

use super::{
    RecorderGauges,
    family::{family, labels, number, single},
};
use crate::serve::exposition::{Family, Kind};

/// The recorder's families; none where there is no recorder (a bound of zero).
pub(super) fn families(out: &mut Vec<Family>, r: &RecorderGauges) {
    if r.max_bytes == 0 {
        return;
    }
    let mut f = family(
        "tracerd_recorder_bytes",
        Kind::Gauge,
        "Memory of the flight recorder's frames (state=used), and its bound (state=limit, config \
         recorder.max_bytes).",
    );
    number(&mut f, labels([("state", "used")]), r.bytes as f64);
    number(&mut f, labels([("state", "limit")]), r.max_bytes as f64);
    out.push(f);
    single(out, "tracerd_recorder_frames", Kind::Gauge, "Frames the flight recorder keeps.", r.frames as f64);
    single(
        out,
        "tracerd_recorder_span_seconds",
        Kind::Gauge,
        "How far back the flight recorder reaches now (at most recorder.retention_s).",
        r.span_s,
    );
    single(
        out,
        "tracerd_recorder_frames_dropped_total",
        Kind::Counter,
        "Frames dropped before the end of the retention because the recorder reached its byte bound.",
        r.dropped_for_memory as f64,
    );
    if let Some(st) = &r.store {
        let mut f = family(
            "tracerd_recorder_store_bytes",
            Kind::Gauge,
            "Disk taken by the recorder's store (state=used), and its bound (state=limit, config \
             store.max_bytes).",
        );
        number(&mut f, labels([("state", "used")]), st.bytes as f64);
        number(&mut f, labels([("state", "limit")]), st.max_bytes as f64);
        out.push(f);
        for (name, help, v) in [
            (
                "tracerd_recorder_store_frames_not_stored_total",
                "Frames kept in memory but not written to the store, because a write failed (a full disk).",
                st.frames_not_stored,
            ),
            (
                "tracerd_recorder_store_slow_lists_not_stored_total",
                "Lists of a device's slowest IOs of a minute kept in memory but not written to the store, because a write failed.",
                st.slow_lists_not_stored,
            ),
            (
                "tracerd_recorder_store_write_errors_total",
                "Writes and syncs to the recorder's store that failed.",
                st.write_errors,
            ),
            (
                "tracerd_recorder_store_damaged_records_total",
                "Records of the store that did not check (CRC, length) and were skipped.",
                st.damaged_records,
            ),
            (
                "tracerd_recorder_store_torn_tails_total",
                "Unfinished records (an agent stopped mid-write) cut off when the store was opened.",
                st.torn_tails,
            ),
        ] {
            single(out, name, Kind::Counter, help, v as f64);
        }
    }
}
