//! The kernel's op numbering from its BTF enums (`req_op`, `req_flag_bits`), for `model::op`.

use anyhow::{Context, Result};

use crate::{
    kernel::btf::Btf,
    model::op::{OpDecoder, RwbsFlags},
};

/// The running kernel's `OpDecoder`; a kernel without the op enums is refused.
pub fn op_decoder(btf: &Btf) -> Result<OpDecoder> {
    let value = |name: &str| {
        btf.enumerator(name)
            .map(|v| v as u32)
            .with_context(|| format!("this kernel's BTF has no enumerator {name}"))
    };
    let flag = |name: &str| btf.enumerator(name).map(|bit| bit as u32);
    // The first flag bit follows the op bits: its number is REQ_OP_BITS.
    let op_bits = value("__REQ_FAILFAST_DEV")?;
    let ops =
        [value("REQ_OP_READ")?, value("REQ_OP_WRITE")?, value("REQ_OP_FLUSH")?, value("REQ_OP_DISCARD")?];
    let flags = RwbsFlags {
        sync: flag("__REQ_SYNC"),
        meta: flag("__REQ_META"),
        fua: flag("__REQ_FUA"),
        preflush: flag("__REQ_PREFLUSH"),
        rahead: flag("__REQ_RAHEAD"),
    };
    Ok(OpDecoder::new(op_bits, ops, flags))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{kernel::btf::tests::Builder, model::op::Op};

    #[test]
    fn numbers_come_from_the_kernels_enums() {
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
        let d = op_decoder(&Btf::parse(&b.build()).unwrap()).unwrap();
        assert_eq!(d.op(1 | 1 << 11), Op::Write);
        assert_eq!(d.rwbs(1 | 1 << 18 | 1 << 17 | 1 << 11), "FWFS");
        assert_eq!(d.rwbs(1 << 19), "RA");
    }

    #[test]
    fn a_kernel_without_op_enums_is_refused() {
        let b = Builder::new();
        let err = op_decoder(&Btf::parse(&b.build()).unwrap()).unwrap_err();
        assert!(err.to_string().contains("__REQ_FAILFAST_DEV"));
    }
}
