//! Types shared by tracerd's kernel programs (`tracer-ebpf`) and its daemon (`tracerd`).
//!
//! Everything here is `#[repr(C)]` and `no_std`: the kernel writes these bytes, the daemon reads
//! them. Userspace-only impls (`aya::Pod`) sit behind the `user` feature.
#![no_std]

/// Block-layer events, in blktrace's letters. Used as indices into [`IoRecord::ts`].
pub mod event {
    /// `block_bio_queue`: a bio is queued on a device.
    pub const Q: usize = 0;
    /// `block_getrq`: a request is allocated for the bio.
    pub const G: usize = 1;
    /// `block_rq_insert`: the request enters the scheduler queue.
    pub const I: usize = 2;
    /// `block_rq_issue`: the request goes to the driver.
    pub const D: usize = 3;
    /// `block_rq_complete`: the request is fully done.
    pub const C: usize = 4;
    /// `block_bio_backmerge`/`frontmerge`: the bio joined an existing request.
    pub const M: usize = 5;
    /// blk-throttle checked the bio against its group's limits (`__blk_throtl_bio`, a kprobe),
    /// before its Q: a bio it holds (cgroup `io.max`, v1 `blkio.throttle.*`) is queued when
    /// released. Only bios of groups with limits are checked.
    pub const H: usize = 6;
    pub const COUNT: usize = 7;
}

/// What one [`IoRecord`] describes.
pub mod kind {
    /// A completed request (Q, G, I, D, C as they fired).
    pub const REQUEST: u8 = 1;
    /// A bio merged into an existing request (Q and M).
    pub const MERGE: u8 = 2;
    /// A bio completed at bio level (Q and C): IO of a bio-based device (md, dm, brd), or a
    /// bio that never became a request.
    pub const BIO: u8 = 3;
    /// Not an IO: the upper bio `id` also has its data in the lower IO whose first upper IO is
    /// `parent`, queued on `dev` at `sector`. Sent at the remap, before the lower IO's own
    /// record: md raid4/5/6 sends one member write for several upper writes of one page.
    pub const LINK: u8 = 4;
}

/// What a lower IO that serves no one upper IO is, where the kernel tells it (the layer's own
/// IO). The kernel puts the kind where a parent would be (a `LINKS` value, a record's
/// `parent`), below [`own::LIMIT`]: no kernel pointer is that small. The daemon moves it to
/// [`IoRecord::own`] and clears the parent.
pub mod own {
    /// The kernel did not say.
    pub const UNSTATED: u8 = 0;
    /// md raid4/5/6: a parity (P or Q) write, for every upper write of its stripe.
    pub const PARITY: u8 = 1;
    /// md raid4/5/6: a read of old data or parity before a write (read-modify-write,
    /// reconstruct-write), or of the other members to rebuild a missing one.
    pub const PREREAD: u8 = 2;
    /// md: resync, recovery, check, repair or reshape.
    pub const RESYNC: u8 = 3;
    /// md: a superblock or write-intent bitmap write.
    pub const SUPERBLOCK: u8 = 4;
    /// dm: a bio of dm-io, dm's own IO service: kcopyd's copies and zeroing (a thin pool
    /// provisioning a block, a snapshot's copy-on-write), dm-mirror's writes.
    pub const DM_IO: u8 = 5;
    /// dm: a bio of dm-bufio, the block cache of a target's metadata (a thin pool's or
    /// dm-cache's metadata device, dm-verity's hash tree).
    pub const DM_BUFIO: u8 = 6;
    pub const COUNT: usize = 7;
    /// Parent values below this are kinds.
    pub const LIMIT: u64 = 256;

    /// Where `kind` is counted in a `[u64; COUNT]`: a kind this build does not know is
    /// unstated, as [`name`] says.
    pub fn index(kind: u8) -> usize {
        if (kind as usize) < COUNT { kind as usize } else { UNSTATED as usize }
    }

    pub fn name(kind: u8) -> &'static str {
        match kind {
            PARITY => "parity",
            PREREAD => "preread",
            RESYNC => "resync",
            SUPERBLOCK => "superblock",
            DM_IO => "dm_io",
            DM_BUFIO => "dm_bufio",
            _ => "unstated",
        }
    }
}

/// Bits of [`IoRecord::flags`].
pub mod flag {
    /// The driver sent the request back at least once (`block_rq_requeue`).
    pub const REQUEUED: u8 = 1 << 0;
    /// The request carries a bio split off a larger one (`block_split`).
    pub const SPLIT: u8 = 1 << 1;
    /// Request-based dm sent the request's data down as a clone (`block_rq_remap`): the clone's
    /// completion completes its bytes, and dm ends it later with a zero-byte completion (its C).
    pub const CLONED: u8 = 1 << 2;
    /// The kernel also counted this IO into its own aggregation (`run --aggregation check`).
    pub const IN_KERNEL: u8 = 1 << 3;
    /// [`IoRecord::cgroup`] is the submitting task's cgroup v2 id: the bio had no blkcg
    /// association of its own, or only the root's. Without it, the cgroup is the bio's blkcg
    /// (`bio->bi_blkg`), in the hierarchy the io/blkio controller is mounted in (v2, or v1 blkio).
    pub const CGROUP_TASK: u8 = 1 << 4;
    /// Set by the daemon, never the kernel: an IO of a device below a traced stacked device
    /// that names no upper IO (the stacked driver's own IO, or a link the kernel does not state).
    pub const UNLINKED: u8 = 1 << 5;
    /// The bio itself was moved to this disk after its Q, as NVMe multipath moves a head's bio
    /// to a path: the record's Q is that remap and its parent the bio on the upper device.
    pub const PATH: u8 = 1 << 6;
    /// A path request ([`PATH`]) that ended with its bios taken back to the head (NVMe's
    /// failover, on a path error or a controller reset), to be sent down another path: the
    /// head's record follows the request that serves them.
    pub const FAILOVER: u8 = 1 << 7;
}

/// Why an event was lost. Index into the kernel's per-CPU `LOST` counters; the daemon adds
/// reasons of its own after [`lost::KERNEL_COUNT`].
pub mod lost {
    /// The ring buffer had no room for a record.
    pub const RINGBUF_FULL: u32 = 0;
    /// The in-flight bio map was full at `block_bio_queue`.
    pub const BIO_MAP_FULL: u32 = 1;
    /// The in-flight request map was full when a request was first seen.
    pub const REQUEST_MAP_FULL: u32 = 2;
    /// A request completed on a traced device without any recorded start.
    pub const COMPLETE_WITHOUT_START: u32 = 3;
    /// The map linking lower bios to their upper bio was full at a remap.
    pub const LINK_MAP_FULL: u32 = 4;
    /// A request was issued (or inserted) again while its last issue was still open, with no
    /// requeue between: that issue's completion was never seen (a nested run the kernel skipped,
    /// counted as `recursion` too, or a run it did not make at all: docs/internals/missed-completions.md).
    pub const MISSED_COMPLETION: u32 = 5;
    /// A task slept inside an IO's phase while `WAITERS` was full: its wait went unrecorded.
    pub const WAIT_MAP_FULL: u32 = 6;
    /// A sleeper's or waker's kernel stack could not be taken (its wait is kept, unnamed).
    pub const STACK: u32 = 7;
    pub const KERNEL_COUNT: u32 = 8;
}

/// One record per completed request (or merged bio), written by the kernel into the ring buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoRecord {
    /// `bpf_ktime_get_ns` of each event (indexed by [`event`]); 0 = the event did not fire.
    pub ts: [u64; event::COUNT],
    /// First sector (512 bytes) on the whole disk.
    pub sector: u64,
    /// Id of the cgroup the IO is charged to (see [`flag::CGROUP_TASK`]); 0 when unknown.
    pub cgroup: u64,
    /// Whole disk the request ran on (kernel `dev_t`: major << 20 | minor); 0 for merges.
    pub disk: u32,
    /// Device the bio was queued on (a partition or the disk); 0 when no Q was seen.
    pub dev: u32,
    /// `cmd_flags` of the request (`bi_opf` of a merged bio): op in the low bits, then flags.
    pub cmd_flags: u32,
    /// Bytes transferred.
    pub bytes: u32,
    /// Requests in flight on the disk at issue, this one included; 0 if never issued.
    pub queue_depth: u32,
    /// Thread that queued the first bio; 0 when unknown.
    pub pid: u32,
    /// `blk_status_t` passed to `block_rq_complete`.
    pub error: u32,
    pub kind: u8,
    pub flags: u8,
    /// Set by the daemon, never the kernel: the [`own`] kind of an unlinked IO.
    pub own: u8,
    /// The rq-qos policies the IO waited in between Q and G ([`qos`] bits); 0 if none.
    pub qos: u8,
    /// `comm` of the thread that queued the first bio; zeroes when unknown.
    pub comm: [u8; 16],
    /// The bio's address, for BIO records: lower IOs name it as their `parent`.
    pub id: u64,
    /// The upper bio this IO was remapped from (a stacked device's IO); 0 if none.
    pub parent: u64,
    /// Time inside the device's submit function (`md_submit_bio`, `dm_submit_bio`); 0 if none.
    pub submit_ns: u64,
    /// Time inside the md personality's make_request (`raid1_make_request`); 0 if none.
    pub personality_ns: u64,
    /// Time the IO waited in the rq-qos policies of [`IoRecord::qos`], part of its Q2G.
    pub qos_ns: u64,
    /// The request's own timestamps as the kernel left them at completion (indexed by
    /// [`kernel_ts`]); 0 where it did not set one (or BTF lacks the member). Requests only.
    pub kernel_ns: [u64; kernel_ts::COUNT],
}

/// Who went ahead of one request (config `causes`, every IO sent as a record): each disk
/// numbers its G's and its D's, from 1. `getrq_from` is the disk's count of G's when the
/// request's first bio was queued and `getrq_seq` its own G's number, so the G's numbered in
/// between are the requests allocated ahead of it; `issue_from` and `issue_seq` do the same for
/// D from its I. Sent at the request's D, before its [`IoRecord`] (same `id`), and kept out of
/// that record: the completion's program is at the verifier's limit on older kernels.
/// A different size from [`IoRecord`] and [`WaitRecord`]: the reader tells them apart by length.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AheadRecord {
    /// The request's key, its [`IoRecord::id`].
    pub id: u64,
    /// Whole disk that numbered it.
    pub disk: u32,
    pub getrq_from: u32,
    pub getrq_seq: u32,
    pub issue_from: u32,
    pub issue_seq: u32,
    pub _pad: u32,
}

/// Waits of a task inside an IO's phase (config `causes`): what each [`WaitRecord`] field means.
pub mod wait {
    /// `WaitRecord::phase`: the submitter between the bio's Q and its request's G (a tag, a
    /// frozen queue, an rq-qos policy).
    pub const Q2G: u8 = 1;
    /// A stacked device's submission, from its Q until its submit function returned, and after
    /// it while a lower bio it remapped is still to be sent by the same task (`md_write_start`,
    /// raid1's `wait_barrier`, its plug callback).
    pub const SUBMIT: u8 = 2;
    /// A stacked device's lower IO handed to the layer's own thread (md raid1's and raid10's
    /// `mdX_raidN`): from the submitter's remap of it to that thread's Q of it. The record's
    /// `tid` is the submitter, `waker_tid` and `waker_comm` the thread.
    pub const HANDOFF: u8 = 3;
    /// The layer's thread, from the wakeup a submitter with a lower IO to hand off gave it, until
    /// it queued a handed-off lower IO: its own waits, with no IO of its own (`bio` 0). The
    /// daemon puts them inside the hand-off they fall in.
    pub const THREAD: u8 = 4;
    /// `WaitRecord::state`: the task blocked (asleep until woken).
    pub const BLOCKED: u8 = 1;
    /// The task was preempted: runnable, waiting for a CPU.
    pub const PREEMPTED: u8 = 2;
    /// Woken at a hand-off ([`THREAD`]): runnable from that wakeup until it ran.
    pub const WOKEN: u8 = 3;
    /// `WaitRecord::waker`: no wakeup was seen before the task ran again (preempted, or a
    /// wakeup that came before the hooks were attached).
    pub const WAKER_NONE: u8 = 0;
    /// The wakeup came inside the completion of an IO (`waker_io` on `waker_disk`).
    pub const WAKER_IO: u8 = 1;
    /// A task woke it (`waker_tid`, `waker_comm`), outside any IO completion.
    pub const WAKER_TASK: u8 = 2;
    /// An interrupt that was completing no IO woke it (a timer, another device).
    pub const WAKER_INTERRUPT: u8 = 3;
    /// Not woken: it was preempted, and `waker_tid`, `waker_comm` name the task the scheduler
    /// ran in its place.
    pub const WAKER_PREEMPTED: u8 = 4;
    /// `Holder::flags` and `WaitRecord::flags`.
    pub mod flag {
        /// The task is a layer's thread working for a hand-off (`WORKERS`): its sleeps in no
        /// phase of an IO of its own are [`super::THREAD`] waits.
        pub const WORKER: u32 = 1;
        /// The task remapped a lower bio of the bio it holds and has not queued it yet (md raid1
        /// flushing its plug after `md_submit_bio` returned): still the layer's submission.
        pub const REMAPPED: u32 = 2;
    }
    /// Nesting levels whose completions are told apart on a CPU: task, softirq, hardirq.
    pub const LEVELS: u32 = 4;
}

/// One sleep (or preemption) of a task inside an IO's phase, sent when the task runs again.
/// A different size from [`IoRecord`]: the reader tells the two apart by length.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WaitRecord {
    /// The task left the CPU (`sched_switch`).
    pub slept_ns: u64,
    /// Its first wakeup (`sched_waking`); 0 if none was seen.
    pub woken_ns: u64,
    /// It ran again.
    pub ran_ns: u64,
    /// The bio it held (its key), and that bio's Q: with `dev`, they name the IO.
    pub bio: u64,
    pub queued_ns: u64,
    /// The IO whose completion woke it ([`wait::WAKER_IO`]): its record's `id`, and the stamp
    /// its record has as C (the same clock read).
    pub waker_io: u64,
    pub waker_io_done_ns: u64,
    /// With [`wait::flag::REMAPPED`] in `flags`: the holder's lower bio, given back with them.
    pub lower: u64,
    pub dev: u32,
    /// `bi_opf` of the held bio.
    pub opf: u32,
    /// Whole disk of the waking IO; 0 if untraced.
    pub waker_disk: u32,
    pub tid: u32,
    /// The task current when the wakeup came (for [`wait::WAKER_IO`] in an interrupt, the one
    /// it interrupted).
    pub waker_tid: u32,
    /// Kernel stack ids in `STACKS` of the sleeper (at sleep) and of the waker; negative when
    /// none could be taken.
    pub stack: i32,
    pub waker_stack: i32,
    pub phase: u8,
    pub state: u8,
    pub waker: u8,
    /// The holder's [`wait::flag`]s at the sleep, given back to it when the task runs again.
    pub flags: u8,
    pub waker_comm: [u8; 16],
}

/// The task on a CPU that queued a bio and has not yet left the CPU (per CPU, `HOLDER`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Holder {
    pub bio: u64,
    pub queued_ns: u64,
    /// With [`wait::flag::REMAPPED`]: the lower bio last remapped, whose Q ends the flag's phase.
    pub lower: u64,
    pub tid: u32,
    pub dev: u32,
    pub opf: u32,
    /// [`wait::flag`]s of the task's state.
    pub flags: u32,
}

/// A lower bio remapped by a task with `causes` on, until its Q (`HANDOFFS`): whether another
/// task queues it, and for which upper IO.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Handoff {
    pub remap_ns: u64,
    /// The upper bio's key and Q stamp, its device and `bi_opf`: the IO the hand-off is part of.
    pub upper: u64,
    pub upper_queued_ns: u64,
    pub upper_dev: u32,
    pub upper_opf: u32,
    /// The task that remapped it.
    pub tid: u32,
    pub _pad: u32,
}

/// The IO whose completion runs at one nesting level of a CPU (`COMPLETING`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Completing {
    pub io: u64,
    pub done_ns: u64,
    pub disk: u32,
    pub _pad: u32,
}

/// Timestamps the kernel keeps in `struct request`, read at completion beside the probes' own.
pub mod kernel_ts {
    /// `rq->start_time_ns`: set at allocation (before G) up to 6.x, at I/O accounting start
    /// (just after G) in newer kernels; only with iostats or a scheduler.
    pub const START: usize = 0;
    /// `rq->io_start_time_ns`: set right after D, only while a stats consumer (wbt) is on the
    /// queue.
    pub const IO_START: usize = 1;
    pub const COUNT: usize = 2;
}

/// A bio seen at Q and not yet turned into (or merged into) a request. Key: `struct bio *`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BioState {
    /// 0 while the bio is held by blk-throttle (its slot was claimed at H, before its Q).
    pub queued_ns: u64,
    /// When blk-throttle checked it (H); 0 if it never did.
    pub held_ns: u64,
    pub getrq_ns: u64,
    pub sector: u64,
    pub parent: u64,
    pub submit_ns: u64,
    pub personality_ns: u64,
    /// Cgroup id (see [`IoRecord::cgroup`]).
    pub cgroup: u64,
    pub dev: u32,
    pub pid: u32,
    pub opf: u32,
    pub bytes: u32,
    pub flags: u8,
    /// rq-qos policies it waited in ([`qos`] bits), and for how long.
    pub qos: u8,
    pub _pad: [u8; 2],
    /// The disk's count of G's at this bio's Q, and its own G's number ([`IoRecord::getrq_from`]).
    pub getrq_from: u32,
    pub comm: [u8; 16],
    pub qos_ns: u64,
    pub getrq_seq: u32,
    pub _pad2: u32,
}

/// rq-qos policies, as bits of [`IoRecord::qos`]: whose throttle a bio waited in between its Q
/// and its G (the request allocation follows the throttle in the same task).
pub mod qos {
    /// Writeback throttling (`rq_qos_wait` called back through `wbt_inflight_cb`).
    pub const WBT: u8 = 1 << 0;
    /// `io.latency` (`rq_qos_wait` through `iolat_acquire_inflight`).
    pub const IOLATENCY: u8 = 1 << 1;
    /// `io.cost` (`ioc_rqos_throttle`, which waits in its own loop).
    pub const IOCOST: u8 = 1 << 2;
    /// `rq_qos_wait` through a callback that is neither of the above.
    pub const OTHER: u8 = 1 << 3;
    pub const NAMES: [(u8, &str); 4] =
        [(WBT, "wbt"), (IOLATENCY, "iolatency"), (IOCOST, "iocost"), (OTHER, "rq_qos")];
}

/// A task inside an rq-qos wait (`rq_qos_wait`, `ioc_rqos_throttle`), then the wait it finished
/// until its bio's G takes it. Key: thread id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct QosWait {
    /// When the current (or last) wait began.
    pub entered_ns: u64,
    /// Time of the finished waits, summed.
    pub waited_ns: u64,
    /// The policy of the wait in progress ([`qos`] bit); 0 between waits.
    pub waiting: u8,
    /// The policies of the finished waits.
    pub done: u8,
    /// 1 while the finished waits count in `QOS_PENDING`.
    pub pending: u8,
    pub _pad: [u8; 5],
}

/// The `BIOS` key under which a bio moved to a path after its Q (NVMe multipath) keeps its
/// state on the upper device, while its own key tracks it on the path. Bio pointers are
/// aligned, so this is never another bio's key, and [`slot_set`] puts both in one set. On that
/// slot `getrq_ns` holds the bio's C: a head never allocates a request of its own.
#[inline(always)]
pub fn head_key(bio: u64) -> u64 {
    bio | 1
}

/// One entry of a slot table (the kernel's in-flight bios and requests): a 4-way
/// set-associative array indexed by a hash of the pointer. Array lookups are inlined by the
/// verifier; a hash map costs a helper call and a lock per operation, several times per IO.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Slot<V> {
    /// `struct bio *` or `struct request *`; 0 marks a free slot.
    pub key: u64,
    pub value: V,
}

/// Ways per set of a slot table.
pub const SLOT_WAYS: u32 = 4;

/// First slot of the set `key` belongs to, in a table of `slots` entries (a power of two).
#[inline(always)]
pub fn slot_set(key: u64, slots: u32) -> u32 {
    // Fibonacci hashing of the pointer without its alignment bits.
    let h = (key >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    ((h >> 32) as u32 & (slots / SLOT_WAYS - 1)) * SLOT_WAYS
}

/// A task inside a stacked device's submit function. Key: thread id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SubmitState {
    /// The upper bio being submitted.
    pub bio: u64,
    pub entered_ns: u64,
    pub personality_entered_ns: u64,
    /// Its device: a remap names the upper device, and must match.
    pub dev: u32,
    pub _pad: u32,
}

/// How lower IOs of stacked devices are linked to their upper IO, with the offsets that takes
/// in the stacked drivers' own structs (their module's BTF, read once the module is loaded).
/// The one entry of the `STACK` map, rewritten by the daemon when a module appears.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackLayout {
    /// Non-zero when something can link (the submit-path kprobes, or a chain below): remaps
    /// are followed and each queued bio looks up its link.
    pub links: u32,
    /// `struct bio.bi_flags` (a u16) and the bit of `BIO_CLONED` in it (vmlinux BTF).
    pub bio_bi_flags: u32,
    pub bio_cloned_bit: u32,
    /// Non-zero when dm_mod's BTF gave the chain from a clone to the bio it was made from:
    /// clone - `dm_target_io.clone` is its tio; `tio.magic`, `tio.io`; `dm_io.magic`, `.orig_bio`.
    pub dm: u32,
    pub tio_clone: u32,
    pub tio_magic: u32,
    pub tio_io: u32,
    pub io_magic: u32,
    pub io_orig_bio: u32,
    /// Non-zero when dm_crypt's BTF gave `dm_crypt_io.base_bio`: a crypt clone's `bi_private`
    /// is its `dm_crypt_io`, whose base bio is dm's clone.
    pub crypt: u32,
    pub crypt_io_base_bio: u32,
    pub _pad: u32,
    /// md (md_mod, raid1, raid10 BTF and /proc/kallsyms): a member bio whose `bi_end_io` is a
    /// personality's end function names its r1bio/r10bio in `bi_private`, whose `master_bio`
    /// is the upper bio, or md's accounting clone of it: a bio whose `bi_end_io` is
    /// `md_clone_end` names, in `bi_private`, the clone's struct, whose member at
    /// `md_clone_orig_bio` is the bio md got. Addresses are 0 where unresolved.
    pub raid1_read_end: u64,
    pub raid1_write_end: u64,
    pub raid10_read_end: u64,
    pub raid10_write_end: u64,
    pub md_clone_end: u64,
    /// `bio_chain_endio` (/proc/kallsyms): a bio that ends there is a piece chained to the bio
    /// in its `bi_private` (`bio_chain`), as md raid0 sends the front of a bio it splits.
    pub chain_end: u64,
    /// `struct bio.bi_end_io` (vmlinux BTF); 0 when md's chains are off.
    pub bio_bi_end_io: u32,
    pub r1bio_master_bio: u32,
    pub r10bio_master_bio: u32,
    pub md_clone_orig_bio: u32,
    /// md raid4/5/6 (raid456 BTF and /proc/kallsyms): a stripe's member bio is `dev[i].req`
    /// (or `.rreq`, the replacement disk's) of the `stripe_head` in its `bi_private`, its data
    /// the upper bios on `dev[i].written` (writes) or `.toread` (reads); an aligned read's
    /// `bi_private` is the upper bio (6.12's accounting clone), or with `r5_align_acct` 6.1's
    /// `md_io_acct`. `md_super_end` ends md's superblock and bitmap writes; the sync ends,
    /// raid1's and raid10's resync IO. Addresses are 0 where unresolved.
    pub raid5_read_end: u64,
    pub raid5_write_end: u64,
    pub raid5_align_end: u64,
    pub md_super_end: u64,
    pub raid1_sync_read_end: u64,
    pub raid1_sync_write_end: u64,
    pub raid10_sync_read_end: u64,
    pub raid10_sync_write_end: u64,
    pub sh_dev: u32,
    pub sh_state: u32,
    pub sh_disks: u32,
    pub r5dev_size: u32,
    pub r5dev_req: u32,
    pub r5dev_rreq: u32,
    pub r5dev_toread: u32,
    pub r5dev_written: u32,
    pub r5dev_sector: u32,
    /// `stripe_head.state` bits of resync, reshape and replacement (`STRIPE_SYNCING`, ...).
    pub r5_own_state: u32,
    pub r5_align_acct: u32,
    /// Non-zero while an NVMe multipath path disk is traced: only then is a remap of a bio
    /// already queued looked for (two slot lookups on every remap).
    pub paths: u32,
    /// Request-based dm (dm_mod BTF, vmlinux BTF, /proc/kallsyms): a clone request whose
    /// `end_io` is `end_clone_request` names its `dm_rq_target_io` in `end_io_data`, whose
    /// `orig` is the request dm got. `dm_rq_end` is 0 where unresolved.
    pub rq_end_io: u32,
    pub rq_end_io_data: u32,
    pub rq_tio_orig: u32,
    pub _pad2: u32,
    pub dm_rq_end: u64,
    /// dm's own IO, by the function its bios end in (/proc/kallsyms): dm-io's `endio` (dm_mod:
    /// kcopyd's copies and zeroing, dm-mirror's writes, dm-bufio's fallback) and dm-bufio's
    /// `bio_complete` (a target's metadata blocks: the thin pool's, dm-cache's; verity's hash
    /// tree). 0 where unresolved; with either, `bio_bi_end_io` is set.
    pub dm_io_end: u64,
    pub dm_bufio_end: u64,
}

/// Sectors of one raid5 stripe page (`RAID5_STRIPE_SECTORS`): md's default stripe size of
/// 4 KiB, the only one on 4 KiB-page machines.
pub const RAID5_STRIPE_SECTORS: u64 = 8;

/// dm's own checks of its per-IO structs (`DM_TIO_MAGIC`, `DM_IO_MAGIC` in drivers/md/dm-core.h;
/// #defines, so not in BTF). A pointer whose magics do not match is not followed.
pub mod dm {
    pub const TIO_MAGIC: u16 = 28714;
    pub const IO_MAGIC: u16 = 19577;
}

/// Start-up choices written into the programs' read-only data.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// Records are committed without waking the reader (which polls on a timer); each CPU wakes
    /// it on every this-many-th record: a wakeup per record costs an IPI per IO.
    pub wakeup_records: u32,
    /// Non-zero when every device is traced: the per-bio device filter lookup is skipped.
    pub all_devices: u32,
    /// What the kernel does with a completed request of a device with a series (`agg::mode`).
    pub aggregate: u32,
    /// The running kernel's op numbering (from BTF): `cmd_flags & op_mask` is the op.
    pub op_mask: u32,
    pub op_read: u32,
    pub op_write: u32,
    /// Non-zero when the agent labels series by cgroup: the queue program reads each bio's
    /// cgroup, and a request is counted in its (cgroup, device, op) series
    /// (`CgroupSeriesKey`), not its device's.
    pub cgroups: u32,
    /// Non-zero when the rq-qos wait probes are asked for (config `rq_qos`): only then does G
    /// look for its task's waits.
    pub rq_qos: u32,
    /// Non-zero when the scheduler hooks record waits inside IO phases (config `causes`): only
    /// then does Q note its submitter and a completion mark its CPU (`wait`).
    pub causes: u32,
    pub _pad: u32,
    /// Addresses of the callbacks through which wbt and io.latency call `rq_qos_wait`
    /// (`/proc/kallsyms`); 0 where unknown.
    pub wbt_inflight_cb: u64,
    pub iolat_acquire_inflight: u64,
}

/// Key of a per-cgroup series of the in-kernel aggregation (map `CGROUP_SERIES`; the value is
/// the index of its `SeriesAgg` in `CGROUP_AGG`). Given out by the daemon when a record of an
/// unknown key arrives, as device series are.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CgroupSeriesKey {
    /// [`IoRecord::cgroup`].
    pub cgroup: u64,
    /// The device's series (1-based, as in `SERIES_OF`).
    pub series: u32,
    /// `agg::READ` or `agg::WRITE`.
    pub op: u16,
    /// 1 when the cgroup is the submitting task's ([`flag::CGROUP_TASK`]): its id is then of
    /// the v2 hierarchy, else of the io controller's.
    pub task: u16,
}

/// A request seen at I or D and not yet fully completed. Key: `struct request *`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestState {
    pub record: IoRecord,
    /// Set while the request counts towards its disk's queue depth.
    pub issued: u8,
    pub _pad: [u8; 7],
    /// Its numbers among the disk's G's and D's (config `causes`), sent at its D.
    pub ahead: AheadRecord,
}

/// [`DeviceState::bio_based`].
pub mod bio_based {
    /// Request-based: a submitter's sleep between Q and G is part of its IO.
    pub const NO: u32 = 0;
    /// Bio-based, with no hook on its submit function: no sleep is known to be its IO's.
    pub const YES: u32 = 1;
    /// Bio-based with its submit function hooked (md, bio-based dm): a sleep from Q until that
    /// function returned (its `submit_ns` still 0 outside it) is part of the IO.
    pub const SUBMIT_HOOKED: u32 = 2;
}

/// A traced device. Key: kernel `dev_t` of a disk or partition; inserted by the daemon.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceState {
    /// Requests issued to this disk and not yet completed (updated atomically).
    pub in_flight: u32,
    /// The device's index into `SERIES_OF` (1-based; fixed while it is traced).
    pub index: u32,
    /// 1 for a path disk of NVMe multipath (sysfs `hidden`, below its head): a bio moved here
    /// after its Q is a lower IO of the bio on the head.
    pub path: u32,
    /// [`bio_based`]: whether the device is bio-based (no `mq/` in sysfs: md, dm, brd, an NVMe
    /// head), whose bios get no G, so that a submitter's sleep counts for one only until its
    /// submit function returned.
    pub bio_based: u32,
    /// The whole disk of a partition (kernel `dev_t`); its own for a disk. A partition's
    /// requests are the disk's: G's are numbered on the disk.
    pub disk: u32,
    /// G's and D's numbered on this disk so far (config `causes`; updated atomically).
    pub getrqs: u32,
    pub issues: u32,
    pub _pad: u32,
}

/// In-kernel aggregation for the agent (`tracerd run`): completed reads and writes of a device
/// with a series are counted into per-CPU [`SeriesAgg`] counters, which the daemon folds into
/// its histograms; no record crosses the ring buffer for them.
pub mod agg {
    /// `Settings::aggregate`.
    pub mod mode {
        /// Every IO is a record (report, snoop, capture).
        pub const RECORDS: u32 = 0;
        /// Reads and writes of devices with a series are counted in the kernel only.
        pub const KERNEL: u32 = 1;
        /// Counted in the kernel and sent as records too, flagged `IN_KERNEL`, so that the
        /// daemon can check one against the other.
        pub const CHECK: u32 = 2;
    }

    /// Ops with in-kernel series; other ops (flush, discard, ...) stay records.
    pub const OPS: u32 = 2;
    pub const READ: u32 = 0;
    pub const WRITE: u32 = 1;

    /// Request stages counted in the kernel, in the daemon's `Stage` order: Q2G, G2I, I2D,
    /// G2D, Q2D, D2C, Q2C.
    pub const STAGES: usize = 7;

    /// Preferred numbers (R10) per decade, in hundredths: 1, 2 and 5 are among them, so the
    /// Prometheus buckets (1-2-5 steps) are unions of these.
    const R10: [u64; 10] = [100, 125, 160, 200, 250, 315, 400, 500, 630, 800];
    /// Bucket upper bounds (ns, inclusive): R10 steps from 100 ns to 50 s, then 60 s (the top
    /// of the daemon's histograms). Each bound is at most 1.28 times the one below.
    pub const BOUNDS_NS: [u64; 89] = bounds();
    /// Buckets per histogram: one per bound, and one above the last.
    pub const BUCKETS: usize = BOUNDS_NS.len() + 1;

    const fn bounds() -> [u64; 89] {
        let mut out = [0u64; 89];
        let (mut i, mut decade) = (0, 1u64);
        while i < 88 {
            let mut m = 0;
            while m < R10.len() && i < 88 {
                out[i] = R10[m] * decade;
                i += 1;
                m += 1;
            }
            decade *= 10;
        }
        out[88] = 60_000_000_000;
        out
    }

    /// The bucket of `ns`: the first whose bound is at least `ns` (BUCKETS - 1 above 60 s).
    /// A binary search in 7 halvings (2^7 >= BUCKETS), bounded for the verifier.
    #[inline(always)]
    pub fn bucket_of(ns: u64) -> usize {
        let (mut lo, mut hi) = (0usize, BOUNDS_NS.len());
        for _ in 0..7 {
            if lo < hi {
                let mid = (lo + hi) / 2;
                match BOUNDS_NS.get(mid) {
                    Some(&bound) if ns <= bound => hi = mid,
                    Some(_) => lo = mid + 1,
                    None => break,
                }
            }
        }
        lo
    }

    /// Queue-depth buckets, as the daemon keeps them: bucket k counts depths in
    /// (2^(k-1), 2^k], the last one everything above 2^(QD_BUCKETS-2).
    pub const QD_BUCKETS: usize = 12;

    #[inline(always)]
    pub fn qd_bucket(depth: u32) -> usize {
        let mut k = 0;
        while k < QD_BUCKETS - 1 && depth > 1 << k {
            k += 1;
        }
        k
    }

    /// Event paths counted per series: bit i set when event i (Q, G, I, D) fired; C always did.
    pub const PATHS: usize = 16;
}

/// One (device, op) series of the in-kernel aggregation, per CPU. Bucket and path counters
/// are u32 and wrap: the daemon folds differences every second, far below 2^32 IOs a CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeriesAgg {
    pub requests: u64,
    pub bytes: u64,
    pub errors: u64,
    /// Sum and count of the queue depths at issue (requests issued with one known).
    pub qd_sum: u64,
    pub qd_count: u64,
    /// Sum of each stage's ns (exact; Prometheus `_sum`).
    pub stage_ns: [u64; agg::STAGES],
    pub qd: [u32; agg::QD_BUCKETS],
    pub paths: [u32; agg::PATHS],
    pub hist: [[u32; agg::BUCKETS]; agg::STAGES],
}

impl Default for SeriesAgg {
    fn default() -> SeriesAgg {
        SeriesAgg {
            requests: 0,
            bytes: 0,
            errors: 0,
            qd_sum: 0,
            qd_count: 0,
            stage_ns: [0; agg::STAGES],
            qd: [0; agg::QD_BUCKETS],
            paths: [0; agg::PATHS],
            hist: [[0; agg::BUCKETS]; agg::STAGES],
        }
    }
}

impl SeriesAgg {
    /// `self + other`, counter by counter (wrapping, as the kernel's counters do).
    pub fn wrapping_add(&self, other: &SeriesAgg) -> SeriesAgg {
        self.zip(other, u64::wrapping_add, u32::wrapping_add)
    }

    /// `self - earlier`: what was counted since `earlier`.
    pub fn wrapping_sub(&self, earlier: &SeriesAgg) -> SeriesAgg {
        self.zip(earlier, u64::wrapping_sub, u32::wrapping_sub)
    }

    fn zip(&self, o: &SeriesAgg, f64_: fn(u64, u64) -> u64, f32_: fn(u32, u32) -> u32) -> SeriesAgg {
        let mut r = *self;
        r.requests = f64_(r.requests, o.requests);
        r.bytes = f64_(r.bytes, o.bytes);
        r.errors = f64_(r.errors, o.errors);
        r.qd_sum = f64_(r.qd_sum, o.qd_sum);
        r.qd_count = f64_(r.qd_count, o.qd_count);
        for (a, b) in r.stage_ns.iter_mut().zip(o.stage_ns) {
            *a = f64_(*a, b);
        }
        for (a, b) in r.qd.iter_mut().zip(o.qd) {
            *a = f32_(*a, b);
        }
        for (a, b) in r.paths.iter_mut().zip(o.paths) {
            *a = f32_(*a, b);
        }
        for (ha, hb) in r.hist.iter_mut().zip(o.hist) {
            for (a, b) in ha.iter_mut().zip(hb) {
                *a = f32_(*a, b);
            }
        }
        r
    }
}

/// How to find the device of a bio.
pub mod bio_dev_path {
    /// `bio->bi_bdev->bd_dev` (5.12 and later).
    pub const BDEV: u32 = 0;
    /// `MKDEV(bio->bi_disk->major, bio->bi_disk->first_minor + bio->bi_partno)` (before 5.12).
    pub const DISK_PARTNO: u32 = 1;
}

/// How to find the disk of a request.
pub mod rq_disk_path {
    /// `rq->q->disk` (5.17 and later).
    pub const QUEUE: u32 = 0;
    /// `rq->rq_disk` (before 5.17).
    pub const RQ_DISK: u32 = 1;
}

/// Offsets (bytes) into kernel structs, read from the running kernel's BTF at start-up and
/// written into the programs' read-only data before load. Never compiled-in constants.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelLayout {
    pub bio_dev_path: u32,
    pub bio_bi_bdev: u32,
    pub bio_bi_disk: u32,
    pub bio_bi_partno: u32,
    pub bio_bi_opf: u32,
    pub bio_bi_sector: u32,
    pub bio_bi_size: u32,
    pub bio_bi_private: u32,
    pub bio_bi_status: u32,
    pub bio_bi_next: u32,
    pub bdev_bd_dev: u32,
    pub rq_disk_path: u32,
    pub rq_q: u32,
    pub rq_rq_disk: u32,
    pub rq_bio: u32,
    pub rq_cmd_flags: u32,
    pub rq_data_len: u32,
    pub rq_sector: u32,
    pub queue_disk: u32,
    /// `struct blk_mq_queue_data.rq`: the request handed to a driver's queue_rq.
    pub queue_data_rq: u32,
    pub disk_major: u32,
    pub disk_first_minor: u32,
    /// `struct task_struct.comm`.
    pub task_comm: u32,
    /// `struct task_struct.pid` (the thread id) and the CPU it last ran on
    /// (`.thread_info.cpu` or `.cpu`); 0 unless causes are on.
    pub task_pid: u32,
    pub task_cpu: u32,
    /// `struct request.start_time_ns` and `.io_start_time_ns`; 0 where BTF lacks them.
    pub rq_start_time_ns: u32,
    pub rq_io_start_time_ns: u32,
    /// Non-zero when BTF has the blkcg chain below (CONFIG_BLK_CGROUP): a bio's cgroup is
    /// `bio->bi_blkg->blkcg->css.cgroup->kn->id`.
    pub bio_cgroup: u32,
    pub bio_bi_blkg: u32,
    pub blkg_blkcg: u32,
    /// `struct blkcg.css.cgroup` (css is embedded).
    pub blkcg_css_cgroup: u32,
    pub cgroup_kn: u32,
    pub kernfs_node_id: u32,
}

impl KernelLayout {
    pub const ZERO: KernelLayout = KernelLayout {
        bio_dev_path: 0,
        bio_bi_bdev: 0,
        bio_bi_disk: 0,
        bio_bi_partno: 0,
        bio_bi_opf: 0,
        bio_bi_sector: 0,
        bio_bi_size: 0,
        bio_bi_private: 0,
        bio_bi_status: 0,
        bio_bi_next: 0,
        bdev_bd_dev: 0,
        rq_disk_path: 0,
        rq_q: 0,
        rq_rq_disk: 0,
        rq_bio: 0,
        rq_cmd_flags: 0,
        rq_data_len: 0,
        rq_sector: 0,
        queue_disk: 0,
        queue_data_rq: 0,
        disk_major: 0,
        disk_first_minor: 0,
        task_comm: 0,
        task_pid: 0,
        task_cpu: 0,
        rq_start_time_ns: 0,
        rq_io_start_time_ns: 0,
        bio_cgroup: 0,
        bio_bi_blkg: 0,
        blkg_blkcg: 0,
        blkcg_css_cgroup: 0,
        cgroup_kn: 0,
        kernfs_node_id: 0,
    };
}

/// Map sizes; the daemon may override them at load time.
pub mod limits {
    /// The bar (`SLOW_NS`) each minute of the slowest-IO list starts with: IOs faster than this
    /// are never among the slowest kept. While a device's bar is here, its list is not full.
    pub const SLOW_FLOOR_NS: u64 = 10_000;
    /// Bio slots (Q until the request's first I/D, a merge, or completion): a few per IO in
    /// flight. A set's four ways all busy at once counts as `bio_map_full`.
    pub const BIO_SLOTS: u32 = 16_384;
    /// Request slots (first I/D until full completion): bounded by the sum of queue depths.
    pub const REQUEST_SLOTS: u32 = 16_384;
    /// Disks and partitions traced.
    pub const MAX_DEVICES: u32 = 4_096;
    /// Lower bios remapped and not yet queued: a few per in-flight stacked IO.
    pub const MAX_LINKS: u32 = 16_384;
    /// Tasks inside a stacked device's submit function at once.
    pub const MAX_SUBMITTERS: u32 = 4_096;
    /// Tasks asleep inside an IO's phase at once (`WAITERS`).
    pub const MAX_WAITERS: u32 = 8_192;
    /// Wakeups that came before their sleeper's sched_switch (`EARLY_WAKES`).
    pub const EARLY_WAKES: u32 = 1_024;
    /// Lower bios remapped and not yet queued, with `causes` on (`HANDOFFS`).
    pub const HANDOFFS: u32 = 16_384;
    /// Layers' threads woken for a hand-off and not yet through it (`WORKERS`).
    pub const WORKERS: u32 = 256;
    /// Distinct kernel stacks of sleepers and wakers (`STACKS`): about 1 KiB each.
    pub const STACKS: u32 = 2_048;
    /// Ring buffer bytes (a power of two, multiple of the page size).
    pub const RINGBUF_BYTES: u32 = 8 << 20;
    /// The fewest devices the kernel aggregates for (`agg`): a series per op each, given out
    /// to devices as they first do IO; further devices' IO goes as records. The loader sizes
    /// the map to the devices traced, from this up (`tracerd::kernel::series::capacity`).
    pub const SERIES_DEVICES: u32 = 32;
}

/// Names shared by the loader and the object: maps and the layout global.
pub mod names {
    pub const LAYOUT: &str = "LAYOUT";
    pub const EVENTS: &str = "EVENTS";
    pub const LOST: &str = "LOST";
    pub const BIOS: &str = "BIOS";
    pub const REQUESTS: &str = "REQUESTS";
    pub const DEVICES: &str = "DEVICES";
    pub const SETTINGS: &str = "SETTINGS";
    pub const SERIES: &str = "SERIES";
    pub const SERIES_OF: &str = "SERIES_OF";
    pub const CGROUP_SERIES: &str = "CGROUP_SERIES";
    pub const CGROUP_AGG: &str = "CGROUP_AGG";
    pub const STREAM: &str = "STREAM";
    pub const SLOW_NS: &str = "SLOW_NS";
    pub const STACK: &str = "STACK";
    pub const STACKS: &str = "STACKS";
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: plain-old-data #[repr(C)] structs without padding holes that matter to the kernel.
    unsafe impl aya::Pod for IoRecord {}
    unsafe impl aya::Pod for BioState {}
    unsafe impl aya::Pod for RequestState {}
    unsafe impl aya::Pod for DeviceState {}
    unsafe impl aya::Pod for KernelLayout {}
    unsafe impl aya::Pod for SubmitState {}
    unsafe impl aya::Pod for QosWait {}
    unsafe impl<V: aya::Pod> aya::Pod for Slot<V> {}
    unsafe impl aya::Pod for Settings {}
    unsafe impl aya::Pod for StackLayout {}
    unsafe impl aya::Pod for WaitRecord {}
    unsafe impl aya::Pod for AheadRecord {}
    unsafe impl aya::Pod for SeriesAgg {}
    unsafe impl aya::Pod for CgroupSeriesKey {}
}

// The reader tells wait records from IO records by length.
const _: () = assert!(size_of::<WaitRecord>() != size_of::<IoRecord>());
const _: () = assert!(size_of::<AheadRecord>() != size_of::<IoRecord>());
const _: () = assert!(size_of::<AheadRecord>() != size_of::<WaitRecord>());

#[cfg(test)]
mod tests {
    use super::agg::*;

    #[test]
    fn an_own_kind_this_build_does_not_know_counts_as_unstated() {
        use super::own;
        assert_eq!(own::index(own::SUPERBLOCK), 4);
        assert_eq!((own::index(7), own::index(255)), (0, 0));
        assert_eq!(own::name(own::DM_BUFIO), "dm_bufio");
        assert_eq!(own::name(7), own::name(own::UNSTATED));
    }

    #[test]
    fn bounds_are_r10_steps_with_every_prometheus_bound() {
        assert_eq!(BOUNDS_NS[..4], [100, 125, 160, 200]);
        for w in BOUNDS_NS.windows(2) {
            assert!(w[0] < w[1] && w[1] * 100 <= w[0] * 128, "{w:?}");
        }
        assert_eq!(BOUNDS_NS[87], 50_000_000_000);
        assert_eq!(BOUNDS_NS[88], 60_000_000_000);
        // 1-2-5 from 1 us to 50 s, then 60 s: the daemon's Prometheus buckets.
        for exp in 3..=10 {
            for m in [1, 2, 5] {
                let ns = m * 10u64.pow(exp);
                assert!(BOUNDS_NS.contains(&ns) || ns > 50_000_000_000, "{ns}");
            }
        }
    }

    #[test]
    fn bucket_of_is_the_first_bound_at_or_above() {
        for ns in (0..2000).chain([59_999_999_999, 60_000_000_000, 60_000_000_001, u64::MAX]) {
            let want = BOUNDS_NS.iter().position(|&b| ns <= b).unwrap_or(BOUNDS_NS.len());
            assert_eq!(bucket_of(ns), want, "{ns}");
        }
        for (i, &b) in BOUNDS_NS.iter().enumerate() {
            assert_eq!((bucket_of(b), bucket_of(b + 1)), (i, i + 1));
        }
    }

    #[test]
    fn qd_buckets_are_powers_of_two() {
        let got: [usize; 9] = [0, 1, 2, 3, 4, 5, 1024, 1025, u32::MAX].map(qd_bucket);
        assert_eq!(got, [0, 0, 1, 2, 2, 3, 10, 11, 11]);
    }
}
