//! Decoding ring-buffer bytes into records, checked: a short or unknown record is an error that
//! the reader counts, never a panic or a silently wrong IO.

use thiserror::Error;
use tracer_common::{AheadRecord, IoRecord, WaitRecord, kind, wait};

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

/// A wait record (config `causes`): told from an IO record by its length.
pub fn decode_wait(bytes: &[u8]) -> Result<WaitRecord, RecordError> {
    if bytes.len() != size_of::<WaitRecord>() {
        return Err(RecordError::Size(bytes.len()));
    }
    // SAFETY: length checked; WaitRecord is plain old data valid for any bit pattern.
    let rec: WaitRecord = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    match (rec.phase, rec.state) {
        (wait::Q2G | wait::SUBMIT, wait::BLOCKED | wait::PREEMPTED)
        | (wait::HANDOFF, wait::BLOCKED)
        | (wait::THREAD, wait::BLOCKED | wait::PREEMPTED | wait::WOKEN) => Ok(rec),
        _ => Err(RecordError::Kind(rec.phase)),
    }
}

/// A request's numbers among its disk's G's and D's (config `causes`): told by its length.
pub fn decode_ahead(bytes: &[u8]) -> Result<AheadRecord, RecordError> {
    if bytes.len() != size_of::<AheadRecord>() {
        return Err(RecordError::Size(bytes.len()));
    }
    // SAFETY: length checked; AheadRecord is plain old data valid for any bit pattern.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) })
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
}
