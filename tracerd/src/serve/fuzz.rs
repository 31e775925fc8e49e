//! Whatever the ring buffer hands over (a kernel bug, a version mismatch), decoding and
//! everything downstream of it (layer join, aggregation, the exposition) must not panic:
//! a property test over arbitrary bytes, run in `cargo test`.

use proptest::prelude::*;

use tracer_common::IoRecord;

use crate::{
    kernel::record::{comm, decode},
    model::aggregate::Aggregator,
    model::layers::Layers,
    model::op::Op,
    serve::metrics,
};

fn pipeline(bytes: &[u8]) {
    let Ok(rec) = decode(bytes) else { return };
    let _ = comm(&rec);
    let mut layers = Layers::default();
    layers.lower_done(rec.dev, &rec);
    let mut splits = [Default::default(); crate::model::layers::MAX_LOWERS];
    let n = layers.upper_done(&rec, &mut splits);
    let mut agg = Aggregator::new(true);
    let op = [Op::Read, Op::Write, Op::Flush, Op::Discard, Op::Other][rec.cmd_flags as usize % 5];
    agg.add(rec.dev, op, &rec, &splits[..n], |d| format!("dev{d}"));
    let state = metrics::State { agg, ..Default::default() };
    let text = metrics::render(&state);
    assert!(text.contains("tracerd_io_requests_total"));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn any_bytes_of_any_length(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        pipeline(&bytes);
    }

    #[test]
    fn any_record_of_a_known_kind(mut bytes in proptest::collection::vec(any::<u8>(), size_of::<IoRecord>()), k in 1u8..=4) {
        let at = std::mem::offset_of!(IoRecord, kind);
        bytes[at] = k;
        prop_assert!(decode(&bytes).is_ok());
        pipeline(&bytes);
    }
}
