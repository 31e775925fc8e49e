//! The kernel half of causes (config `causes`): which scheduler and interrupt hooks to attach
//! and whether this kernel can give them, and turning each `WaitRecord` into a
//! `model::causes::Wait`, its stacks named from `/proc/kallsyms`.

use std::collections::HashMap;

use aya::{
    Btf as AyaBtf, Ebpf,
    maps::{MapData, StackTraceMap},
    programs::BtfTracePoint,
};
use tracer_common::{WaitRecord, wait};

use crate::{
    kernel::btf::Btf,
    kernel::hooks::HookStatus,
    model::causes::{Phase, Wait, Waker, cause_of, summarise},
};

/// A tp_btf program and the tracepoint it hooks.
pub struct CauseHook {
    pub tracepoint: &'static str,
    program: &'static str,
}

/// The wait hooks, the scheduler's first: without them there is nothing to record.
pub const CAUSE_HOOKS: &[CauseHook] = &[
    CauseHook { tracepoint: "sched_switch", program: "btf_sched_switch" },
    CauseHook { tracepoint: "sched_waking", program: "btf_sched_waking" },
    CauseHook { tracepoint: "sched_wakeup", program: "btf_sched_wakeup" },
    // Each exit before its entry: an interrupt in progress while they are attached is then
    // left unseen (its exit finds level 0), never entered without an exit.
    CauseHook { tracepoint: "irq_handler_exit", program: "btf_irq_exit" },
    CauseHook { tracepoint: "irq_handler_entry", program: "btf_irq_entry" },
    CauseHook { tracepoint: "softirq_exit", program: "btf_softirq_exit" },
    CauseHook { tracepoint: "softirq_entry", program: "btf_softirq_entry" },
];

/// The `task_struct` offsets the wait hooks read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskLayout {
    pub pid: u32,
    /// The CPU it last ran on: `thread_info.cpu` (x86 since 5.16) or `cpu`.
    pub cpu: u32,
}

/// `task_struct`'s offsets, or why causes cannot be recorded on this kernel: the programs need
/// tp_btf (BTF for aya), `sched_switch` with `prev_state` as its last argument (5.18 and later)
/// and `sched_waking` and `sched_wakeup` with the task first.
pub fn detect(btf: &Btf, aya_btf: bool) -> Result<TaskLayout, String> {
    if !aya_btf {
        return Err("causes need tp_btf programs, and aya could not read this kernel's BTF".into());
    }
    let switch = btf
        .tracepoint_args("sched_switch")
        .ok_or_else(|| "causes need the sched_switch tracepoint, which this kernel lacks".to_string())?;
    let task = |a: Option<&String>| a.is_some_and(|s| s == "task_struct");
    if switch.len() != 4 || !task(switch.get(1)) || !task(switch.get(2)) {
        return Err(format!(
            "causes need sched_switch(preempt, prev, next, prev_state) (kernel 5.18 or later); this \
             kernel's has {} arguments",
            switch.len()
        ));
    }
    let waking = btf.tracepoint_args("sched_waking").unwrap_or_default();
    if !task(waking.first()) {
        return Err("causes need the sched_waking tracepoint with the woken task".into());
    }
    let wakeup = btf.tracepoint_args("sched_wakeup").unwrap_or_default();
    if !task(wakeup.first()) {
        return Err("causes need the sched_wakeup tracepoint with the woken task".into());
    }
    let member = |path: &[&str]| btf.member_offset("task_struct", path);
    let need = |what: &str, e| format!("causes need task_struct.{what}: {e}");
    Ok(TaskLayout {
        pid: member(&["pid"]).map_err(|e| need("pid", e))?,
        cpu: member(&["thread_info", "cpu"]).or_else(|_| member(&["cpu"])).map_err(|e| need("cpu", e))?,
    })
}

impl CauseHook {
    pub fn skipped(&self, reason: String) -> HookStatus {
        HookStatus { hook: self.tracepoint, attach_type: None, program: None, reason: Some(reason) }
    }

    pub fn attach(&self, ebpf: &mut Ebpf, btf: &AyaBtf) -> HookStatus {
        let attached = (|| -> Result<(), String> {
            let prog = ebpf.program_mut(self.program).ok_or_else(|| format!("{} missing", self.program))?;
            let prog: &mut BtfTracePoint = prog.try_into().map_err(|e| format!("{e}"))?;
            prog.load(self.tracepoint, btf).map_err(|e| format!("{e:#}"))?;
            prog.attach().map_err(|e| format!("{e:#}"))?;
            Ok(())
        })();
        match attached {
            Ok(()) => HookStatus {
                hook: self.tracepoint,
                attach_type: Some("tp_btf"),
                program: Some(self.program.into()),
                reason: None,
            },
            Err(e) => self.skipped(format!("tp_btf failed: {e}")),
        }
    }
}

/// Kernel text symbols, sorted by address, for naming stack frames.
pub struct Ksyms {
    symbols: Vec<(u64, String)>,
}

impl Ksyms {
    /// `/proc/kallsyms`; None where its addresses are hidden (no root, kptr_restrict).
    pub fn load() -> Option<Ksyms> {
        Ksyms::parse(&std::fs::read_to_string("/proc/kallsyms").ok()?)
    }

    pub fn parse(text: &str) -> Option<Ksyms> {
        let mut symbols: Vec<(u64, String)> = text
            .lines()
            .filter_map(|line| {
                let mut f = line.split_whitespace();
                let (addr, kind, name) = (f.next()?, f.next()?, f.next()?);
                matches!(kind, "t" | "T" | "w" | "W")
                    .then(|| Some((u64::from_str_radix(addr, 16).ok()?, name.to_owned())))?
            })
            .filter(|(addr, _)| *addr != 0)
            .collect();
        if symbols.is_empty() {
            return None;
        }
        symbols.sort_unstable();
        Some(Ksyms { symbols })
    }

    /// The function holding `addr`: the last symbol at or below it.
    pub fn name(&self, addr: u64) -> Option<&str> {
        let i = self.symbols.partition_point(|(a, _)| *a <= addr);
        (i > 0).then(|| self.symbols[i - 1].1.as_str())
    }
}

/// Turns wait records into waits: reads their stacks from `STACKS` and names them. A stack id
/// always names the same stack (the map's entries are never reused), so names are cached.
pub struct WaitReader {
    stacks: StackTraceMap<MapData>,
    ksyms: Option<Ksyms>,
    named: HashMap<i32, Vec<String>>,
}

impl WaitReader {
    pub fn new(stacks: StackTraceMap<MapData>) -> WaitReader {
        let ksyms = Ksyms::load();
        if ksyms.is_none() {
            tracing::warn!("/proc/kallsyms hides its addresses: waits are recorded, their stacks unnamed");
        }
        WaitReader { stacks, ksyms, named: HashMap::new() }
    }

    /// The stack's frames as names, innermost first (`0x...` where a symbol is unknown).
    fn frames(&mut self, id: i32) -> &[String] {
        if id < 0 {
            return &[];
        }
        let (stacks, ksyms) = (&self.stacks, &self.ksyms);
        self.named.entry(id).or_insert_with(|| {
            let Ok(trace) = stacks.get(&(id as u32), 0) else { return Vec::new() };
            trace
                .frames()
                .iter()
                .map(|f| match ksyms.as_ref().and_then(|k| k.name(f.ip)) {
                    Some(name) => name.to_owned(),
                    None => format!("{:#x}", f.ip),
                })
                .collect()
        })
    }

    pub fn read(&mut self, rec: &WaitRecord) -> Option<Wait> {
        let phase = Phase::from_kernel(rec.phase)?;
        // Woken at a hand-off: runnable from then until it ran, like a preempted task.
        let preempted = rec.state == wait::PREEMPTED || rec.state == wait::WOKEN;
        let frames = self.frames(rec.stack).to_vec();
        let function = summarise(frames.iter().map(String::as_str)).map(str::to_owned);
        let cause = cause_of(phase, preempted, function.as_deref());
        let waker_function =
            summarise(self.frames(rec.waker_stack).iter().map(String::as_str)).map(str::to_owned);
        let waker = match rec.waker {
            wait::WAKER_IO => {
                Waker::Io { disk: rec.waker_disk, id: rec.waker_io, completed_ns: rec.waker_io_done_ns }
            }
            wait::WAKER_TASK => {
                Waker::Task { tid: rec.waker_tid, comm: comm(&rec.waker_comm), function: waker_function }
            }
            wait::WAKER_INTERRUPT => Waker::Interrupt { function: waker_function },
            wait::WAKER_PREEMPTED => Waker::Preempted { tid: rec.waker_tid, comm: comm(&rec.waker_comm) },
            _ => Waker::None,
        };
        Some(Wait {
            dev: rec.dev,
            queued_ns: rec.queued_ns,
            phase,
            cause,
            stack: if cause == crate::model::causes::Cause::Other { frames } else { Vec::new() },
            function,
            tid: rec.tid,
            slept_ns: rec.slept_ns,
            woken_ns: (rec.woken_ns != 0).then_some(rec.woken_ns),
            ran_ns: rec.ran_ns,
            waker,
            thread: Vec::new(),
        })
    }
}

fn comm(bytes: &[u8; 16]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_name_the_function_that_holds_them() {
        let k = Ksyms::parse(
            "ffffffff81000000 T _stext\nffffffff81100000 t blk_mq_get_tag\nffffffff81100400 T \
             blk_mq_submit_bio\nffffffff81200000 d some_data\nffffffffc0001000 t md_write_start\t[md_mod]\n",
        )
        .unwrap();
        assert_eq!(k.name(0xffffffff81100010), Some("blk_mq_get_tag"));
        assert_eq!(k.name(0xffffffff81100400), Some("blk_mq_submit_bio"));
        assert_eq!(k.name(0xffffffffc0001234), Some("md_write_start"), "module symbols too");
        assert_eq!(k.name(0x1000), None, "below every symbol");
    }

    #[test]
    fn hidden_addresses_give_no_symbols() {
        assert!(Ksyms::parse("0000000000000000 T _stext\n0000000000000000 t schedule\n").is_none());
    }
}
