//! The store's bytes: segment headers, record framing, the record kinds, and the times the
//! store keeps at the head of a frame's and a slowest-IO list's payload.
//!
//! A segment file is a 16-byte header (magic `TRACERD\0`, format version as u32 LE, 4
//! reserved bytes) and then records: `len: u32 LE | crc32: u32 LE | kind: u8 | payload`, where
//! `len` counts kind and payload and the CRC-32 (IEEE) covers them. Kinds: a frame (start ms,
//! end ms, both u64 LE, then the frame's encoded bytes), the names the following frames use
//! (devices, JSON), an agent's start (JSON), which marks a gap in the history, and (from
//! format 2) a device's slowest IOs of one minute (the minute's start in Unix seconds, u64 LE,
//! then JSON).

/// The format this tracerd writes.
pub const FORMAT_VERSION: u32 = 2;
/// The formats it reads: 1 is 2 without the slowest IOs.
pub(super) const OLDEST_READABLE: u32 = 1;
const MAGIC: &[u8; 8] = b"TRACERD\0";
pub(super) const HEADER_LEN: u64 = 16;
/// len + crc + kind.
pub(super) const RECORD_HEAD: usize = 9;
/// No record is larger: a length beyond it is damage, not data.
const MAX_RECORD: u32 = 64 << 20;
pub(super) const KIND_FRAME: u8 = 1;
pub(super) const KIND_NAMES: u8 = 2;
pub(super) const KIND_START: u8 = 3;
/// From format 2.
pub(super) const KIND_SLOW: u8 = 4;
/// A frame's payload starts with its span: start and end ms.
pub(super) const FRAME_TIMES: usize = 16;
/// A slowest-IO list's payload starts with its minute.
pub(super) const SLOW_TIMES: usize = 8;

/// A new segment's header, in this tracerd's format.
pub(super) fn header() -> Vec<u8> {
    let mut header = Vec::with_capacity(HEADER_LEN as usize);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    header.extend_from_slice(&[0; 4]);
    header
}

/// The format a segment's bytes say they are in; None when the header is not ours.
pub(super) fn version_of(segment: &[u8]) -> Option<u32> {
    if segment.len() < HEADER_LEN as usize || &segment[..8] != MAGIC {
        return None;
    }
    Some(u32::from_le_bytes(segment[8..12].try_into().unwrap()))
}

/// `frames-<ms>.tdr` → ms.
pub(super) fn segment_ms(name: &str) -> Option<u64> {
    name.strip_prefix("frames-")?.strip_suffix(".tdr")?.parse().ok()
}

/// The file name of a segment whose first frame starts at `ms`.
pub(super) fn segment_name(ms: u64) -> String {
    format!("frames-{ms:013}.tdr")
}

fn checksum(kind: u8, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&[kind]);
    h.update(payload);
    h.finalize()
}

/// One record, framed: what one write(2) appends.
pub(super) fn record(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut record = Vec::with_capacity(RECORD_HEAD + payload.len());
    record.extend_from_slice(&(payload.len() as u32 + 1).to_le_bytes());
    record.extend_from_slice(&checksum(kind, payload).to_le_bytes());
    record.push(kind);
    record.extend_from_slice(payload);
    record
}

/// The record at `at` if it is whole and checks: (kind, payload).
pub(super) fn record_at(bytes: &[u8], at: usize) -> Option<(u8, &[u8])> {
    let head = bytes.get(at..at + RECORD_HEAD)?;
    let len = u32::from_le_bytes(head[..4].try_into().unwrap());
    if len == 0 || len > MAX_RECORD {
        return None;
    }
    let crc = u32::from_le_bytes(head[4..8].try_into().unwrap());
    let payload = bytes.get(at + RECORD_HEAD..at + 8 + len as usize)?;
    let kind = head[8];
    (checksum(kind, payload) == crc).then_some((kind, payload))
}

/// A frame's payload: its span, then its bytes.
pub(super) fn frame_payload(start_ms: u64, end_ms: u64, data: &[u8]) -> Vec<u8> {
    let mut payload = Vec::with_capacity(FRAME_TIMES + data.len());
    payload.extend_from_slice(&start_ms.to_le_bytes());
    payload.extend_from_slice(&end_ms.to_le_bytes());
    payload.extend_from_slice(data);
    payload
}

/// A frame payload's span, `[start_ms, end_ms)`.
pub(super) fn frame_span(payload: &[u8]) -> Option<(u64, u64)> {
    let times = payload.get(..FRAME_TIMES)?;
    Some((
        u64::from_le_bytes(times[..8].try_into().unwrap()),
        u64::from_le_bytes(times[8..].try_into().unwrap()),
    ))
}

/// A slowest-IO list's payload: its minute, then its bytes.
pub(super) fn slow_payload(minute_unix_s: u64, list: &[u8]) -> Vec<u8> {
    let mut payload = minute_unix_s.to_le_bytes().to_vec();
    payload.extend_from_slice(list);
    payload
}

/// A slowest-IO list payload's minute (its start, Unix seconds).
pub(super) fn slow_minute(payload: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(payload.get(..SLOW_TIMES)?.try_into().unwrap()))
}
