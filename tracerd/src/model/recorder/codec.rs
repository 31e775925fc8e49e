//! A frame's bytes: its series, lost events and per-cgroup series, varint-encoded, and
//! decoded again by a reader that trusts nothing in them.

use std::{collections::HashMap, sync::Arc};

use crate::model::{
    aggregate::Lost,
    causes::{Cause, Phase, WaitSum, WaitTotals},
    op::Op,
    stage::Stage,
};

use super::frame::{Buckets, Decoded, LayerFrame, SeriesFrame};

/// The ops a frame can name, by their code in the encoding.
const OPS: [Op; 5] = [Op::Read, Op::Write, Op::Flush, Op::Discard, Op::Other];

fn op_code(op: Op) -> u8 {
    OPS.iter().position(|&o| o == op).unwrap_or(OPS.len() - 1) as u8
}

/// A frame's bytes: its series, the events lost in it, its per-cgroup series, and its waits
/// by cause where it has any (a section frames written before causes were counted lack, so
/// they still decode).
pub(super) fn encode(
    series: &HashMap<(u32, Op), SeriesFrame>,
    lost: &Lost,
    cgroups: &HashMap<(u32, Op, Arc<str>), SeriesFrame>,
    waits: &WaitTotals,
) -> Vec<u8> {
    let mut keys: Vec<(u32, Op)> = series.keys().copied().collect();
    keys.sort_unstable();
    let mut w = Vec::with_capacity(64 + 400 * keys.len());
    varint(&mut w, keys.len() as u64);
    for key in keys {
        encode_series(&mut w, key, &series[&key]);
    }
    let lost: Vec<(usize, u64)> =
        lost.reasons().iter().enumerate().filter(|(_, r)| r.1 != 0).map(|(i, r)| (i, r.1)).collect();
    varint(&mut w, lost.len() as u64);
    for (i, n) in lost {
        w.push(i as u8);
        varint(&mut w, n);
    }
    let mut keys: Vec<&(u32, Op, Arc<str>)> = cgroups.keys().collect();
    keys.sort_unstable();
    varint(&mut w, keys.len() as u64);
    for key in keys {
        varint(&mut w, key.2.len() as u64);
        w.extend_from_slice(key.2.as_bytes());
        encode_series(&mut w, (key.0, key.1), &cgroups[key]);
    }
    if !waits.is_empty() {
        varint(&mut w, waits.len() as u64);
        for (&(dev, op, phase, cause), sum) in waits {
            varint(&mut w, dev as u64);
            w.push(op_code(op));
            w.push(code_of(&Phase::ALL, phase));
            w.push(code_of(&Cause::ALL, cause));
            varint(&mut w, sum.waits);
            varint(&mut w, sum.ns);
        }
    }
    w
}

fn code_of<T: PartialEq>(all: &[T], v: T) -> u8 {
    all.iter().position(|x| *x == v).unwrap_or(0) as u8
}

/// What `encode` wrote, or the byte where the bytes stop making sense.
pub(super) fn decode(data: &[u8]) -> Result<Decoded, usize> {
    let mut r = Reader { data, at: 0 };
    let mut out = Decoded::default();
    let n = r.varint().ok_or(r.at)?;
    for _ in 0..n {
        out.series.push(decode_series(&mut r).ok_or(r.at)?);
    }
    let n = r.varint().ok_or(r.at)?;
    let mut counters = out.lost.counters_mut();
    for _ in 0..n {
        let i = r.byte().ok_or(r.at)? as usize;
        let v = r.varint().ok_or(r.at)?;
        **counters.get_mut(i).ok_or(r.at)? += v;
    }
    let n = r.varint().ok_or(r.at)?;
    for _ in 0..n {
        let len = r.varint().ok_or(r.at)? as usize;
        let label = r.bytes(len).and_then(|b| String::from_utf8(b.to_vec()).ok()).ok_or(r.at)?;
        let ((dev, op), series) = decode_series(&mut r).ok_or(r.at)?;
        out.cgroups.push(((dev, op, label), series));
    }
    if r.at != data.len() {
        // Written only with waits in it: an empty section is damage.
        let n = r.varint().filter(|&n| n > 0).ok_or(r.at)?;
        for _ in 0..n {
            let wait = decode_wait(&mut r).ok_or(r.at)?;
            if out.waits.insert(wait.0, wait.1).is_some() {
                return Err(r.at);
            }
        }
    }
    if r.at != data.len() {
        return Err(r.at);
    }
    Ok(out)
}

fn varint(w: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        w.push(v as u8 | 0x80);
        v >>= 7;
    }
    w.push(v as u8);
}

fn encode_buckets(w: &mut Vec<u8>, b: &Buckets) {
    varint(w, b.sum_ns);
    let nonzero = b.counts.iter().filter(|&&n| n != 0).count();
    w.push(nonzero as u8);
    for (i, &n) in b.counts.iter().enumerate().filter(|(_, n)| **n != 0) {
        w.push(i as u8);
        varint(w, n);
    }
}

fn encode_series(w: &mut Vec<u8>, (dev, op): (u32, Op), s: &SeriesFrame) {
    varint(w, dev as u64);
    w.push(op_code(op));
    for v in [s.requests, s.bytes, s.merged_bios, s.errors, s.unlinked, s.qd_sum, s.qd_count] {
        varint(w, v);
    }
    let qd: Vec<(usize, u64)> = s.qd.iter().copied().enumerate().filter(|(_, n)| *n != 0).collect();
    w.push(qd.len() as u8);
    for (k, n) in qd {
        w.push(k as u8);
        varint(w, n);
    }
    w.push(s.paths.len() as u8);
    for (&path, &n) in &s.paths {
        w.push(path);
        varint(w, n);
    }
    let own: Vec<(usize, u64)> = s.own.iter().copied().enumerate().filter(|(_, n)| *n != 0).collect();
    w.push(own.len() as u8);
    for (k, n) in own {
        w.push(k as u8);
        varint(w, n);
    }
    // One bit per stage.
    const { assert!(Stage::COUNT <= 16) };
    let present = s.stages.iter().enumerate().filter(|(_, b)| b.is_some()).fold(0u16, |m, (i, _)| m | 1 << i);
    w.extend_from_slice(&present.to_le_bytes());
    for b in s.stages.iter().flatten() {
        encode_buckets(w, b);
    }
    w.push(s.submit.is_some() as u8 | (s.personality.is_some() as u8) << 1);
    for b in s.submit.iter().chain(&s.personality) {
        encode_buckets(w, b);
    }
    w.push(s.qos.len() as u8);
    for (&policies, b) in &s.qos {
        w.push(policies);
        encode_buckets(w, b);
    }
    varint(w, s.layers.len() as u64);
    for (&lower, l) in &s.layers {
        varint(w, lower as u64);
        varint(w, l.ios);
        varint(w, l.lower_ios);
        for b in &l.phases {
            encode_buckets(w, b);
        }
    }
}

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn byte(&mut self) -> Option<u8> {
        let b = *self.data.get(self.at)?;
        self.at += 1;
        Some(b)
    }

    fn varint(&mut self) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    }

    fn bytes(&mut self, n: usize) -> Option<&[u8]> {
        let b = self.data.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(b)
    }

    fn buckets(&mut self) -> Option<Box<Buckets>> {
        let mut b = Buckets::new();
        b.sum_ns = self.varint()?;
        for _ in 0..self.byte()? {
            let i = self.byte()? as usize;
            *b.counts.get_mut(i)? = self.varint()?;
        }
        Some(b)
    }
}

type WaitKey = (u32, Op, Phase, Cause);

fn decode_wait(r: &mut Reader) -> Option<(WaitKey, WaitSum)> {
    let dev = u32::try_from(r.varint()?).ok()?;
    let op = *OPS.get(r.byte()? as usize)?;
    let phase = *Phase::ALL.get(r.byte()? as usize)?;
    let cause = *Cause::ALL.get(r.byte()? as usize)?;
    Some(((dev, op, phase, cause), WaitSum { waits: r.varint()?, ns: r.varint()? }))
}

fn decode_series(r: &mut Reader) -> Option<((u32, Op), SeriesFrame)> {
    let dev = u32::try_from(r.varint()?).ok()?;
    let op = *OPS.get(r.byte()? as usize)?;
    let mut s = SeriesFrame::default();
    for v in [
        &mut s.requests,
        &mut s.bytes,
        &mut s.merged_bios,
        &mut s.errors,
        &mut s.unlinked,
        &mut s.qd_sum,
        &mut s.qd_count,
    ] {
        *v = r.varint()?;
    }
    for _ in 0..r.byte()? {
        let k = r.byte()? as usize;
        *s.qd.get_mut(k)? = r.varint()?;
    }
    for _ in 0..r.byte()? {
        let path = r.byte()?;
        s.paths.insert(path, r.varint()?);
    }
    for _ in 0..r.byte()? {
        let k = r.byte()? as usize;
        *s.own.get_mut(k)? = r.varint()?;
    }
    let present = u16::from_le_bytes([r.byte()?, r.byte()?]);
    for (i, slot) in s.stages.iter_mut().enumerate() {
        if present & 1 << i != 0 {
            *slot = Some(r.buckets()?);
        }
    }
    let extra = r.byte()?;
    if extra & 1 != 0 {
        s.submit = Some(r.buckets()?);
    }
    if extra & 2 != 0 {
        s.personality = Some(r.buckets()?);
    }
    for _ in 0..r.byte()? {
        let policies = r.byte()?;
        s.qos.insert(policies, r.buckets()?);
    }
    for _ in 0..r.varint()? {
        let lower = u32::try_from(r.varint()?).ok()?;
        let (ios, lower_ios) = (r.varint()?, r.varint()?);
        let phases = [r.buckets()?, r.buckets()?, r.buckets()?];
        s.layers.insert(lower, LayerFrame { ios, lower_ios, phases });
    }
    Some(((dev, op), s))
}
