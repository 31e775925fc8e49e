//! The one place that maps a request's `cmd_flags` to an operation and to blktrace's RWBS text.
//! Op numbers and flag bits are the running kernel's (`kernel::ops` reads them from BTF).

use serde::{Deserialize, Serialize};

/// Operation label used everywhere (metrics, report, snoop).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Read,
    Write,
    Flush,
    Discard,
    Other,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Discard => "discard",
            Op::Other => "other",
        }
    }
}

/// The bit numbers of the flags RWBS shows; `None` where the kernel lacks one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RwbsFlags {
    pub sync: Option<u32>,
    pub meta: Option<u32>,
    pub fua: Option<u32>,
    pub preflush: Option<u32>,
    pub rahead: Option<u32>,
}

/// Decodes `cmd_flags`/`bi_opf` with the running kernel's numbering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpDecoder {
    op_mask: u32,
    read: u32,
    write: u32,
    flush: u32,
    discard: u32,
    /// Flag bits (as masks) shown in RWBS; 0 where the kernel lacks the flag.
    sync: u32,
    meta: u32,
    fua: u32,
    preflush: u32,
    rahead: u32,
}

impl OpDecoder {
    /// From the kernel's numbering: `op_bits` (REQ_OP_BITS) op bits, the four op numbers, and
    /// each RWBS flag's bit number (`None` where the kernel lacks the flag).
    pub fn new(op_bits: u32, [read, write, flush, discard]: [u32; 4], flags: RwbsFlags) -> OpDecoder {
        let mask = |bit: Option<u32>| bit.map_or(0, |bit| 1u32 << bit);
        OpDecoder {
            op_mask: (1 << op_bits) - 1,
            read,
            write,
            flush,
            discard,
            sync: mask(flags.sync),
            meta: mask(flags.meta),
            fua: mask(flags.fua),
            preflush: mask(flags.preflush),
            rahead: mask(flags.rahead),
        }
    }

    /// (op mask, REQ_OP_READ, REQ_OP_WRITE): what the kernel side needs to tell ops apart.
    pub fn kernel_numbers(&self) -> (u32, u32, u32) {
        (self.op_mask, self.read, self.write)
    }

    pub fn op(&self, cmd_flags: u32) -> Op {
        match cmd_flags & self.op_mask {
            v if v == self.read => Op::Read,
            v if v == self.write => Op::Write,
            v if v == self.flush => Op::Flush,
            v if v == self.discard => Op::Discard,
            _ => Op::Other,
        }
    }

    /// blktrace's RWBS string: F (preflush), then R/W/D/N, then F (fua), A (read-ahead),
    /// S (sync), M (meta).
    pub fn rwbs(&self, cmd_flags: u32) -> String {
        let mut s = String::with_capacity(6);
        let has = |mask: u32| mask != 0 && cmd_flags & mask != 0;
        if has(self.preflush) {
            s.push('F');
        }
        s.push(match self.op(cmd_flags) {
            Op::Read => 'R',
            Op::Write => 'W',
            Op::Discard => 'D',
            Op::Flush if s.is_empty() => 'F',
            Op::Flush | Op::Other => 'N',
        });
        for (mask, c) in [(self.fua, 'F'), (self.rahead, 'A'), (self.sync, 'S'), (self.meta, 'M')] {
            if has(mask) {
                s.push(c);
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Numbering of 6.x kernels (REQ_OP_BITS = 8).
    fn decoder() -> OpDecoder {
        let flags =
            RwbsFlags { sync: Some(11), meta: Some(12), fua: Some(17), preflush: Some(18), rahead: Some(19) };
        OpDecoder::new(8, [0, 1, 2, 3], flags)
    }

    #[test]
    fn ops_and_rwbs() {
        let d = decoder();
        assert_eq!(d.op(0), Op::Read);
        assert_eq!(d.op(1 | 1 << 11), Op::Write);
        assert_eq!(d.op(2), Op::Flush);
        assert_eq!(d.op(3), Op::Discard);
        assert_eq!(d.op(34), Op::Other);
        assert_eq!(d.rwbs(1 | 1 << 11), "WS");
        assert_eq!(d.rwbs(1 << 19), "RA");
        assert_eq!(d.rwbs(2 | 1 << 18), "FN");
        assert_eq!(d.rwbs(2), "F");
        assert_eq!(d.rwbs(1 | 1 << 18 | 1 << 17 | 1 << 11), "FWFS");
    }
}
