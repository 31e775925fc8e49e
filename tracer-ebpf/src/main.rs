//! tracerd's kernel side: one small function per block-layer hook.
//!
//! Bios are tracked from Q until their request is first seen (I or D) or they merge; requests
//! from then until they are fully complete, when one record goes to the ring buffer. Every
//! failure path bumps a `LOST` counter. Struct offsets come from `LAYOUT`, which the daemon
//! fills from the running kernel's BTF before load. Each hook is compiled once per argument
//! position it has had across kernels (`*_a0`, `*_a1`, ...) and per attach type (tp_btf,
//! raw_tp); the loader attaches the one variant that matches the running kernel.
#![no_std]
#![no_main]
// The bpf target has no atomic types; the intrinsics lower to BPF atomic add (cpu v3).
#![allow(internal_features)]
#![feature(core_intrinsics)]

mod aggregate;
mod ahead;
mod bio;
mod kernel;
mod maps;
mod qos;
mod record;
mod request;
mod sched;
mod slots;
mod stacking;

use aya_ebpf::{
    EbpfContext,
    macros::{btf_tracepoint, kprobe, kretprobe, raw_tracepoint},
    programs::{BtfTracePointContext, ProbeContext, RawTracePointContext, RetProbeContext},
};

use crate::{
    bio::{on_bio_complete, on_bio_merge, on_bio_queue, on_getrq, on_split, on_throttle},
    kernel::{Direct, Probe, arg},
    qos::{on_qos_enter, on_qos_exit, rq_qos_policy},
    request::{on_rq_complete, on_rq_insert, on_rq_issue, on_rq_merge, on_rq_requeue},
    sched::{on_level_enter, on_level_exit, on_sched_switch, on_sched_wakeup, on_sched_waking},
    stacking::{
        on_bio_remap, on_personality_enter, on_personality_exit, on_queue_rq_enter, on_queue_rq_exit,
        on_rq_remap, on_submit_enter, on_submit_exit,
    },
};

/// Defines one tp_btf and one raw_tp program for a hook with its pointer argument at `$n`.
macro_rules! hook {
    ($tp:literal, $btf_name:ident, $raw_name:ident, $n:literal, |$ctx:ident| $body:expr) => {
        #[btf_tracepoint(function = $tp)]
        pub fn $btf_name(c: BtfTracePointContext) -> i32 {
            #[allow(dead_code)]
            type M = Direct;
            let $ctx = c.as_ptr();
            $body;
            0
        }
        #[raw_tracepoint(tracepoint = $tp)]
        pub fn $raw_name(c: RawTracePointContext) -> i32 {
            #[allow(dead_code)]
            type M = Probe;
            let $ctx = c.as_ptr();
            $body;
            0
        }
    };
}

// Since 5.11 the pointer is the first argument; before, a `request_queue *` came first.
hook!("block_bio_queue", btf_bio_queue_a0, raw_bio_queue_a0, 0, |c| on_bio_queue::<M>(arg::<0>(c)));
hook!("block_bio_queue", btf_bio_queue_a1, raw_bio_queue_a1, 1, |c| on_bio_queue::<M>(arg::<1>(c)));
hook!("block_getrq", btf_getrq_a0, raw_getrq_a0, 0, |c| on_getrq::<M>(arg::<0>(c)));
hook!("block_getrq", btf_getrq_a1, raw_getrq_a1, 1, |c| on_getrq::<M>(arg::<1>(c)));
hook!("block_split", btf_split_a0, raw_split_a0, 0, |c| on_split::<M>(arg::<0>(c)));
hook!("block_split", btf_split_a1, raw_split_a1, 1, |c| on_split::<M>(arg::<1>(c)));
// Before 5.11 merges were (q, rq, bio).
hook!("block_bio_backmerge", btf_backmerge_a0, raw_backmerge_a0, 0, |c| on_bio_merge::<M>(arg::<0>(c)));
hook!("block_bio_backmerge", btf_backmerge_a2, raw_backmerge_a2, 2, |c| on_bio_merge::<M>(arg::<2>(c)));
hook!("block_bio_frontmerge", btf_frontmerge_a0, raw_frontmerge_a0, 0, |c| on_bio_merge::<M>(arg::<0>(c)));
hook!("block_bio_frontmerge", btf_frontmerge_a2, raw_frontmerge_a2, 2, |c| on_bio_merge::<M>(arg::<2>(c)));
hook!("block_rq_insert", btf_rq_insert_a0, raw_rq_insert_a0, 0, |c| on_rq_insert::<M>(arg::<0>(c)));
hook!("block_rq_insert", btf_rq_insert_a1, raw_rq_insert_a1, 1, |c| on_rq_insert::<M>(arg::<1>(c)));
hook!("block_rq_issue", btf_rq_issue_a0, raw_rq_issue_a0, 0, |c| on_rq_issue::<M>(arg::<0>(c)));
hook!("block_rq_issue", btf_rq_issue_a1, raw_rq_issue_a1, 1, |c| on_rq_issue::<M>(arg::<1>(c)));
hook!("block_rq_requeue", btf_rq_requeue_a0, raw_rq_requeue_a0, 0, |c| on_rq_requeue(arg::<0>(c)));
hook!("block_rq_requeue", btf_rq_requeue_a1, raw_rq_requeue_a1, 1, |c| on_rq_requeue(arg::<1>(c)));
// (request *) since 5.11; (request_queue *, request *) in 5.9 and 5.10.
hook!("block_rq_merge", btf_rq_merge_a0, raw_rq_merge_a0, 0, |c| on_rq_merge::<M>(arg::<0>(c)));
hook!("block_rq_merge", btf_rq_merge_a1, raw_rq_merge_a1, 1, |c| on_rq_merge::<M>(arg::<1>(c)));
// (rq, error, nr_bytes) on every kernel tracerd supports.
hook!("block_rq_complete", btf_rq_complete_a0, raw_rq_complete_a0, 0, |c| on_rq_complete::<M>(
    arg::<0>(c),
    arg::<1>(c) as u32,
    arg::<2>(c) as u32
));

hook!("block_bio_remap", btf_bio_remap_a0, raw_bio_remap_a0, 0, |c| on_bio_remap(
    arg::<0>(c),
    arg::<1>(c) as u32
));
hook!("block_bio_remap", btf_bio_remap_a1, raw_bio_remap_a1, 1, |c| on_bio_remap(
    arg::<1>(c),
    arg::<2>(c) as u32
));
hook!("block_rq_remap", btf_rq_remap_a0, raw_rq_remap_a0, 0, |c| on_rq_remap(
    arg::<0>(c),
    arg::<1>(c) as u32
));
hook!("block_rq_remap", btf_rq_remap_a1, raw_rq_remap_a1, 1, |c| on_rq_remap(
    arg::<1>(c),
    arg::<2>(c) as u32
));
// (request_queue *, bio *) on every kernel tracerd supports.
hook!("block_bio_complete", btf_bio_complete_a1, raw_bio_complete_a1, 1, |c| on_bio_complete::<M>(arg::<1>(
    c
)));

// Waits inside IO phases (config `causes`): tp_btf only, on kernels whose sched_switch has
// `prev_state` as its last argument (5.18 and later): (preempt, prev, next, prev_state).
#[btf_tracepoint(function = "sched_switch")]
pub fn btf_sched_switch(c: BtfTracePointContext) -> i32 {
    let ctx = c.as_ptr();
    on_sched_switch(&c, arg::<0>(ctx), arg::<2>(ctx), arg::<3>(ctx));
    0
}

#[btf_tracepoint(function = "sched_waking")]
pub fn btf_sched_waking(c: BtfTracePointContext) -> i32 {
    on_sched_waking(&c, arg::<0>(c.as_ptr()));
    0
}

#[btf_tracepoint(function = "sched_wakeup")]
pub fn btf_sched_wakeup(c: BtfTracePointContext) -> i32 {
    on_sched_wakeup(arg::<0>(c.as_ptr()));
    0
}

// Interrupt levels, so that a completion running in an interrupt is not taken for the
// interrupted task's.
#[btf_tracepoint(function = "irq_handler_entry")]
pub fn btf_irq_entry(_c: BtfTracePointContext) -> i32 {
    on_level_enter();
    0
}

#[btf_tracepoint(function = "irq_handler_exit")]
pub fn btf_irq_exit(_c: BtfTracePointContext) -> i32 {
    on_level_exit();
    0
}

#[btf_tracepoint(function = "softirq_entry")]
pub fn btf_softirq_entry(_c: BtfTracePointContext) -> i32 {
    on_level_enter();
    0
}

#[btf_tracepoint(function = "softirq_exit")]
pub fn btf_softirq_exit(_c: BtfTracePointContext) -> i32 {
    on_level_exit();
    0
}

// Submit paths of stacked devices (module functions: kprobes, attached by name).
#[kprobe]
pub fn kp_submit_bio(ctx: ProbeContext) -> u32 {
    if let Some(bio) = ctx.arg::<u64>(0) {
        on_submit_enter::<Probe>(bio);
    }
    0
}

#[kretprobe]
pub fn kr_submit_bio(_ctx: RetProbeContext) -> u32 {
    on_submit_exit();
    0
}

#[kprobe]
pub fn kp_queue_rq(ctx: ProbeContext) -> u32 {
    if let Some(queue_data) = ctx.arg::<u64>(1) {
        on_queue_rq_enter::<Probe>(queue_data);
    }
    0
}

#[kretprobe]
pub fn kr_queue_rq(_ctx: RetProbeContext) -> u32 {
    on_queue_rq_exit();
    0
}

#[kprobe]
pub fn kp_personality(_ctx: ProbeContext) -> u32 {
    on_personality_enter();
    0
}

#[kretprobe]
pub fn kr_personality(_ctx: RetProbeContext) -> u32 {
    on_personality_exit();
    0
}

// blk-throttle's check of a bio whose group has limits (a kernel function: a kprobe).
#[kprobe]
pub fn kp_throttle(ctx: ProbeContext) -> u32 {
    if let Some(bio) = ctx.arg::<u64>(0) {
        on_throttle::<Probe>(bio);
    }
    0
}

// rq-qos waits inside Q2G (kernel functions: kprobes, with config rq_qos).
#[kprobe]
pub fn kp_rq_qos_wait(ctx: ProbeContext) -> u32 {
    on_qos_enter(rq_qos_policy(ctx.arg::<u64>(2).unwrap_or(0)));
    0
}

#[kretprobe]
pub fn kr_rq_qos_wait(_ctx: RetProbeContext) -> u32 {
    on_qos_exit();
    0
}

#[kprobe]
pub fn kp_ioc_throttle(_ctx: ProbeContext) -> u32 {
    on_qos_enter(tracer_common::qos::IOCOST);
    0
}

#[kretprobe]
pub fn kr_ioc_throttle(_ctx: RetProbeContext) -> u32 {
    on_qos_exit();
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
