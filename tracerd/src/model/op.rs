//! The one place that maps a request's `cmd_flags` to an operation and to blktrace's RWBS text.
//! Op numbers and flag bits are read from the running kernel's BTF enums.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::kernel::btf::Btf;

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
    pub fn from_btf(btf: &Btf) -> Result<OpDecoder> {
        let value = |name: &str| {
            btf.enumerator(name)
                .map(|v| v as u32)
                .with_context(|| format!("this kernel's BTF has no enumerator {name}"))
        };
        let flag = |name: &str| btf.enumerator(name).map_or(0, |bit| 1u32 << bit);
        // The first flag bit follows the op bits: its number is REQ_OP_BITS.
        let op_bits = value("__REQ_FAILFAST_DEV")?;
        Ok(OpDecoder {
            op_mask: (1 << op_bits) - 1,
            read: value("REQ_OP_READ")?,
            write: value("REQ_OP_WRITE")?,
            flush: value("REQ_OP_FLUSH")?,
            discard: value("REQ_OP_DISCARD")?,
            sync: flag("__REQ_SYNC"),
            meta: flag("__REQ_META"),
            fua: flag("__REQ_FUA"),
            preflush: flag("__REQ_PREFLUSH"),
            rahead: flag("__REQ_RAHEAD"),
        })
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
    use crate::kernel::btf::tests::Builder;

    /// Numbering of 6.x kernels (REQ_OP_BITS = 8).
    pub fn decoder() -> OpDecoder {
        let mut b = Builder::new();
        b.enumeration(
            "req_op",
            &[("REQ_OP_READ", 0), ("REQ_OP_WRITE", 1), ("REQ_OP_FLUSH", 2), ("REQ_OP_DISCARD", 3)],
        );
        b.enumeration(
            "req_flag_bits",
            &[
                ("__REQ_FAILFAST_DEV", 8),
                ("__REQ_SYNC", 11),
                ("__REQ_META", 12),
                ("__REQ_FUA", 17),
                ("__REQ_RAHEAD", 19),
                ("__REQ_PREFLUSH", 18),
            ],
        );
        OpDecoder::from_btf(&Btf::parse(&b.build()).unwrap()).unwrap()
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

    #[test]
    fn a_kernel_without_op_enums_is_refused() {
        let b = Builder::new();
        let err = OpDecoder::from_btf(&Btf::parse(&b.build()).unwrap()).unwrap_err();
        assert!(err.to_string().contains("__REQ_FAILFAST_DEV"));
    }
}
