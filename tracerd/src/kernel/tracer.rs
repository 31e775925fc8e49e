//! Loading tracerd's kernel programs into the running kernel: checks first (privileges, BTF),
//! then the struct layout from BTF, then every hook. Dropping the `Tracer` detaches everything.

use std::{
    collections::HashSet,
    os::fd::{AsFd, AsRawFd, BorrowedFd},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use aya::{
    Btf as AyaBtf, Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, RingBuf, StackTraceMap},
};
use tracer_common::{
    BioState, CgroupSeriesKey, DeviceState, RequestState, Settings, Slot, StackLayout, agg, bio_based,
    limits, lost, names,
};

use crate::{
    kernel::btf::{Btf, VMLINUX},
    kernel::causes::{self, CAUSE_HOOKS},
    kernel::cgroup_series::{self, CgroupOf, CgroupSeriesTable},
    kernel::hooks::{
        HOOKS, HookStatus, KPROBES, RQ_QOS, RQ_QOS_CALLBACKS, THROTTLE, kallsyms_addresses,
        kprobes_available, load_kprobe_programs, throttle_unavailable,
    },
    kernel::layout,
    kernel::series::{self, DeviceIndex, SeriesTable},
    kernel::slot_view::SlotView,
    kernel::stacking::{self, Chain, ChainState},
    model::op::OpDecoder,
    model::topology::{Device, Topology},
};

static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("TRACERD_EBPF_OBJECT"));

/// Options that change what is loaded.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Ring buffer size in bytes (power of two); None keeps the built-in size.
    pub ring_buffer_bytes: Option<u32>,
    /// Every block device is traced (no --device): the kernel skips its device filter.
    pub all_devices: bool,
    /// Where completed IO is aggregated.
    pub aggregation: Aggregation,
    /// How the tracepoint hooks attach.
    pub attach: Attach,
    /// Load no kprobes (config `kprobes = false`, `--no-kprobes`).
    pub no_kprobes: bool,
    /// Time rq-qos waits inside Q2G (config `rq_qos`; kprobes on every tracked bio).
    pub rq_qos: bool,
    /// Record waits inside IO phases (config `causes`; the scheduler and interrupt hooks).
    pub causes: bool,
    /// Tracepoints not to attach (config `skip_hooks`; never a required one).
    pub skip_hooks: Vec<String>,
    /// Devices traced at start, which the in-kernel series are sized for ([`series::capacity`]).
    pub targets: usize,
    /// Series are labelled by cgroup (config `[cgroups] label`): the kernel keeps
    /// (cgroup, device, op) series.
    pub cgroups: bool,
    /// A per-cgroup series with no IO for this long gives its place back.
    pub cgroup_idle: Duration,
}

/// How the tracepoint hooks attach (`--attach`, config `attach`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Attach {
    /// tp_btf (typed arguments, cheapest), falling back to raw_tp per hook where it fails.
    #[default]
    Auto,
    /// raw_tp only: the fallback path, for a kernel whose tp_btf misbehaves, and for testing it.
    #[value(name = "raw_tp")]
    RawTp,
}

/// Where completed reads and writes are counted (`run --aggregation`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Aggregation {
    /// Every IO crosses the ring buffer as a record (report, snoop).
    #[default]
    Records,
    /// In the kernel, per CPU, for devices with a series; the rest as records.
    Kernel,
    /// Both, and the daemon checks one against the other on exit (a test of the kernel side).
    Check,
}

impl Aggregation {
    fn mode(self) -> u32 {
        match self {
            Aggregation::Records => agg::mode::RECORDS,
            Aggregation::Kernel => agg::mode::KERNEL,
            Aggregation::Check => agg::mode::CHECK,
        }
    }
}

pub struct Tracer {
    ebpf: Ebpf,
    /// Tracepoints, then kprobes (in `KPROBES` order), then `THROTTLE`.
    pub hooks: Vec<HookStatus>,
    pub ops: OpDecoder,
    /// Whether the kprobe programs are loaded (kprobes exist here).
    kprobes_loaded: bool,
    /// Indices of the traced devices (`DeviceState::index`).
    indices: DeviceIndex,
    /// The in-kernel aggregation's series, given out to devices.
    pub series: SeriesTable,
    /// Its per-cgroup series, given out to (cgroup, device, op) keys (labels on).
    pub cgroup_series: CgroupSeriesTable,
    /// How lower IOs of stacked devices are linked (module BTF chains), as last resolved.
    pub chains: Vec<Chain>,
    /// What the programs were last told of stacking (the `STACK` map's one entry).
    stack: StackLayout,
    /// The in-flight tables, mapped for scans.
    bio_slots: SlotView<BioState>,
    request_slots: SlotView<RequestState>,
}

pub const CAP_SYS_ADMIN: u32 = 21;
pub const CAP_PERFMON: u32 = 38;
pub const CAP_BPF: u32 = 39;

/// Effective capabilities of this process (a bit per capability number).
pub fn effective_caps() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0)
}

/// Whether these capabilities let tracerd load and attach its programs.
pub fn can_load(caps: u64) -> bool {
    let has = |cap: u32| caps & (1 << cap) != 0;
    has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON))
}

/// What these capabilities lack for loading and attaching tracerd's programs, or `None`.
pub fn missing_caps(caps: u64) -> Option<&'static str> {
    let has = |cap: u32| caps & (1 << cap) != 0;
    if can_load(caps) {
        return None;
    }
    Some(match (has(CAP_BPF), has(CAP_PERFMON)) {
        (true, false) => "CAP_PERFMON (CAP_BPF alone cannot attach tracing programs)",
        (false, true) => "CAP_BPF (CAP_PERFMON alone cannot load programs)",
        _ => "CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN)",
    })
}

/// Fails early, with advice, where loading cannot work.
pub fn preflight() -> Result<()> {
    if let Some(missing) = missing_caps(effective_caps()) {
        bail!(
            "tracerd lacks {missing} to load its kernel programs. Run it as root (sudo tracerd ...) \
             or grant them: sudo setcap cap_bpf,cap_perfmon+ep $(command -v tracerd)"
        );
    }
    if !std::path::Path::new(VMLINUX).exists() {
        bail!(
            "this kernel exposes no BTF ({VMLINUX} is missing). tracerd reads struct layouts \
             from BTF: use a kernel built with CONFIG_DEBUG_INFO_BTF=y (most distribution kernels \
             since 5.4 are)."
        );
    }
    raise_memlock();
    Ok(())
}

/// Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK; later ones do not need this.
pub(crate) fn raise_memlock() {
    let unlimited = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: plain syscall with a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } != 0 {
        tracing::debug!(
            "could not raise RLIMIT_MEMLOCK ({}); not needed on kernels >= 5.11",
            std::io::Error::last_os_error()
        );
    }
}

/// Records per CPU between wakeups: all CPUs together wake the reader by the time a quarter
/// of the ring buffer is in use, whichever CPUs produce.
fn wakeup_records(ring_bytes: u32) -> u32 {
    // Each record carries an 8-byte ring buffer header.
    let record = std::mem::size_of::<tracer_common::IoRecord>() as u32 + 8;
    // SAFETY: plain sysconf query.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) }.max(1) as u32;
    (ring_bytes / 4 / record / cpus).max(1)
}

/// Kernel release (`uname -r`).
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "unknown".into(), |s| s.trim().into())
}

impl Tracer {
    pub fn load(opts: &LoadOptions) -> Result<Tracer> {
        preflight()?;
        let btf = Btf::from_sys_fs().with_context(|| format!("cannot read kernel BTF from {VMLINUX}"))?;
        let release = kernel_release();
        let mut layout = layout::resolve(&btf, &release)?;
        tracing::debug!("kernel {release}: {}", layout::describe(&layout));
        let ops = crate::kernel::ops::op_decoder(&btf)?;
        let aya_btf = AyaBtf::from_sys_fs().ok();
        // Causes where asked for and this kernel can give them; else said why, once, below.
        let causes = match opts.causes {
            true => causes::detect(&btf, aya_btf.is_some()),
            false => Err(String::new()),
        };
        if let Ok(task) = causes {
            (layout.task_pid, layout.task_cpu) = (task.pid, task.cpu);
        }
        let ring_bytes = opts.ring_buffer_bytes.unwrap_or(limits::RINGBUF_BYTES);
        let (op_mask, op_read, op_write) = ops.kernel_numbers();
        // Hidden (0) without root or under kptr_restrict: the waits are then named rq_qos.
        let qos_callbacks = match opts.rq_qos {
            true => std::fs::read_to_string("/proc/kallsyms")
                .map(|t| kallsyms_addresses(&t, RQ_QOS_CALLBACKS))
                .unwrap_or_default(),
            false => [0; 2],
        };
        let settings = Settings {
            wakeup_records: wakeup_records(ring_bytes),
            all_devices: opts.all_devices as u32,
            aggregate: opts.aggregation.mode(),
            op_mask,
            op_read,
            op_write,
            cgroups: opts.cgroups as u32,
            rq_qos: opts.rq_qos as u32,
            causes: causes.is_ok() as u32,
            _pad: 0,
            wbt_inflight_cb: qos_callbacks[0],
            iolat_acquire_inflight: qos_callbacks[1],
        };
        let mut loader = EbpfLoader::new();
        loader.btf(aya_btf.as_ref()).override_global(names::LAYOUT, &layout, true).override_global(
            names::SETTINGS,
            &settings,
            true,
        );
        if let Some(bytes) = opts.ring_buffer_bytes {
            loader.map_max_entries(names::EVENTS, bytes);
        }
        let series_devices = series::capacity(opts.targets);
        loader.map_max_entries(names::SERIES, series_devices * agg::OPS);
        // Per-cgroup series take memory per CPU only where labels are on.
        let cgroup_capacity = if opts.cgroups { cgroup_series::capacity() } else { 0 };
        loader.map_max_entries(names::CGROUP_SERIES, cgroup_capacity.max(1));
        loader.map_max_entries(names::CGROUP_AGG, cgroup_capacity.max(1));
        let mut ebpf = loader.load(OBJECT).map_err(|e| permission_advice(e.into()))?;
        let mut hooks = Vec::new();
        for hook in HOOKS {
            if opts.skip_hooks.iter().any(|s| s == hook.tracepoint) {
                tracing::info!("skipped {}: skip_hooks in the config", hook.tracepoint);
                hooks.push(HookStatus {
                    hook: hook.tracepoint,
                    attach_type: None,
                    program: None,
                    reason: Some("skip_hooks in the config".into()),
                });
                continue;
            }
            // Without BTF for aya, attach skips tp_btf.
            let tp_btf = if opts.attach == Attach::RawTp { None } else { aya_btf.as_ref() };
            let mut status = hook.attach(&mut ebpf, &btf, tp_btf);
            if opts.attach == Attach::RawTp && status.attached() {
                status.reason = Some("attach = raw_tp".into());
            }
            match (&status.attach_type, &status.reason) {
                (Some(how), None) => tracing::debug!("attached {} ({how})", hook.tracepoint),
                (Some(how), Some(why)) => tracing::info!("attached {} ({how}): {why}", hook.tracepoint),
                (None, why) => {
                    let why = why.as_deref().unwrap_or("unknown reason");
                    if hook.required {
                        bail!(
                            "kernel {release}: cannot attach {}, which tracerd needs: {why}",
                            hook.tracepoint
                        );
                    }
                    tracing::warn!("skipped {}: {why}", hook.tracepoint);
                }
            }
            hooks.push(status);
        }
        let series = SeriesTable::new(series_devices);
        let (bio_slots, request_slots) =
            (SlotView::new(&ebpf, names::BIOS)?, SlotView::new(&ebpf, names::REQUESTS)?);
        let mut tracer = Tracer {
            bio_slots,
            request_slots,
            ebpf,
            hooks,
            ops,
            kprobes_loaded: false,
            indices: DeviceIndex::default(),
            series,
            cgroup_series: CgroupSeriesTable::new(cgroup_capacity, opts.cgroup_idle),
            chains: Vec::new(),
            stack: StackLayout::default(),
        };
        tracer.load_causes(opts.causes, causes.err(), aya_btf.as_ref());
        tracer.load_kprobes(opts.no_kprobes, &btf);
        tracer.load_rq_qos(opts.rq_qos, &btf);
        tracer.resolve_chains(&btf)?;
        Ok(tracer)
    }

    /// Reads the stacked drivers' BTF and tells the programs how to link their lower IOs.
    fn resolve_chains(&mut self, vmlinux: &Btf) -> Result<()> {
        let (layout, chains) = stacking::resolve(vmlinux, self.kprobes_loaded);
        for c in chains.iter().filter(|c| !self.chains.contains(c)) {
            match c.state {
                ChainState::Linked(_) => tracing::info!("{}: {}", c.module, stacking::describe(c)),
                ChainState::NotLoaded => tracing::debug!("{}", stacking::describe(c)),
                ChainState::Off(_) => tracing::warn!("{}", stacking::describe(c)),
            }
        }
        self.chains = chains;
        self.write_stack(StackLayout { paths: self.stack.paths, ..layout })
    }

    fn write_stack(&mut self, layout: StackLayout) -> Result<()> {
        let map = self.ebpf.map_mut(names::STACK).context("no STACK map in the BPF object")?;
        let mut stack: Array<_, StackLayout> = Array::try_from(map)?;
        stack.set(0, layout, 0).context("cannot write the stacking layout")?;
        self.stack = layout;
        Ok(())
    }

    /// Resolves the chains again when a module they wait for has been loaded (dm, on the first
    /// dm device).
    pub fn retry_chains(&mut self) -> Result<()> {
        let appeared = self.chains.iter().any(|c| {
            c.state == ChainState::NotLoaded && std::path::Path::new("/sys/module").join(c.module).exists()
        });
        if !appeared {
            return Ok(());
        }
        let btf = Btf::from_sys_fs().with_context(|| format!("cannot read kernel BTF from {VMLINUX}"))?;
        self.resolve_chains(&btf)
    }

    /// Loads the submit-path kprobes where the kernel has kprobes, and attaches what it can.
    fn load_kprobes(&mut self, off: bool, btf: &Btf) {
        let why_not = if off {
            Some(
                "kprobes are off (config kprobes = false, or --no-kprobes): no md/dm submit-path \
                 time, and only the links the kernel's structs state"
                    .to_string(),
            )
        } else if !kprobes_available() {
            Some(
                "kprobes are not available on this kernel (no kprobe PMU): md/dm submit-path time \
                 and per-layer attribution are off"
                    .to_string(),
            )
        } else {
            load_kprobe_programs(&mut self.ebpf).err().map(|e| format!("kprobe programs failed to load: {e}"))
        };
        self.kprobes_loaded = why_not.is_none();
        for k in KPROBES {
            let status = match &why_not {
                Some(reason) => k.skipped(reason.clone()),
                None => k.attach(&mut self.ebpf),
            };
            log_status(&status);
            self.hooks.push(status);
        }
        let status = match throttle_unavailable(btf, !off, kprobes_available()) {
            Some(reason) => THROTTLE.skipped(reason),
            None if !self.kprobes_loaded => THROTTLE.skipped(why_not.unwrap_or_default()),
            None => THROTTLE.attach(&mut self.ebpf),
        };
        log_status(&status);
        self.hooks.push(status);
    }

    /// The wait hooks, where asked for (config `causes`); `unavailable` says why this kernel
    /// cannot have them. Off, they are not listed among the hooks at all.
    fn load_causes(&mut self, on: bool, unavailable: Option<String>, aya_btf: Option<&AyaBtf>) {
        if !on {
            return;
        }
        for hook in CAUSE_HOOKS {
            let status = match (&unavailable, aya_btf) {
                (None, Some(btf)) => hook.attach(&mut self.ebpf, btf),
                (Some(why), _) => hook.skipped(why.clone()),
                (None, None) => hook.skipped("no BTF for tp_btf".into()),
            };
            log_status(&status);
            self.hooks.push(status);
        }
    }

    /// The instructions the verifier processed of each loaded program, by name (kernels from
    /// 5.16 report them).
    pub fn verified_instructions(&self) -> Vec<(String, u32)> {
        self.ebpf
            .programs()
            .filter_map(|(name, p)| Some((name.to_owned(), p.info().ok()?.verified_instruction_count()?)))
            .collect()
    }

    /// Whether the wait hooks run (config `causes`, and the scheduler's hooks attached).
    pub fn causes_on(&self) -> bool {
        self.hooks.iter().any(|h| h.hook == "sched_switch" && h.attached())
    }

    /// The sleepers' and wakers' stacks (can be taken once).
    pub fn take_stacks(&mut self) -> Result<StackTraceMap<MapData>> {
        let map = self.ebpf.take_map(names::STACKS).context("stack map already taken")?;
        Ok(StackTraceMap::try_from(map)?)
    }

    /// The rq-qos wait probes, where asked for (config `rq_qos`) and the kernel has them. Off,
    /// they are not listed among the hooks at all.
    fn load_rq_qos(&mut self, on: bool, btf: &Btf) {
        if !on {
            return;
        }
        for k in RQ_QOS {
            let status = if !self.kprobes_loaded {
                k.skipped(
                    "rq-qos waits need kprobes, which are off or unavailable (see the kprobes above)".into(),
                )
            } else if btf.find(k.function, crate::kernel::btf::Kind::Func).is_none() {
                k.skipped(format!("this kernel has no {} function (or no such policy built)", k.function))
            } else {
                k.attach(&mut self.ebpf)
            };
            log_status(&status);
            self.hooks.push(status);
        }
    }

    /// Retries kprobes that failed for want of their module (md or dm loaded later).
    pub fn retry_kprobes(&mut self) {
        if !self.kprobes_loaded {
            return;
        }
        let first = HOOKS.len();
        for (i, k) in KPROBES.iter().enumerate() {
            if !self.hooks[first + i].attached() {
                let status = k.attach(&mut self.ebpf);
                if status.attached() {
                    log_status(&status);
                    self.hooks[first + i] = status;
                }
            }
        }
    }

    /// The ring buffer of records (can be taken once).
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>> {
        let map = self.ebpf.take_map(names::EVENTS).context("ring buffer already taken")?;
        Ok(RingBuf::try_from(map)?)
    }

    /// The kernel's lost-event counters, summed over CPUs.
    pub fn kernel_lost(&self) -> Result<[u64; lost::KERNEL_COUNT as usize]> {
        let map: PerCpuArray<_, u64> =
            PerCpuArray::try_from(self.ebpf.map(names::LOST).context("LOST map")?)?;
        let mut out = [0; lost::KERNEL_COUNT as usize];
        for (i, slot) in out.iter_mut().enumerate() {
            *slot = map.get(&(i as u32), 0)?.iter().sum();
        }
        Ok(out)
    }

    /// Run statistics summed over tracerd's programs, from the kernel's per-program counters.
    pub fn program_totals(&self) -> ProgramTotals {
        self.ebpf
            .programs()
            .filter_map(|(_, prog)| prog.fd().ok())
            .filter_map(|fd| prog_info(fd.as_fd()))
            .fold(ProgramTotals::default(), |t, info| ProgramTotals {
                run_ns: t.run_ns + info.run_time_ns,
                runs: t.runs + info.run_cnt,
                recursion_misses: t.recursion_misses + info.recursion_misses,
            })
    }

    /// Whether the submit function of bio-based `dev` (md's or dm's) is hooked: only then does
    /// a sleep between its bio's Q and that function's return count as its submission.
    fn submit_hooked(hooks: &[HookStatus], dev: &Device) -> bool {
        let function = match (&dev.md_level, &dev.dm_name) {
            (Some(_), _) => "md_submit_bio",
            (None, Some(_)) => "dm_submit_bio",
            (None, None) => return false,
        };
        hooks.iter().any(|h| h.hook == function && h.attached())
    }

    /// Makes the kernel trace exactly `devs` (kernel `dev_t`s), of which `paths` are NVMe
    /// multipath path disks; keeps counters of kept devices. `topo` tells bio-based devices
    /// and each partition's disk.
    pub fn set_devices(&mut self, devs: &HashSet<u32>, paths: &HashSet<u32>, topo: &Topology) -> Result<()> {
        let mut map: BpfHashMap<_, u32, DeviceState> =
            BpfHashMap::try_from(self.ebpf.map_mut(names::DEVICES).context("DEVICES map")?)?;
        let present: HashSet<u32> = map.keys().filter_map(Result::ok).collect();
        let gone: Vec<u32> = present.difference(devs).copied().collect();
        for dev in &gone {
            map.remove(dev)?;
        }
        let full = || {
            format!(
                "device map full: tracerd traces at most {} disks and partitions at once, and {} \
                 are selected; narrow the selection with --device or --exclude",
                limits::MAX_DEVICES,
                devs.len()
            )
        };
        for dev in devs.difference(&present) {
            let index = self.indices.take(*dev).with_context(full)?;
            let path = paths.contains(dev) as u32;
            let known = topo.get(*dev);
            let bio_based = match known {
                None => bio_based::NO,
                Some(d) if d.request_based => bio_based::NO,
                Some(d) if Self::submit_hooked(&self.hooks, d) => bio_based::SUBMIT_HOOKED,
                Some(_) => bio_based::YES,
            };
            let disk = known.and_then(|d| topo.by_name(&d.disk)).map_or(*dev, |d| d.dev);
            let state = DeviceState { index, path, bio_based, disk, ..DeviceState::default() };
            map.insert(dev, state, 0).with_context(full)?;
        }
        for dev in gone {
            self.release_series(dev)?;
            self.indices.free(dev);
        }
        let paths = devs.iter().any(|d| paths.contains(d)) as u32;
        if paths != self.stack.paths {
            self.write_stack(StackLayout { paths, ..self.stack })?;
        }
        Ok(())
    }

    /// Gives `dev` a series of the in-kernel aggregation, if one is free; true if it has one.
    pub fn give_series(&mut self, dev: u32) -> Result<bool> {
        let Some(index) = self.indices.get(dev) else { return Ok(false) };
        self.series.give(&mut self.ebpf, dev, index)
    }

    /// Stops the kernel counting `dev`'s IO into its series (it goes as records from now on);
    /// the series is still folded until [`Tracer::release_series`].
    pub fn stop_series(&mut self, dev: u32) -> Result<()> {
        match self.indices.get(dev) {
            Some(index) => self.series.stop(&mut self.ebpf, index),
            None => Ok(()),
        }
    }

    /// Takes `dev`'s series back. Stop it and fold first: it is not read after this. Its
    /// per-cgroup series are read once more at the next fold.
    pub fn release_series(&mut self, dev: u32) -> Result<()> {
        if let Some(series) = self.series.series_of(dev) {
            self.cgroup_series.release_device(&mut self.ebpf, series)?;
        }
        self.series.release(&mut self.ebpf, dev, self.indices.get(dev))
    }

    /// Gives a (cgroup, device, op) key a per-cgroup series, if its device has a series and one
    /// is free; true if it has one.
    pub fn give_cgroup_series(&mut self, of: CgroupOf) -> Result<bool> {
        let Some(series) = self.series.series_of(of.dev) else { return Ok(false) };
        let key = CgroupSeriesKey { cgroup: of.cgroup, series, op: of.op as u16, task: of.task as u16 };
        self.cgroup_series.give(&mut self.ebpf, key, of)
    }

    /// While `on`, IOs the kernel aggregates are sent as records too (a view streams them).
    pub fn set_streaming(&mut self, on: bool) -> Result<()> {
        let map = self.ebpf.map_mut(names::STREAM).context("no STREAM map in the BPF object")?;
        let mut stream: aya::maps::Array<_, u32> = aya::maps::Array::try_from(map)?;
        stream.set(0, on as u32, 0).context("cannot switch the stream of records")
    }

    /// IOs of `dev` the kernel aggregates are also sent as records when they take at least
    /// `ns` (0: never); false if `dev` is not traced.
    pub fn set_slow_threshold(&mut self, dev: u32, ns: u64) -> Result<bool> {
        let Some(index) = self.indices.get(dev) else { return Ok(false) };
        let map = self.ebpf.map_mut(names::SLOW_NS).context("no SLOW_NS map in the BPF object")?;
        let mut slow: aya::maps::Array<_, u64> = aya::maps::Array::try_from(map)?;
        slow.set(index, ns, 0).context("cannot set a slow-IO threshold")?;
        Ok(true)
    }

    /// Hands what the kernel counted since the last fold to `f`, per (device, op), and per
    /// cgroup where series are labelled (`Some` cgroup).
    pub fn fold_series(
        &mut self,
        mut f: impl FnMut(u32, u32, Option<&CgroupOf>, &tracer_common::SeriesAgg),
    ) -> Result<()> {
        self.series.fold(&self.ebpf, |dev, op, counted| f(dev, op, None, counted))?;
        let now = std::time::Instant::now();
        self.cgroup_series.fold(&mut self.ebpf, now, |of, counted| f(of.dev, of.op, Some(of), counted))
    }

    /// Busy slots of the in-flight tables: (bios, requests).
    pub fn occupancy(&self) -> Result<(u64, u64)> {
        Ok((self.bio_slots.busy(), self.request_slots.busy()))
    }

    /// Removes in-flight entries of vanished devices (`dev_t`s); returns how many IOs.
    pub fn sweep_devices(&mut self, gone: &HashSet<u32>) -> Result<u64> {
        let bios = sweep(&mut self.ebpf, names::BIOS, &self.bio_slots, |s| gone.contains(&s.dev))?;
        let requests = sweep(&mut self.ebpf, names::REQUESTS, &self.request_slots, |s| {
            gone.contains(&s.record.disk) || gone.contains(&s.record.dev)
        })?;
        Ok(bios + requests)
    }

    /// Removes in-flight entries older than `max_age` (their completion was missed).
    /// Returns (bios, requests) removed.
    pub fn sweep_stale(&mut self, max_age: Duration) -> Result<(u64, u64)> {
        let cutoff = monotonic_ns().saturating_sub(max_age.as_nanos() as u64);
        let stale_bios = sweep(&mut self.ebpf, names::BIOS, &self.bio_slots, |s| bio_last_seen(s) < cutoff)?;
        let stale_requests = sweep(&mut self.ebpf, names::REQUESTS, &self.request_slots, |s| {
            s.record.ts.iter().copied().max().unwrap_or(0) < cutoff
        })?;
        Ok((stale_bios, stale_requests))
    }
}

/// When a bio in flight last showed progress: its Q, its G, or for a bio blk-throttle holds
/// (claimed at H, `queued_ns` still 0) its H. Its age is counted from there: a held bio is
/// waiting, not lost.
fn bio_last_seen(s: &BioState) -> u64 {
    s.queued_ns.max(s.held_ns).max(s.getrq_ns)
}

/// What the kernel counts for each of tracerd's programs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProgramTotals {
    /// Time inside the programs and how many runs; counted only while the sysctl
    /// kernel.bpf_stats_enabled is 1 (it costs a clock read per run, so it is off by default).
    pub run_ns: u64,
    pub runs: u64,
    /// Runs the kernel skipped: a tracepoint program that fires again on a CPU where it is
    /// already running (a completion in a hard interrupt over one in a soft interrupt) is not
    /// run. 0 on kernels before 5.12, which do not count them.
    pub recursion_misses: u64,
}

/// Whether the kernel reports the runs it skipped (`bpf_prog_info.recursion_misses`, 5.12+):
/// before, `ProgramTotals::recursion_misses` stays 0 whatever it skipped.
pub fn counts_recursion_misses(btf: &Btf) -> bool {
    btf.has_member("bpf_prog_info", "recursion_misses")
}

/// One program's bpf_prog_info (BPF_OBJ_GET_INFO_BY_FD; aya does not expose these fields).
fn prog_info(fd: BorrowedFd<'_>) -> Option<aya_obj::generated::bpf_prog_info> {
    use aya_obj::generated::{bpf_attr, bpf_cmd, bpf_prog_info};
    // SAFETY: both are plain C structs, valid when zeroed.
    let mut info: bpf_prog_info = unsafe { std::mem::zeroed() };
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    attr.info.bpf_fd = fd.as_raw_fd() as u32;
    attr.info.info_len = std::mem::size_of::<bpf_prog_info>() as u32;
    attr.info.info = &raw mut info as u64;
    // SAFETY: attr points at a live bpf_prog_info of the size given; the kernel writes at most
    // that many bytes (fewer on older kernels, leaving the rest zero).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            bpf_cmd::BPF_OBJ_GET_INFO_BY_FD as libc::c_long,
            &raw mut attr,
            std::mem::size_of::<bpf_attr>(),
        )
    };
    (rc == 0).then_some(info)
}

/// Frees in-flight entries of devices that are gone; returns (bios, requests) freed.
/// Frees the busy slots of a slot table whose value is `stale`; returns how many. The scan
/// reads the mapped table; each candidate is read again through bpf() before it is freed, as
/// the kernel may have reused its slot meanwhile.
fn sweep<V: aya::Pod + Default>(
    ebpf: &mut Ebpf,
    name: &str,
    view: &SlotView<V>,
    stale: impl Fn(&V) -> bool,
) -> Result<u64> {
    let candidates = view.find(&stale);
    if candidates.is_empty() {
        return Ok(0);
    }
    let mut table: Array<_, Slot<V>> =
        Array::try_from(ebpf.map_mut(name).with_context(|| format!("{name} map"))?)?;
    let mut freed = 0;
    for i in candidates {
        let slot = table.get(&i, 0)?;
        if slot.key != 0 && stale(&slot.value) {
            table.set(i, Slot::<V>::default(), 0)?;
            freed += 1;
        }
    }
    Ok(freed)
}

fn log_status(s: &HookStatus) {
    match (s.attach_type, &s.reason) {
        (Some(how), _) => tracing::info!("attached {} ({how})", s.hook),
        (None, why) => tracing::info!("skipped {}: {}", s.hook, why.as_deref().unwrap_or("unknown reason")),
    }
}

/// CLOCK_MONOTONIC in ns: the clock of `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn permission_advice(e: anyhow::Error) -> anyhow::Error {
    let text = format!("{e:#}");
    if text.contains("Operation not permitted") || text.contains("EPERM") {
        e.context(
            "the kernel refused to load tracerd's programs: run as root or with CAP_BPF and \
             CAP_PERFMON; in a container also allow the bpf() syscall",
        )
    } else {
        e.context("cannot load tracerd's kernel programs")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bio_held_by_blk_throttle_is_as_old_as_its_hold_not_stale() {
        // Claimed at H, not queued yet: as old as its H.
        let held = BioState { held_ns: 5_000, ..Default::default() };
        assert_eq!(bio_last_seen(&held), 5_000);
        // Queued after its hold, then given a request: its G.
        let queued = BioState { held_ns: 5_000, queued_ns: 7_000, getrq_ns: 7_500, ..Default::default() };
        assert_eq!(bio_last_seen(&queued), 7_500);
        // Nothing at all: as old as it gets.
        assert_eq!(bio_last_seen(&BioState::default()), 0);
    }
}
