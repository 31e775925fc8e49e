//! Filling ring-buffer records: a bio's from its slot (the bio path's own completions and
//! stacked devices' completions of a head bio), and a request's size, position and op.

use tracer_common::{BioState, IoRecord, KernelLayout, event, kind};

use crate::{
    kernel::Mem,
    slots::{copy_comm, zero_words},
};

/// A request's size, position and op as they are now: as issued at D, or as it merged.
pub(crate) fn fill_issue<M: Mem>(l: &KernelLayout, rq: u64, rec: &mut IoRecord) {
    rec.cmd_flags = M::read(rq, l.rq_cmd_flags);
    rec.bytes = M::read(rq, l.rq_data_len);
    rec.sector = M::read(rq, l.rq_sector);
}

/// The record of bio `id` completed at `completed`, from its slot `b` (error left 0).
#[inline(always)]
pub(crate) fn fill_bio_record(rec: *mut IoRecord, b: &BioState, id: u64, completed: u64) {
    // SAFETY: `rec` is a reserved ring-buffer entry, ours to fill.
    unsafe { zero_words(rec) };
    // SAFETY: as above.
    let rec = unsafe { &mut *rec };
    rec.kind = kind::BIO;
    rec.flags = b.flags;
    rec.dev = b.dev;
    rec.cmd_flags = b.opf;
    rec.bytes = b.bytes;
    rec.sector = b.sector;
    rec.pid = b.pid;
    rec.cgroup = b.cgroup;
    copy_comm(&mut rec.comm, &b.comm);
    rec.id = id;
    rec.parent = b.parent;
    rec.submit_ns = b.submit_ns;
    rec.personality_ns = b.personality_ns;
    rec.ts[event::H] = b.held_ns;
    rec.ts[event::Q] = b.queued_ns;
    rec.ts[event::C] = completed;
    // No qos: rq-qos waits are taken at G, and a bio that got a request goes in its record.
}
