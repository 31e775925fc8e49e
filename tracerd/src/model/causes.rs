//! Why an IO waited: each sleep of a task inside the IO's phase (`tracer_common::WaitRecord`),
//! its kernel stack summarised to the function that waited, the cause that function names, and
//! what ended the wait (an IO's completion, a task, an interrupt). See docs/guide/causes.md.

use serde::{Deserialize, Serialize};
use tracer_common::wait;

/// The fixed set of causes a wait is named by (a bounded label: `other` for the rest).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// Every tag (request slot) of the hardware queue was in use: `blk_mq_get_tag`.
    Tag,
    /// The queue was frozen (a scheduler or limits change, a resize): `blk_queue_enter`.
    QueueFrozen,
    /// An rq-qos policy held the bio (wbt, io.latency, io.cost): `rq_qos_wait`.
    RqQos,
    /// md marked the array dirty and waited for its superblock writes: `md_write_start`.
    MdSuperblock,
    /// raid1/raid10 waited for a resync or array barrier: `wait_barrier`.
    MdBarrier,
    /// A journal commit (jbd2) had to finish first: `jbd2_log_wait_commit`.
    JournalCommit,
    /// The layer handed the lower IO to its own thread (md raid1's `mdX_raid1`), which sent it:
    /// the time from the hand-off to that thread's Q of it.
    LayerThread,
    /// md wrote its write-intent bitmap before the member writes it covers: `bitmap_unplug`.
    MdBitmap,
    /// The task was preempted: runnable, waiting for a CPU.
    Cpu,
    /// A sleep whose function is none of the above (its stack is kept whole).
    Other,
}

impl Cause {
    /// Every cause; a cause's place here is its code in the recorder's frames, so a new one
    /// goes last.
    pub const ALL: [Cause; 10] = [
        Cause::Tag,
        Cause::QueueFrozen,
        Cause::RqQos,
        Cause::MdSuperblock,
        Cause::MdBarrier,
        Cause::JournalCommit,
        Cause::Cpu,
        Cause::Other,
        Cause::LayerThread,
        Cause::MdBitmap,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Cause::Tag => "tag",
            Cause::QueueFrozen => "queue_frozen",
            Cause::RqQos => "rq_qos",
            Cause::MdSuperblock => "md_superblock",
            Cause::MdBarrier => "md_barrier",
            Cause::JournalCommit => "journal_commit",
            Cause::LayerThread => "layer_thread",
            Cause::MdBitmap => "md_bitmap",
            Cause::Cpu => "cpu",
            Cause::Other => "other",
        }
    }

    /// The cause a summarised waiting function names.
    pub fn of_function(function: &str) -> Cause {
        match function {
            "blk_mq_get_tag" => Cause::Tag,
            "blk_queue_enter" | "bio_queue_enter" | "__bio_queue_enter" => Cause::QueueFrozen,
            "rq_qos_wait" | "wbt_wait" | "__wbt_wait" | "blkcg_iolatency_throttle" | "ioc_rqos_throttle" => {
                Cause::RqQos
            }
            "md_write_start" | "md_update_sb" => Cause::MdSuperblock,
            "bitmap_unplug"
            | "__bitmap_unplug"
            | "bitmap_unplug_async"
            | "md_bitmap_unplug"
            | "md_bitmap_unplug_async"
            | "md_bitmap_wait_writes"
            | "bitmap_wait_writes"
            | "bitmap_startwrite"
            | "md_bitmap_startwrite" => Cause::MdBitmap,
            "wait_barrier" | "_wait_barrier" | "wait_read_barrier" => Cause::MdBarrier,
            "jbd2_log_wait_commit" => Cause::JournalCommit,
            _ => Cause::Other,
        }
    }
}

/// Where in the IO's life the wait fell (`tracer_common::wait` phases).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The submitter between Q and G (part of Q2G).
    Q2g,
    /// A stacked device's submission, from Q until its submit function returned (part of the
    /// device's `layer` time).
    Submit,
    /// After the submit function handed a lower IO to the layer's own thread, until that thread
    /// queued it (part of the device's `layer` time).
    Handoff,
    /// The layer's thread inside a hand-off: its own waits, listed in the hand-off's `thread`
    /// (never an IO's wait of its own, nor counted in the totals).
    Thread,
}

impl Phase {
    /// Every phase; a phase's place here is its code in the recorder's frames.
    pub const ALL: [Phase; 4] = [Phase::Q2g, Phase::Submit, Phase::Handoff, Phase::Thread];

    pub fn from_kernel(phase: u8) -> Option<Phase> {
        match phase {
            wait::Q2G => Some(Phase::Q2g),
            wait::SUBMIT => Some(Phase::Submit),
            wait::HANDOFF => Some(Phase::Handoff),
            wait::THREAD => Some(Phase::Thread),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Phase::Q2g => "q2g",
            Phase::Submit => "submit",
            Phase::Handoff => "handoff",
            Phase::Thread => "thread",
        }
    }
}

/// What ended a wait: an edge of the wait-for graph, as the kernel saw it at the wakeup.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Waker {
    /// The completion of this IO woke it: `id` and `completed_ns` are its record's `id` and
    /// C stamp; `disk` its whole disk (0: a device tracerd does not trace).
    Io { disk: u32, id: u64, completed_ns: u64 },
    /// A task woke it, outside any IO completion.
    Task { tid: u32, comm: String, function: Option<String> },
    /// An interrupt completing no IO woke it (a timer, another device).
    Interrupt { function: Option<String> },
    /// It was preempted, not asleep: the task the scheduler ran in its place.
    Preempted { tid: u32, comm: String },
    /// It ran again with no wakeup seen.
    None,
}

/// One wait of a task inside an IO's phase.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Wait {
    /// The IO it belongs to: the device its bio was queued on and the bio's Q stamp.
    #[serde(skip)]
    pub dev: u32,
    #[serde(skip)]
    pub queued_ns: u64,
    pub phase: Phase,
    pub cause: Cause,
    /// The first function outside the scheduler and wait primitives (`blk_mq_get_tag`).
    pub function: Option<String>,
    /// The whole stack, innermost first, where the summary names no known cause.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stack: Vec<String>,
    pub tid: u32,
    /// Left the CPU, woken (None: no wakeup seen), ran again: kernel clock (ns).
    pub slept_ns: u64,
    pub woken_ns: Option<u64>,
    pub ran_ns: u64,
    pub waker: Waker,
    /// A hand-off's: the waits of the layer's thread inside it (woken for it, then its own
    /// sleeps until it queued the lower IO), oldest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub thread: Vec<Wait>,
}

impl Wait {
    /// Off-CPU time: left the CPU to ran again.
    pub fn waited_ns(&self) -> u64 {
        self.ran_ns.saturating_sub(self.slept_ns)
    }
}

/// An IO's time by cause. A task that waits for one thing often sleeps several times in a row
/// (woken with other waiters, it finds no tag left and sleeps again): consecutive waits of one
/// phase and cause count from the first sleep to the last time it ran again, the time it ran in
/// between being the kernel's wait loop. Another cause, or another phase, starts a new span.
pub fn time_by_cause(waits: &[Wait]) -> std::collections::BTreeMap<Cause, u64> {
    let mut out = std::collections::BTreeMap::new();
    let mut i = 0;
    while i < waits.len() {
        let first = &waits[i];
        let mut j = i;
        while j + 1 < waits.len() && (waits[j + 1].phase, waits[j + 1].cause) == (first.phase, first.cause) {
            j += 1;
        }
        *out.entry(first.cause).or_default() += waits[j].ran_ns.saturating_sub(first.slept_ns);
        i = j + 1;
    }
    out
}

/// Waits of one kind counted together: how many, and their off-CPU time (ns).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WaitSum {
    pub waits: u64,
    pub ns: u64,
}

impl WaitSum {
    pub fn add(&mut self, other: WaitSum) {
        self.waits += other.waits;
        self.ns += other.ns;
    }
}

/// Waits counted per (traced device, op, phase, cause). Bounded by the traced devices: ops,
/// phases and causes are fixed sets.
pub type WaitTotals = std::collections::BTreeMap<(u32, crate::model::op::Op, Phase, Cause), WaitSum>;

/// Waits read before their IO's record (a wait ends before its IO completes), until that record
/// comes. An IO the kernel counts without a record (the agent's in-kernel aggregation) never
/// comes: its waits are dropped once older than [`PendingWaits::KEEP_NS`].
#[derive(Default)]
pub struct PendingWaits {
    /// By (the IO's Q stamp, its device): oldest first.
    by_io: std::collections::BTreeMap<(u64, u32), Vec<Wait>>,
}

impl PendingWaits {
    /// How long a wait waits for its IO's record (kernel clock).
    pub const KEEP_NS: u64 = 30_000_000_000;

    pub fn add(&mut self, wait: Wait) {
        self.by_io.entry((wait.queued_ns, wait.dev)).or_default().push(wait);
    }

    /// The waits of the IO queued on `dev` at `queued_ns`, taken.
    pub fn take(&mut self, dev: u32, queued_ns: u64) -> Vec<Wait> {
        if queued_ns == 0 {
            return Vec::new();
        }
        self.by_io.remove(&(queued_ns, dev)).unwrap_or_default()
    }

    /// Drops the waits of IOs queued more than `KEEP_NS` before `now_ns`.
    pub fn expire(&mut self, now_ns: u64) {
        let keep = self.by_io.split_off(&(now_ns.saturating_sub(Self::KEEP_NS), 0));
        self.by_io = keep;
    }

    pub fn len(&self) -> usize {
        self.by_io.values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.by_io.is_empty()
    }
}

/// The recent waits of layers' threads ([`Phase::Thread`]), by thread id, until the hand-offs
/// they fall in are read: a hand-off's record comes when the thread queues the lower IO, after
/// its waits. One thread sleep can serve several hand-offs (md's thread sends both members of a
/// write, and the writes of several submitters, in one pass): each gets it.
#[derive(Default)]
pub struct ThreadWaits {
    by_tid: std::collections::HashMap<u32, std::collections::VecDeque<Wait>>,
}

impl ThreadWaits {
    /// Waits kept per thread: one hand-off's are a few; more is a thread that sleeps often
    /// while it works for hand-offs, and its oldest go.
    const PER_THREAD: usize = 256;

    pub fn add(&mut self, wait: Wait) {
        let waits = self.by_tid.entry(wait.tid).or_default();
        if waits.len() == Self::PER_THREAD {
            waits.pop_front();
        }
        waits.push_back(wait);
    }

    /// The waits of thread `tid` that overlap `from_ns..to_ns`: a hand-off's all lie inside it;
    /// the thread a submitter waits for was woken (its first wait) before the submitter slept.
    pub fn within(&self, tid: u32, from_ns: u64, to_ns: u64) -> Vec<Wait> {
        self.by_tid.get(&tid).map_or_else(Vec::new, |waits| {
            waits.iter().filter(|w| w.slept_ns < to_ns && w.ran_ns > from_ns).cloned().collect()
        })
    }

    /// Drops the waits that ended more than [`PendingWaits::KEEP_NS`] before `now_ns`.
    pub fn expire(&mut self, now_ns: u64) {
        let oldest = now_ns.saturating_sub(PendingWaits::KEEP_NS);
        self.by_tid.retain(|_, waits| {
            waits.retain(|w| w.ran_ns >= oldest);
            !waits.is_empty()
        });
    }
}

/// Frames that are the scheduler, a wait primitive or tracerd's own hook: skipped to find the
/// function that waited. Prefixes of kernel function names.
const WAIT_PRIMITIVES: &[&str] = &[
    "bpf_",
    "__bpf_",
    "__traceiter_",
    "trace_",
    "__schedule",
    "schedule",
    "preempt_schedule",
    "io_schedule",
    "blk_io_schedule",
    "__cond_resched",
    "_cond_resched",
    "__wait_",
    "wait_for_completion",
    "__wait_for_common",
    "do_wait_for_common",
    "wait_woken",
    "prepare_to_wait",
    "finish_wait",
    "bit_wait",
    "__wait_on_bit",
    "out_of_line_wait_on_bit",
    "__mutex_lock",
    "mutex_lock",
    "rwsem_down",
    "down_read",
    "down_write",
    "__down",
    "rt_mutex",
    "__rt_mutex",
    "rtlock",
    "rt_spin_lock",
    "percpu_rwsem_wait",
    "__percpu_down",
    // md's wait for its own metadata writes: the caller says which (superblock or bitmap).
    "md_super_wait",
    "usleep_range",
    "msleep",
    "do_nanosleep",
    "hrtimer_nanosleep",
];

/// A kernel symbol without the compiler's clone suffix (`.isra.0`, `.constprop.0`, `.cold`).
pub fn base_name(symbol: &str) -> &str {
    symbol.split('.').next().unwrap_or(symbol)
}

/// The function that waited: the first frame (innermost first) that is not a wait primitive.
pub fn summarise<'a>(frames: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    frames.into_iter().map(base_name).find(|f| !WAIT_PRIMITIVES.iter().any(|p| f.starts_with(p)))
}

/// The cause of a wait from its phase, whether it was runnable all along (preempted, or woken
/// at a hand-off until it ran) and its summarised function.
pub fn cause_of(phase: Phase, preempted: bool, function: Option<&str>) -> Cause {
    if phase == Phase::Handoff {
        return Cause::LayerThread;
    }
    if preempted {
        return Cause::Cpu;
    }
    function.map_or(Cause::Other, Cause::of_function)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_wait_is_named_past_the_scheduler_and_the_hook() {
        // The stack a submitter has in sched_switch while it waits for a tag (6.18).
        let frames = [
            "bpf_prog_6deef7357e7b4530_btf_sched_switch",
            "bpf_trace_run4",
            "__bpf_trace_sched_switch",
            "__traceiter_sched_switch",
            "__schedule",
            "schedule",
            "io_schedule",
            "blk_mq_get_tag",
            "__blk_mq_alloc_requests",
            "blk_mq_submit_bio",
            "__submit_bio",
        ];
        let f = summarise(frames);
        assert_eq!(f, Some("blk_mq_get_tag"));
        assert_eq!(cause_of(Phase::Q2g, false, f), Cause::Tag);
        assert_eq!(cause_of(Phase::Q2g, true, f), Cause::Cpu, "preempted is the CPU, whatever the stack");
    }

    #[test]
    fn clone_suffixes_are_dropped_and_unknown_functions_are_other() {
        assert_eq!(summarise(["schedule", "md_write_start.part.0", "md_submit_bio"]), Some("md_write_start"));
        assert_eq!(cause_of(Phase::Q2g, false, Some("md_write_start")), Cause::MdSuperblock);
        assert_eq!(summarise(["schedule", "_wait_barrier", "wait_barrier"]), Some("_wait_barrier"));
        assert_eq!(cause_of(Phase::Q2g, false, Some("_wait_barrier")), Cause::MdBarrier);
        assert_eq!(cause_of(Phase::Q2g, false, Some("folio_wait_bit_common")), Cause::Other);
        let bitmap = ["schedule", "md_super_wait", "__bitmap_unplug", "md_bitmap_unplug_fn"];
        assert_eq!(cause_of(Phase::Thread, false, summarise(bitmap)), Cause::MdBitmap);
        let superblock = ["schedule", "md_super_wait", "md_update_sb.part.0", "md_check_recovery"];
        assert_eq!(cause_of(Phase::Thread, false, summarise(superblock)), Cause::MdSuperblock);
        assert_eq!(summarise(["schedule", "io_schedule"]), None, "nothing but primitives");
        assert_eq!(cause_of(Phase::Q2g, false, None), Cause::Other);
    }

    #[test]
    fn a_hand_off_is_the_layer_thread_whatever_its_state() {
        assert_eq!(cause_of(Phase::Handoff, false, None), Cause::LayerThread);
        assert_eq!(cause_of(Phase::Handoff, true, Some("md_write_start")), Cause::LayerThread);
        assert_eq!(Phase::from_kernel(wait::HANDOFF), Some(Phase::Handoff));
    }

    fn wait(dev: u32, queued_ns: u64) -> Wait {
        Wait {
            dev,
            queued_ns,
            phase: Phase::Q2g,
            cause: Cause::Tag,
            function: Some("blk_mq_get_tag".into()),
            stack: Vec::new(),
            tid: 7,
            slept_ns: queued_ns + 10,
            woken_ns: Some(queued_ns + 50),
            ran_ns: queued_ns + 60,
            waker: Waker::Io { disk: dev, id: 0xffff_8880_0000_1000, completed_ns: queued_ns + 49 },
            thread: Vec::new(),
        }
    }

    #[test]
    fn pending_waits_go_to_their_io_once_and_expire() {
        let mut p = PendingWaits::default();
        p.add(wait(7, 1_000));
        p.add(wait(7, 1_000));
        p.add(wait(8, 1_000));
        p.add(wait(7, 2_000));
        assert_eq!(p.take(7, 1_000).len(), 2);
        assert!(p.take(7, 1_000).is_empty(), "taken once");
        assert!(p.take(7, 0).is_empty(), "an IO without Q has none");
        assert_eq!(p.len(), 2);
        p.expire(PendingWaits::KEEP_NS + 1_500);
        assert_eq!(p.len(), 1, "the wait of the IO queued at 1000 expired");
        assert_eq!(p.take(7, 2_000)[0].waited_ns(), 50);
        assert!(p.is_empty());
    }

    #[test]
    fn a_threads_waits_go_to_every_wait_they_overlap_and_expire() {
        let at = |tid, slept_ns, ran_ns| Wait { tid, slept_ns, ran_ns, phase: Phase::Thread, ..wait(0, 0) };
        let mut t = ThreadWaits::default();
        t.add(at(5, 100, 150));
        t.add(at(5, 160, 200));
        t.add(at(6, 120, 130));
        assert_eq!(t.within(5, 90, 210).len(), 2);
        assert_eq!(t.within(5, 90, 210).len(), 2, "shared by every wait they fall in");
        assert_eq!(t.within(5, 110, 210).len(), 2, "one that began before the wait overlaps it");
        assert_eq!(t.within(5, 150, 160).len(), 0, "the gap between them overlaps neither");
        assert_eq!(t.within(5, 201, 300).len(), 0, "nor does a window after both");
        assert!(t.within(7, 0, u64::MAX).is_empty());
        for i in 0..300 {
            t.add(at(8, 1_000 + i, 1_001 + i));
        }
        assert_eq!(t.within(8, 0, u64::MAX).len(), ThreadWaits::PER_THREAD, "bounded per thread");
        t.expire(PendingWaits::KEEP_NS + 175);
        assert_eq!(t.within(5, 0, u64::MAX).len(), 1, "the wait that ended at 150 expired");
        assert!(t.within(6, 0, u64::MAX).is_empty());
    }

    #[test]
    fn repeated_sleeps_of_one_cause_span_from_the_first_to_the_last() {
        let at = |slept_ns, ran_ns, cause| Wait { slept_ns, ran_ns, cause, ..wait(7, 0) };
        let waits = [
            at(100, 150, Cause::Tag),
            at(160, 200, Cause::Tag),
            at(210, 230, Cause::Cpu),
            at(240, 300, Cause::Tag),
        ];
        let by = time_by_cause(&waits);
        assert_eq!(by[&Cause::Tag], 100 + 60, "the run between the first two is the wait loop's");
        assert_eq!(by[&Cause::Cpu], 20);
        assert!(time_by_cause(&[]).is_empty());
    }

    #[test]
    fn cause_names_are_distinct_and_snake_case() {
        let names: std::collections::BTreeSet<&str> = Cause::ALL.iter().map(|c| c.name()).collect();
        assert_eq!(names.len(), Cause::ALL.len());
        for c in Cause::ALL {
            assert_eq!(serde_json::to_value(c).unwrap(), c.name());
        }
    }
}
