//! A bio's ring-buffer record, filled from its slot: shared by the bio path's own completions
//! and by stacked devices' completions of a head bio.

use tracer_common::{BioState, IoRecord, event, kind};

use crate::slots::{copy_comm, zero_words};

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
