//! Decoding ring-buffer bytes into records, checked: a short or unknown record is an error that
//! the reader counts, never a panic or a silently wrong IO.

use thiserror::Error;
use tracer_common::{IoRecord, kind};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("record of {0} bytes, expected {expected}", expected = size_of::<IoRecord>())]
    Size(usize),
    #[error("unknown record kind {0}")]
    Kind(u8),
}

pub fn decode(bytes: &[u8]) -> Result<IoRecord, RecordError> {
    if bytes.len() != size_of::<IoRecord>() {
        return Err(RecordError::Size(bytes.len()));
    }
    // SAFETY: length checked; IoRecord is plain old data valid for any bit pattern.
    let rec: IoRecord = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    match rec.kind {
        kind::REQUEST | kind::MERGE | kind::BIO | kind::LINK => Ok(rec),
        k => Err(RecordError::Kind(k)),
    }
}

/// `comm` as text (up to the first NUL).
pub fn comm(rec: &IoRecord) -> &str {
    let end = rec.comm.iter().position(|&b| b == 0).unwrap_or(rec.comm.len());
    std::str::from_utf8(&rec.comm[..end]).unwrap_or("?")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_of(rec: &IoRecord) -> Vec<u8> {
        // SAFETY: viewing a POD struct as bytes.
        unsafe { std::slice::from_raw_parts((rec as *const IoRecord).cast::<u8>(), size_of::<IoRecord>()) }
            .to_vec()
    }

    #[test]
    fn round_trip() {
        let mut rec = IoRecord { kind: kind::REQUEST, bytes: 4096, sector: 8, ..Default::default() };
        rec.comm[..4].copy_from_slice(b"fio\0");
        let back = decode(&bytes_of(&rec)).unwrap();
        assert_eq!(back, rec);
        assert_eq!(comm(&back), "fio");
    }

    #[test]
    fn short_and_unknown_records_are_errors() {
        let rec = IoRecord { kind: kind::MERGE, ..Default::default() };
        let b = bytes_of(&rec);
        assert_eq!(decode(&b[..10]), Err(RecordError::Size(10)));
        assert_eq!(decode(&[]), Err(RecordError::Size(0)));
        let bad = IoRecord { kind: 9, ..Default::default() };
        assert_eq!(decode(&bytes_of(&bad)), Err(RecordError::Kind(9)));
    }

    /// Whatever the ring buffer hands over (a kernel bug, a version mismatch), decoding and
    /// everything downstream of it (layer join, aggregation, the exposition) must not panic:
    /// a property test over arbitrary bytes, run in `cargo test`.
    mod fuzz {
        use proptest::prelude::*;

        use super::*;
        use crate::{model::aggregate::Aggregator, model::layers::Layers, model::op::Op, serve::metrics};

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
    }
}
