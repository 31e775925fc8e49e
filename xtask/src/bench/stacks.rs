//! `cargo xtask bench --stacks`: what `tracerd run` costs on the stacks whose lower IO is sent
//! from another task (md raid5's raid5d, dm-crypt's kcryptd), beside biolatency on the same
//! stack and no tracer, in the VM (md and dm exist only there). The guest measures, the host
//! prints medians and the cost each tracer adds.
//!
//! Workload: fio 4 KiB random reads and writes, half each (libaio, O_DIRECT, queue depth 8) on
//! md raid5 over three brd disks and on dm-crypt over one, at a quarter of the untraced rate the
//! guest first measures on each stack. CPU per IO is the guest's busy time (/proc/stat) over the
//! IOs fio did; variants are interleaved over rounds. The guest runs under TCG, so its absolute
//! figures are many times a real machine's: read the differences and ratios within one run.

use std::{collections::BTreeMap, fmt::Write as _, fs, time::Duration};

use anyhow::{Context, Result, bail};

use super::{
    machine::out_dir,
    results::{provenance, utc_now},
    stats::median,
};
use crate::{root_dir, setup, vm};

/// The variants, in the order each round runs them.
const VARIANTS: [&str; 3] = ["none", "tracerd", "biolatency"];

/// The guest's part: builds the stacks, then per round, stack and variant starts the tracer,
/// runs fio at the fixed rate and prints `STACKBENCH stack variant round ios busy_ticks
/// tracer_ticks lost`.
fn guest_body(seconds: u64, rounds: usize) -> String {
    format!(
        r#"echo 1 > /proc/sys/kernel/printk
ip link set lo up
mdadm --create /dev/md2 --run --force --level=5 --raid-devices=3 --chunk=64 --metadata=1.2 \
    --assume-clean /dev/ram9 /dev/ram10 /dev/ram11 || vm_fail "mdadm --create /dev/md2"
echo 0 > /sys/block/md2/md/safe_mode_delay
dmsetup create crypt0 --table "0 131072 crypt aes-cbc-plain64 00112233445566778899aabbccddeeff 0 /dev/ram3 0" \
    || vm_fail "dmsetup create crypt0"
# brd allocates a page on its first write: fill the range fio uses, untraced.
for d in md2 mapper/crypt0; do
    fio --name=fill --filename=/dev/$d --rw=write --bs=1M --size=32M --direct=1 > /dev/null || vm_fail "fio fill $d"
done
busy() {{ awk '/^cpu /{{print $2+$3+$4+$7+$8+$9; exit}}' /proc/stat; }}
ticks() {{ [ -n "$1" ] && awk '{{print $14+$15}}' /proc/$1/stat || echo 0; }}
# fio_run DEV SECONDS [RATE]: prints the IOs done (terse v3: read KiB field 6, write KiB 47).
fio_run() {{
    fio --name=b --filename=/dev/$1 --rw=randrw --bs=4k --ioengine=libaio --direct=1 --iodepth=8 \
        --size=32M --norandommap --randrepeat=0 --time_based --runtime=$2 ${{3:+--rate_iops=$3,$3}} \
        --output-format=terse --terse-version=3 | awk -F';' '{{print int(($6 + $47) / 4)}}'
}}
# progs PID: BPF programs the process holds.
progs() {{ ls -l /proc/$1/fd 2>/dev/null | grep -c bpf-prog; }}
start_tracer() {{
    pid=""
    case $1 in
    tracerd)
        /bin/tracerd run --listen 127.0.0.1:9599 > /tmp/bench_tracer.out 2> /tmp/bench_tracer.err &
        pid=$!
        vm_wait_for /tmp/bench_tracer.err "metrics on" $pid ;;
    biolatency)
        /usr/sbin/biolatency 3600 > /tmp/bench_tracer.out 2> /tmp/bench_tracer.err &
        pid=$!
        vm_until "biolatency loaded no program" sh -c "[ \$(ls -l /proc/$pid/fd 2>/dev/null | grep -c bpf-prog) -gt 0 ] || ! kill -0 $pid" ;;
    esac
    sleep 1
    [ -z "$pid" ] || kill -0 $pid || {{ echo "VM-WARNING $1 exited:"; cat /tmp/bench_tracer.err; }}
}}
lost() {{
    [ "$1" = tracerd ] || {{ echo -; return; }}
    wget -qO- http://127.0.0.1:9599/metrics | awk '/^tracerd_events_lost_total/{{n += $2}} END {{print n + 0}}'
}}
stop_tracer() {{ [ -z "$pid" ] || {{ kill -INT $pid; wait $pid; }}; }}
echo "VM-RESULT-BEGIN stackbench"
for s in md2 mapper/crypt0; do
    sat=$(fio_run $s 3)
    echo "STACKRATE $s $sat"
    eval "rate_$(echo $s | tr / _)=$((sat / 3 / 8))"
done
round=1
while [ $round -le {rounds} ]; do
    for s in md2 mapper/crypt0; do
        eval "rate=\$rate_$(echo $s | tr / _)"
        for v in {variants}; do
            start_tracer $v
            b0=$(busy); t0=$(ticks $pid)
            ios=$(fio_run $s {seconds} $rate)
            b1=$(busy); t1=$(ticks $pid)
            l=$(lost $v)
            stop_tracer
            echo "STACKBENCH $s $v $round $ios $((b1 - b0)) $((t1 - t0)) $l"
        done
    done
    round=$((round + 1))
done
echo "VM-RESULT-END stackbench"
mdadm --stop /dev/md2
dmsetup remove crypt0"#,
        variants = VARIANTS.join(" ")
    )
}

/// One measured run.
struct Run {
    ios: u64,
    busy_ticks: u64,
    tracer_ticks: u64,
    lost: Option<u64>,
}

/// (stack, variant) to its runs, in round order.
type Runs = BTreeMap<(String, String), Vec<Run>>;

/// Parses the guest's `STACKBENCH` lines: (stack, variant) to runs in round order, and the
/// untraced saturation IOPS per stack (`STACKRATE`, over 3 s).
fn parse(section: &str) -> Result<(Runs, BTreeMap<String, u64>)> {
    let mut runs = Runs::new();
    let mut rates = BTreeMap::new();
    for line in section.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["STACKRATE", stack, ios] => {
                rates.insert(stack.to_string(), ios.parse::<u64>().context("STACKRATE IOs")? / 3);
            }
            ["STACKBENCH", stack, variant, _round, ios, busy, tracer, lost] => {
                let n = |s: &str| s.parse::<u64>().with_context(|| format!("not a number in {line:?}"));
                let run =
                    Run { ios: n(ios)?, busy_ticks: n(busy)?, tracer_ticks: n(tracer)?, lost: n(lost).ok() };
                runs.entry((stack.to_string(), variant.to_string())).or_default().push(run);
            }
            _ => {}
        }
    }
    if runs.is_empty() {
        bail!("the guest printed no STACKBENCH line:\n{section}");
    }
    Ok((runs, rates))
}

/// Guest ticks are USER_HZ (100 a second on every Debian kernel).
const TICK_NS: f64 = 1e7;

fn summarize(runs: &Runs, rates: &BTreeMap<String, u64>, seconds: u64, rounds: usize) -> String {
    let per_io = |r: &Run, ticks: u64| ticks as f64 * TICK_NS / r.ios.max(1) as f64;
    let mut text = format!(
        "CPU per IO on stacks, guest busy time over IOs (median of {} rounds of {} s; fio randrw 4 KiB qd 8 at 25% of the untraced rate):\n",
        rounds, seconds
    );
    let _ = writeln!(
        text,
        "{:<14} {:<11} {:>8} {:>12} {:>14} {:>14} {:>5}",
        "stack", "variant", "IOPS", "CPU ns/IO", "over no tracer", "tracer's own", "lost"
    );
    let stacks: Vec<String> = rates.keys().cloned().collect();
    let mut verdicts = vec![];
    for stack in &stacks {
        let cpu = |v: &str| {
            runs.get(&(stack.clone(), v.to_string()))
                .map(|rs| median(rs.iter().map(|r| per_io(r, r.busy_ticks)).collect()))
        };
        let base = cpu("none");
        for v in VARIANTS {
            let Some(rs) = runs.get(&(stack.clone(), v.to_string())) else { continue };
            let iops = median(rs.iter().map(|r| r.ios as f64 / seconds as f64).collect());
            let own = median(rs.iter().map(|r| per_io(r, r.tracer_ticks)).collect());
            let lost: Option<u64> = rs.iter().map(|r| r.lost).sum();
            let over = cpu(v).zip(base).map(|(c, b)| c - b);
            let _ = writeln!(
                text,
                "{:<14} {:<11} {:>8.0} {:>12.0} {:>14} {:>14} {:>5}",
                stack,
                v,
                iops,
                cpu(v).unwrap_or(f64::NAN),
                if v == "none" { "-".into() } else { over.map_or("-".into(), |o| format!("{o:+.0}")) },
                if v == "none" { "-".into() } else { format!("{own:.0}") },
                lost.map_or("-".into(), |l| l.to_string())
            );
        }
        if let (Some(t), Some(b), Some(n)) = (cpu("tracerd"), cpu("biolatency"), base) {
            let _ = writeln!(
                text,
                "{:<14} tracerd run adds {:+.0} ns per IO where biolatency adds {:+.0} ({}); untraced saturation {} IOPS",
                stack,
                t - n,
                b - n,
                if b - n > 0.0 {
                    format!("{:.2}x", (t - n) / (b - n))
                } else {
                    "biolatency's is within noise".into()
                },
                rates[stack]
            );
            verdicts.push((format!("{stack}: tracerd run CPU/IO <= biolatency's"), t <= b));
            let lost: u64 = runs[&(stack.clone(), "tracerd".into())].iter().filter_map(|r| r.lost).sum();
            verdicts.push((format!("{stack}: tracerd run lost no event ({lost})"), lost == 0));
        }
    }
    text.push_str("\ntargets:\n");
    for (what, ok) in verdicts {
        let _ = writeln!(text, "  {} {what}", if ok { "met    " } else { "NOT MET" });
    }
    text
}

/// The results page for `--stacks`, next to the host benchmark's.
const RESULTS_PAGE: &str = "docs/internals/overhead-stacks-results.md";

/// Runs the stacks bench on the one kernel series `kernel` names, `rounds` rounds of `seconds`
/// per run, and writes its results page.
pub(super) fn bench_stacks(kernel: &str, seconds: u64, rounds: usize) -> Result<()> {
    let series = vm::KernelSeries::select(kernel)?;
    let [series] = series.as_slice() else { bail!("--stacks runs on one kernel: --kernel 6.1, say") };
    let commit = provenance()?;
    let bins = vm::build_guest_binaries()?;
    setup::apt_install(&["fio", "libbpf-tools"], "the stack benchmark")?;
    let kernel = vm::kernel(*series)?;
    let tools = [("/usr/bin/fio", "fio"), ("/usr/sbin/biolatency", "biolatency")];
    // Boot, two saturation probes and rounds x stacks x variants runs of `seconds` each, with
    // room for tracers starting slowly under TCG.
    let runs = rounds as u64 * 2 * VARIANTS.len() as u64;
    let timeout = Duration::from_secs(600 + runs * (seconds + 60));
    eprintln!("xtask: bench: stacks: {runs} runs of {seconds} s in the {} guest", kernel.version);
    let stem = format!("tracerd-bench-{}", series.name);
    let scenario = vm::scenario("stackbench", &STACK_MODULES, &guest_body(seconds, rounds));
    let (console, _) = vm::boot_guest(&kernel, &bins, &tools, &stem, &scenario, &["stackbench"], timeout)?;
    if let Some(line) =
        console.lines().find(|l| l.starts_with("VM-SETUP-FAILED") || l.starts_with("VM-SKIPPED"))
    {
        bail!("the guest could not run the stack benchmark: {line}");
    }
    let section = vm::result_section(&console, "stackbench").with_context(|| {
        format!(
            "the guest printed no stackbench result: {}",
            vm::out_dir().join(format!("{stem}.log")).display()
        )
    })?;
    for warning in section.lines().filter(|l| l.starts_with("VM-WARNING")) {
        eprintln!("xtask: bench: stacks: {warning}");
    }
    let (runs, rates) = parse(&section)?;
    let text = summarize(&runs, &rates, seconds, rounds);
    print!("{text}");
    let dir = out_dir();
    fs::create_dir_all(&dir)?;
    fs::write(dir.join("stacks.txt"), &text)?;
    let date = utc_now()?;
    let page = format!(
        "# Overhead on stacks: latest results\n\n\
         Written by `cargo xtask bench --stacks --kernel {}` ({} s runs, {} rounds), {} at commit {}, \
         in the {} guest under qemu TCG (docs/internals/overhead.md says how to read it). \
         Commit it with the code it measured.\n\n```\n{text}```\n",
        series.name, seconds, rounds, date, commit, kernel.version
    );
    fs::write(root_dir().join(RESULTS_PAGE), page)?;
    eprintln!("xtask: bench: wrote {RESULTS_PAGE}");
    Ok(())
}

/// Modules the stacks need (the guest's set-up loads them with the rest).
const STACK_MODULES: [&str; 4] = ["brd", "raid456", "dm-mod", "dm-crypt"];
