//! The VM scenarios: one table of what the guest runs on every kernel, each a shell body with
//! the modules it needs. The smoke scenario proves the chain; the others run known workloads on
//! md, dm, brd, null_blk and qemu's disks, traced by tracerd, and print results between
//! VM-RESULT markers for tests/tests/vm to assert on, one test module per scenario.
//!
//! A scenario's name is its table entry's, its body's constant's, the prefix of its result
//! sections and the name of its test module (tests/tests/vm/NAME.rs).

use super::guest::scenario;

/// Shell helpers for scenarios: start a tracer in the background and wait until it is
/// attached, stop it with SIGINT once the workload is done (report and snoop drain every record
/// before they exit, so no scenario waits a guessed time), print its output as a result section.
const HELPERS: &str = r#"
# Kernel messages would interleave with results on the console.
echo 1 > /proc/sys/kernel/printk
trace_start() {
    name=$1; shift
    /bin/tracerd "$@" > /tmp/$name.out 2> /tmp/$name.err &
    eval "pid_$name=$!"
    vm_wait_for /tmp/$name.err "attached [0-9]* hooks" $!
}
trace_stop() {
    eval "p=\$pid_$1"
    kill -INT $p
    wait $p
    echo "tracer $1 exit status: $?"
}
# vm_idle DEV: waits until DEV has no request in flight. Request-based dm ends a request (its C)
# from a soft interrupt after the data reached the submitter, so iogen can exit first.
vm_idle() { vm_until "$1 never went idle" vm_no_inflight "$1"; }
vm_no_inflight() { read r w < /sys/block/$1/inflight && [ "$r$w" = 00 ]; }
# md_create_active MD LEVEL DISK...: an array of DISKs, 64 KiB chunks, created --assume-clean
# (no resync IO) and marked active by one write before any tracing; safe_mode_delay 0 lets a
# scenario mark it clean at once.
md_create_active() {
    md=$1 level=$2; shift 2
    mdadm --create /dev/$md --run --force --level=$level --raid-devices=$# --chunk=64 --metadata=1.2 \
        --assume-clean "$@" || vm_fail "mdadm --create /dev/$md"
    echo 0 > /sys/block/$md/md/safe_mode_delay
    /bin/iogen /dev/$md write 1 4096 1 > /dev/null
    vm_until "$md never left the clean state" grep -q '^active' /sys/block/$md/md/array_state
}
# diskstats NAME DISKS: the /proc/diskstats lines of DISKS (an ERE alternation) into NAME's result.
diskstats() { grep -E " ($2) " /proc/diskstats > /tmp/$1.out; }
emit() {
    echo "VM-RESULT-BEGIN $1"
    cat /tmp/$1.out
    echo "VM-RESULT-END $1"
    if grep -qi "error" /tmp/$1.err 2>/dev/null; then echo "--- $1 stderr:"; cat /tmp/$1.err; fi
}
"#;

/// dm-linear (lin0 = dm-0) over brd ram2: 300 reads at qd 1, 200 writes at qd 4.
const DM_LINEAR: &str = r#"ip link set lo up
trace_start dm_linear_snoop snoop --json --device dm-0
# The reports name lin0 as people do: by its dm name, and by its /dev/mapper node.
trace_start dm_linear_report_json report --json --duration 600 --device lin0
trace_start dm_linear_report_text report --duration 600 --device /dev/mapper/lin0
trace_start dm_linear_agent run --listen 127.0.0.1:9560 --no-store --device dm-0
/bin/iogen /dev/dm-0 read 300 4096 1
/bin/iogen /dev/dm-0 write 200 4096 4
# The agent's exposition, for the dashboard test on the host (stacked-device series), once it
# has counted every IO.
dm_linear_agent_counted() {
    wget -q -O /tmp/dm_linear_metrics.out http://127.0.0.1:9560/metrics 2> /tmp/dm_linear_metrics.err &&
        grep -q '^tracerd_io_requests_total{device="dm-0",op="read"} 300$' /tmp/dm_linear_metrics.out &&
        grep -q '^tracerd_io_requests_total{device="dm-0",op="write"} 200$' /tmp/dm_linear_metrics.out
}
vm_until "the dm-0 agent never counted 300 reads and 200 writes" dm_linear_agent_counted
# The agent's recorder, read by an attached report: the frame of the last IO is sealed within
# a second, so wait until the window holds all 500.
dm_linear_window_counted() {
    /bin/tracerd report --since 10m --json --device lin0 > /tmp/dm_linear_window.out 2> /tmp/dm_linear_window.err &&
        grep -q '"requests": 300' /tmp/dm_linear_window.out && grep -q '"requests": 200' /tmp/dm_linear_window.out
}
vm_until "the agent's recorder never held the 500 dm-0 IOs" dm_linear_window_counted
for t in dm_linear_snoop dm_linear_report_json dm_linear_report_text dm_linear_agent; do trace_stop $t; done
for t in dm_linear_snoop dm_linear_report_json dm_linear_report_text dm_linear_metrics dm_linear_window; do emit $t; done"#;

/// md raid1 (md0 over ram0, ram1) and raid10 (md1 over ram7, ram8), both --assume-clean: 200
/// writes at qd 1, 100 reads at qd 2 on each; md1 and a second view of md0 traced without kprobes.
/// Then raid0 (md4 over ram16, ram17), without kprobes: 100 page writes and 100 page reads at
/// qd 2, 40 writes of 128 KiB at qd 1, each split across the two members.
const MD: &str = r#"# md1: raid10 (two near copies) over ram7 and ram8.
mdadm --create /dev/md1 --run --force --level=10 --layout=n2 --raid-devices=2 --metadata=1.2 \
    --assume-clean /dev/ram7 /dev/ram8 || vm_fail "mdadm --create /dev/md1"
# Dirty the arrays before tracing: md's own superblock write is not part of the workload,
# and with safe mode off an array stays dirty (no further superblock writes).
for md in md0 md1; do
    echo 0 > /sys/block/$md/md/safe_mode_delay
    /bin/iogen /dev/$md write 1 4096 1 > /dev/null
    # md_write_start waits for the superblock update, so this is at once; it only catches a change.
    vm_until "$md never left the clean state" grep -q '^active' /sys/block/$md/md/array_state
done
trace_start md_snoop snoop --json --device md0
trace_start md_report_json report --json --duration 600 --device md0
trace_start md_report_text report --duration 600 --device md0
# Without kprobes: the links come from md's own structs (module BTF) alone.
trace_start md_snoop_btf snoop --json --no-kprobes --device md0 --device md1
/bin/iogen /dev/md0 write 200 4096 1
/bin/iogen /dev/md0 read 100 4096 2
/bin/iogen /dev/md1 write 200 4096 1
/bin/iogen /dev/md1 read 100 4096 2
for t in md_snoop md_report_json md_report_text md_snoop_btf; do trace_stop $t; done
for t in md_snoop md_report_json md_report_text md_snoop_btf; do emit $t; done
mdadm --stop /dev/md1 || echo "VM-WARNING mdadm --stop /dev/md1 failed"
# md4: raid0 over ram16 and ram17, 64 KiB chunks, no kprobes. A page lands on one member; a
# 128 KiB write (iogen aligns it to 256 KiB) spans two chunks and is split, a piece per member.
mdadm --create /dev/md4 --run --force --level=0 --raid-devices=2 --chunk=64 --metadata=1.2 \
    /dev/ram16 /dev/ram17 || vm_fail "mdadm --create /dev/md4"
# The first open scans md4's partition table (reads): before tracing.
/bin/iogen /dev/md4 read 1 4096 1 > /dev/null
trace_start md_raid0_snoop snoop --json --no-kprobes --device md4
trace_start md_raid0_report_json report --json --no-kprobes --duration 600 --device md4
diskstats md_raid0_diskstats_before "md4|ram16|ram17"
/bin/iogen /dev/md4 write 100 4096 2
/bin/iogen /dev/md4 read 100 4096 2
/bin/iogen /dev/md4 write 40 131072 1
diskstats md_raid0_diskstats_after "md4|ram16|ram17"
for t in md_raid0_snoop md_raid0_report_json; do trace_stop $t; done
for t in md_raid0_snoop md_raid0_report_json md_raid0_diskstats_before md_raid0_diskstats_after; do emit $t; done
mdadm --stop /dev/md4 || echo "VM-WARNING mdadm --stop /dev/md4 failed""#;

/// md raid5 (md2 over ram9, ram10, ram11, --assume-clean, 64 KiB chunks), traced without
/// kprobes: 120 page writes at qd 1 (each a stripe write after a pre-read), the array marked
/// clean (the next write waits for md to mark it dirty in every superblock), 100 page reads at
/// qd 2 (md's aligned reads), then 64 writes of 512 bytes at qd 8 in order, four to a page.
/// Then three levels: dm-crypt over dm-linear over md2, 100 writes and 100 reads at qd 2. Then
/// md raid6 (md3 over ram12..ram15): 60 page writes at qd 1, 60 page reads at qd 2.
const MD_PARITY: &str = r#"md_create_active md2 5 /dev/ram9 /dev/ram10 /dev/ram11
trace_start md_parity_raid5_snoop snoop --json --no-kprobes --device md2
trace_start md_parity_raid5_report_json report --json --no-kprobes --duration 600 --device md2
diskstats md_parity_raid5_diskstats_before "md2|ram9|ram10|ram11"
/bin/iogen /dev/md2 write 120 4096 1
echo clean > /sys/block/md2/md/array_state
vm_until "md2 never became clean" grep -q '^clean' /sys/block/md2/md/array_state
/bin/iogen /dev/md2 read 100 4096 2
/bin/iogen /dev/md2 write 64 512 8 seq
diskstats md_parity_raid5_diskstats_after "md2|ram9|ram10|ram11"
for t in md_parity_raid5_snoop md_parity_raid5_report_json; do trace_stop $t; done
for t in md_parity_raid5_snoop md_parity_raid5_report_json md_parity_raid5_diskstats_before md_parity_raid5_diskstats_after; do emit $t; done
# Three levels, as a laptop's encrypted LVM volume on an array: dm-crypt (top0) over dm-linear
# (vol0) over md2.
sectors=$(cat /sys/block/md2/size)
dmsetup create vol0 --table "0 $sectors linear /dev/md2 0" || vm_fail "dmsetup create vol0"
dmsetup create top0 --table "0 $sectors crypt aes-cbc-plain64 00112233445566778899aabbccddeeff 0 /dev/mapper/vol0 0" \
    || vm_fail "dmsetup create top0"
for b in /sys/block/dm-*; do echo "$(cat $b/dm/name) ${b##*/}"; done > /tmp/md_parity_stack3_names.out
trace_start md_parity_stack3_snoop snoop --json --no-kprobes --device top0
trace_start md_parity_stack3_report_json report --json --no-kprobes --duration 600 --device top0
stack3_disks="md2|$(cd /sys/block && ls -d dm-* | tr '\n' '|' | sed 's/|$//')"
diskstats md_parity_stack3_diskstats_before "$stack3_disks"
/bin/iogen /dev/mapper/top0 write 100 4096 2
/bin/iogen /dev/mapper/top0 read 100 4096 2
diskstats md_parity_stack3_diskstats_after "$stack3_disks"
for t in md_parity_stack3_snoop md_parity_stack3_report_json; do trace_stop $t; done
for t in md_parity_stack3_names md_parity_stack3_snoop md_parity_stack3_report_json md_parity_stack3_diskstats_before md_parity_stack3_diskstats_after; do
    emit $t
done
dmsetup remove top0 && dmsetup remove vol0 || echo "VM-WARNING dmsetup remove top0 vol0 failed"
mdadm --stop /dev/md2 || echo "VM-WARNING mdadm --stop /dev/md2 failed"
# raid6: the same personality with two parity pages a stripe (P and Q).
md_create_active md3 6 /dev/ram12 /dev/ram13 /dev/ram14 /dev/ram15
trace_start md_parity_raid6_snoop snoop --json --no-kprobes --device md3
trace_start md_parity_raid6_report_json report --json --no-kprobes --duration 600 --device md3
diskstats md_parity_raid6_diskstats_before "md3|ram12|ram13|ram14|ram15"
/bin/iogen /dev/md3 write 60 4096 1
/bin/iogen /dev/md3 read 60 4096 2
diskstats md_parity_raid6_diskstats_after "md3|ram12|ram13|ram14|ram15"
for t in md_parity_raid6_snoop md_parity_raid6_report_json; do trace_stop $t; done
for t in md_parity_raid6_snoop md_parity_raid6_report_json md_parity_raid6_diskstats_before md_parity_raid6_diskstats_after; do emit $t; done
mdadm --stop /dev/md3 || echo "VM-WARNING mdadm --stop /dev/md3 failed""#;

/// null_blk (50 ms timer completions, so a round of requests is in flight together): 96 reads
/// in rounds (iogen `batch`) at queue depths 1, 2, 4, 8, 16, 32 on nullb0..nullb5, so each
/// depth 1..QD is seen 96/QD times; then a snoop of 300 reads at qd 16.
const NULL_BLK: &str = r#"trace_start null_blk_qd_report_json report --json --by qd --duration 600 --device nullb0 --device nullb1 --device nullb2 --device nullb3 --device nullb4 --device nullb5
i=0
for qd in 1 2 4 8 16 32; do /bin/iogen /dev/nullb$i read 96 4096 $qd batch; i=$((i + 1)); done
trace_stop null_blk_qd_report_json
emit null_blk_qd_report_json
trace_start null_blk_snoop snoop --json --device nullb0
/bin/iogen /dev/nullb0 read 300 4096 16
trace_stop null_blk_snoop
emit null_blk_snoop"#;

/// Request-based dm (multipath mp0 = dm-1 over nullb6): 100 reads, then 50 writes, at qd 1,
/// with the kprobes and again without (linked from dm's structs alone); then 400 reads at qd 8,
/// where a clone's completion in a hard interrupt can land while the completion program runs in
/// dm's soft interrupt (the kernel skips it: `recursion`).
const DM_MULTIPATH: &str = r#"trace_start dm_multipath_snoop snoop --json --device dm-1
trace_start dm_multipath_report_json report --json --duration 600 --device dm-1
/bin/iogen /dev/dm-1 read 100 4096 1
/bin/iogen /dev/dm-1 write 50 4096 1
vm_idle dm-1
for t in dm_multipath_snoop dm_multipath_report_json; do trace_stop $t; done
for t in dm_multipath_snoop dm_multipath_report_json; do emit $t; done
trace_start dm_multipath_btf_snoop snoop --json --no-kprobes --device dm-1
/bin/iogen /dev/dm-1 read 100 4096 1
/bin/iogen /dev/dm-1 write 50 4096 1
vm_idle dm-1
trace_stop dm_multipath_btf_snoop
emit dm_multipath_btf_snoop
trace_start dm_multipath_qd8_snoop snoop --json --device dm-1
trace_start dm_multipath_qd8_report_json report --json --duration 600 --device dm-1
/bin/iogen /dev/dm-1 read 400 4096 8
vm_idle dm-1
for t in dm_multipath_qd8_snoop dm_multipath_qd8_report_json; do trace_stop $t; done
for t in dm_multipath_qd8_snoop dm_multipath_qd8_report_json; do emit $t; done"#;

/// dm targets that submit the lower IO from another task: dm-crypt (crypt0 over ram3; writes
/// go out from its dmcrypt_write thread), dm-delay (delay0 over ram4, 20 ms: a kdelayd worker
/// sends each bio when its delay is up) and dm-thin (thin0 over the pool over ram5 metadata and
/// ram6 data; a write to an unprovisioned block waits for the pool's worker). Each upper IO is
/// linked to its lower IO from dm's own structs, whichever task sent it.
const DM_DEFERRED: &str = r#"dmsetup create crypt0 --table "0 131072 crypt aes-cbc-plain64 00112233445566778899aabbccddeeff 0 /dev/ram3 0" \
    || vm_fail "dmsetup create crypt0"
dmsetup create delay0 --table "0 131072 delay /dev/ram4 0 20" || vm_fail "dmsetup create delay0"
# The metadata device is zeroed (a fresh ram disk): the pool formats it.
dmsetup create pool --table "0 131072 thin-pool /dev/ram5 /dev/ram6 128 0" || vm_fail "dmsetup create pool"
dmsetup message pool 0 "create_thin 0" || vm_fail "dmsetup message pool create_thin"
dmsetup create thin0 --table "0 131072 thin /dev/mapper/pool 0" || vm_fail "dmsetup create thin0"
echo "dm devices: $(for d in /sys/block/dm-*; do echo "$(basename $d)=$(cat $d/dm/name)"; done | tr '\n' ' ')"
trace_start dm_deferred_snoop snoop --json --device crypt0 --device delay0 --device thin0
trace_start dm_deferred_report_json report --json --duration 600 --device crypt0 --device delay0 --device thin0
/bin/iogen /dev/mapper/crypt0 write 200 4096 4
/bin/iogen /dev/mapper/crypt0 read 100 4096 1
/bin/iogen /dev/mapper/delay0 read 50 4096 1
/bin/iogen /dev/mapper/thin0 write 150 4096 1
for t in dm_deferred_snoop dm_deferred_report_json; do trace_stop $t; done
for t in dm_deferred_snoop dm_deferred_report_json; do emit $t; done
dmsetup remove thin0 && dmsetup remove pool && dmsetup remove delay0 && dmsetup remove crypt0 \
    || echo "VM-WARNING dmsetup remove failed""#;

/// dm targets that copy, cache or checksum, and send some of their clones on without a remap:
/// a persistent snapshot (snap0 over ram18, its COW store on ram19) with its origin (snaporig),
/// dm-integrity without a journal over ram20 (integ0), dm-writecache in SSD mode (wc0: origin
/// ram21, cache ram22) and dm-cache in writeback mode with smq (cache0: metadata ram23, cache
/// ram24, origin ram25); and integ1, dm-integrity with its journal over ram26. 100 page writes and 100 page reads at qd 2 on each, the writes first:
/// each origin write copies its chunk to the COW store before it goes on, and the snapshot's
/// reads then find those chunks there. /proc/diskstats is read once the disks are quiet (the
/// targets' own metadata commits are 100 ms or 1 s timers), before and after.
const DM_COPY: &str = r#"for m in dm-snapshot dm-integrity dm-writecache dm-cache dm-cache-smq; do vm_load $m; done
dmsetup create snap0 --table "0 131072 snapshot /dev/ram18 /dev/ram19 P 8" || vm_fail "dmsetup create snap0"
dmsetup create snaporig --table "0 131072 snapshot-origin /dev/ram18" || vm_fail "dmsetup create snaporig"
# dm-integrity formats a zeroed disk, then says how many sectors it provides: the table is
# made again at that size.
integrity="integrity /dev/ram20 0 4 D 2 internal_hash:crc32c commit_time:100"
dmsetup create integ0 --table "0 8 $integrity" || vm_fail "dmsetup create integ0 (format)"
provided=$(dmsetup status integ0 | cut -d' ' -f5)
dmsetup remove integ0 && dmsetup create integ0 --table "0 $provided $integrity" \
    || vm_fail "dmsetup create integ0 with $provided sectors"
# integ1: dm-integrity with its journal (integritysetup's default) over ram26.
journal="integrity /dev/ram26 0 4 J 2 internal_hash:crc32c commit_time:100"
dmsetup create integ1 --table "0 8 $journal" || vm_fail "dmsetup create integ1 (format)"
provided=$(dmsetup status integ1 | cut -d' ' -f5)
dmsetup remove integ1 && dmsetup create integ1 --table "0 $provided $journal" \
    || vm_fail "dmsetup create integ1 with $provided sectors"
dmsetup create wc0 --table "0 131072 writecache s /dev/ram21 /dev/ram22 4096 2 autocommit_time 100" \
    || vm_fail "dmsetup create wc0"
dmsetup create cache0 --table "0 131072 cache /dev/ram23 /dev/ram24 /dev/ram25 128 1 writeback smq 0" \
    || vm_fail "dmsetup create cache0"
echo "dm devices: $(for d in /sys/block/dm-*; do echo "$(basename $d)=$(cat $d/dm/name)"; done | tr '\n' ' ')"
# dm counts its IO in /proc/diskstats (brd does not).
disks=$(for d in /sys/block/dm-*; do case $(cat $d/dm/name) in snaporig|snap0|integ0|integ1|wc0|cache0) basename $d;; esac; done | tr '\n' '|')
disks=${disks%|}
# vm_quiet: waits until no dm device of the scenario has moved for 3 s (commit timers fired).
vm_quiet() { vm_until "the dm_copy disks never went quiet" dm_copy_still; }
dm_copy_still() { a=$(grep -E " ($disks) " /proc/diskstats); sleep 3; [ "$a" = "$(grep -E " ($disks) " /proc/diskstats)" ]; }
vm_quiet
trace_start dm_copy_snoop snoop --json --device snaporig --device snap0 --device integ0 --device integ1 --device wc0 --device cache0
trace_start dm_copy_report_json report --json --duration 600 --device snaporig --device snap0 --device integ0 \
    --device integ1 --device wc0 --device cache0
diskstats dm_copy_diskstats_before "$disks"
/bin/iogen /dev/mapper/snaporig write 100 4096 2
/bin/iogen /dev/mapper/snap0 read 100 4096 2
for d in integ0 integ1 wc0 cache0; do
    /bin/iogen /dev/mapper/$d write 100 4096 2
    /bin/iogen /dev/mapper/$d read 100 4096 2
done
vm_quiet
diskstats dm_copy_diskstats_after "$disks"
for t in dm_copy_snoop dm_copy_report_json; do trace_stop $t; done
for t in dm_copy_snoop dm_copy_report_json dm_copy_diskstats_before dm_copy_diskstats_after; do emit $t; done
for d in cache0 wc0 integ1 integ0 snaporig snap0; do dmsetup remove $d || echo "VM-WARNING dmsetup remove $d failed"; done"#;

/// qemu's real drivers (see `REAL_DISKS` in vm/qemu.rs): a plain NVMe namespace, a virtio-scsi
/// disk, a virtio-blk disk, and an NVMe multipath head over two path disks. One round per
/// scheduler (none, mq-deadline, kyber, bfq, on every request-based disk and path), each with
/// its own multipath I/O policy, and each traced whole: `report` of every device, `report` of
/// the head alone (which brings its paths), and `snoop` of every IO; /proc/diskstats before and
/// after each round is what the host compares the counts with.
const REAL_DRIVERS: &str = r#"# The drivers probe asynchronously: wait for both paths, then name the disks from sysfs.
vm_until "the two NVMe paths never appeared" sh -c '[ "$(ls -d /sys/block/nvme*c*n* 2>/dev/null | wc -l)" = 2 ]'
vm_until "the virtio disks never appeared" sh -c '[ -b /dev/sda ] && [ -b /dev/vda ]'
paths=$(for p in /sys/block/nvme*c*n*; do basename $p; done | tr '\n' ' ')
path1=${paths%% *}
head=$(echo $path1 | sed 's/c[0-9]*n/n/')
plain=$(for d in /sys/block/nvme*n*; do n=$(basename $d); case $n in *c*|$head) ;; *) echo $n;; esac; done | head -1)
subsys=$(basename $(readlink /sys/block/$head/device))
vm_until "/dev/$head never appeared" test -b /dev/$head
disks=$(echo $plain sda vda $head $paths | tr ' ' '|')
echo "real disks: plain=$plain head=$head paths=$paths subsystem=$subsys policies=$(cat /sys/class/nvme-subsystem/$subsys/iopolicy)"
round=0
for sched in none mq-deadline kyber bfq; do
    round=$((round + 1))
    case $sched in
        mq-deadline) policy=numa;; kyber) policy=queue-depth;; *) policy=round-robin;;
    esac
    echo $policy > /sys/class/nvme-subsystem/$subsys/iopolicy 2>/dev/null || policy=round-robin
    echo $policy > /sys/class/nvme-subsystem/$subsys/iopolicy
    for d in $plain sda vda $paths; do
        echo $sched > /sys/block/$d/queue/scheduler || vm_fail "scheduler $sched on $d"
    done
    echo "round $round: scheduler $sched, policy $(cat /sys/class/nvme-subsystem/$subsys/iopolicy)"
    trace_start real_drivers_${round}_report report --json --duration 600
    trace_start real_drivers_${round}_head report --json --duration 600 --device $head
    trace_start real_drivers_${round}_snoop snoop --json
    diskstats real_drivers_${round}_before "$disks"
    for d in $plain sda vda $head; do
        /bin/iogen /dev/$d read 60 4096 2
        /bin/iogen /dev/$d write 40 4096 2
    done
    for d in $plain sda vda $paths; do vm_idle $d; done
    diskstats real_drivers_${round}_after "$disks"
    for t in real_drivers_${round}_report real_drivers_${round}_head real_drivers_${round}_snoop; do trace_stop $t; done
    echo "VM-RESULT-BEGIN real_drivers_${round}_setup"
    echo "scheduler=$sched policy=$policy head_iostats=$(cat /sys/block/$head/queue/iostats) plain=$plain head=$head paths=$paths"
    echo "VM-RESULT-END real_drivers_${round}_setup"
    for t in real_drivers_${round}_before real_drivers_${round}_after real_drivers_${round}_report real_drivers_${round}_head real_drivers_${round}_snoop; do emit $t; done
done"#;

/// NVMe multipath under controller resets: 3000 reads at qd 16 on the head (round-robin over
/// both paths) while one path's controller is reset three times, with requests in flight
/// (qemu's null device takes 2 ms per IO here). IO moves to the other path while the
/// controller resets; qemu completes what it holds before the reset ends. Then 512 adjacent
/// writes, merged on their path.
const NVME_FAILOVER: &str = r#"vm_until "the two NVMe paths never appeared" sh -c '[ "$(ls -d /sys/block/nvme*c*n* 2>/dev/null | wc -l)" = 2 ]'
paths=$(for p in /sys/block/nvme*c*n*; do basename $p; done | tr '\n' ' ')
path1=${paths%% *}
head=$(echo $path1 | sed 's/c[0-9]*n/n/')
subsys=$(basename $(readlink /sys/block/$head/device))
ctrl=$(basename $(readlink -f /sys/block/$path1/device))
vm_until "/dev/$head never appeared" test -b /dev/$head
echo round-robin > /sys/class/nvme-subsystem/$subsys/iopolicy
disks=$(echo $head $paths | tr ' ' '|')
echo "VM-RESULT-BEGIN nvme_failover_setup"
echo "head=$head paths=$paths reset=$ctrl"
echo "VM-RESULT-END nvme_failover_setup"
trace_start nvme_failover_snoop snoop --json --device $head
trace_start nvme_failover_report report --json --duration 600 --device $head
diskstats nvme_failover_before "$disks"
/bin/iogen /dev/$head read 3000 4096 16 > /tmp/nvme_failover_iogen.out &
io=$!
for i in 1 2 3; do
    # Once the controller's path has requests in flight, reset it (the write returns when the
    # controller is live again).
    vm_until "no IO on $path1" sh -c "! kill -0 $io 2>/dev/null || ! grep -q '^ *0 *0$' /sys/block/$path1/inflight"
    kill -0 $io 2>/dev/null || break
    echo 1 > /sys/class/nvme/$ctrl/reset_controller || echo "VM-WARNING reset of $ctrl failed"
    echo "reset $i of $ctrl: $(cat /sys/class/nvme/$ctrl/state)"
done
wait $io || echo "VM-WARNING iogen on $head failed"
for d in $paths; do vm_idle $d; done
diskstats nvme_failover_after "$disks"
for t in nvme_failover_snoop nvme_failover_report; do trace_stop $t; done
for t in nvme_failover_iogen nvme_failover_before nvme_failover_after nvme_failover_snoop nvme_failover_report; do emit $t; done
# snoop's log (lost events, traced devices that changed), for the test's failure messages.
echo "VM-RESULT-BEGIN nvme_failover_snoop_log"
tail -n 40 /tmp/nvme_failover_snoop.err
echo "VM-RESULT-END nvme_failover_snoop_log"
# Merges on a path: 512 writes in rounds of 32 adjacent ones, each round in one io_submit,
# all down one path (numa), whose plug merges bios that came from the head.
echo numa > /sys/class/nvme-subsystem/$subsys/iopolicy
trace_start nvme_failover_merge_snoop snoop --json --device $head
trace_start nvme_failover_merge_report report --json --duration 600 --device $head
diskstats nvme_failover_merge_before "$disks"
/bin/iogen /dev/$head write 512 4096 32 merge > /tmp/nvme_failover_merge_iogen.out || echo "VM-WARNING iogen merge on $head failed"
for d in $paths; do vm_idle $d; done
diskstats nvme_failover_merge_after "$disks"
for t in nvme_failover_merge_snoop nvme_failover_merge_report; do trace_stop $t; done
for t in nvme_failover_merge_iogen nvme_failover_merge_before nvme_failover_merge_after nvme_failover_merge_snoop nvme_failover_merge_report; do emit $t; done"#;

/// NVMe multipath over NVMe/TCP on loopback (the kernel's own target, nvmet): one namespace
/// (nullb5: 50 ms a read, so requests stay in flight) behind two ports, both ANA-optimized, one
/// controller each, round-robin. 2000 reads at qd 16 on the head (about 6 s) while port 1 is removed and added back (its connection drops with
/// requests in flight), then its ANA group is made inaccessible and optimized again four
/// times (a command that reaches the target through an inaccessible port fails with an ANA
/// status). Either way NVMe sends the bio down the other path: a failover, not a drain.
const NVME_ANA: &str = r#"grep -q ' /sys/kernel/config ' /proc/mounts || mount -t configfs configfs /sys/kernel/config
ip link set lo up
cfs=/sys/kernel/config/nvmet
nqn=tracerd-ana
mkdir $cfs/subsystems/$nqn && echo 1 > $cfs/subsystems/$nqn/attr_allow_any_host || vm_fail "nvmet subsystem"
mkdir $cfs/subsystems/$nqn/namespaces/1
echo /dev/nullb5 > $cfs/subsystems/$nqn/namespaces/1/device_path
echo 1 > $cfs/subsystems/$nqn/namespaces/1/enable || vm_fail "nvmet namespace on nullb5"
for p in 1 2; do
    mkdir $cfs/ports/$p
    echo tcp > $cfs/ports/$p/addr_trtype
    echo ipv4 > $cfs/ports/$p/addr_adrfam
    echo 127.0.0.1 > $cfs/ports/$p/addr_traddr
    echo 442$p > $cfs/ports/$p/addr_trsvcid
    ln -s $cfs/subsystems/$nqn $cfs/ports/$p/subsystems/$nqn || vm_fail "nvmet port $p"
    # A lost connection is retried every second (the default is 10 s).
    echo "transport=tcp,traddr=127.0.0.1,trsvcid=442$p,nqn=$nqn,reconnect_delay=1" > /dev/nvme-fabrics \
        || vm_fail "connect to port $p"
done
ana_subsys() { for s in /sys/class/nvme-subsystem/*; do [ "$(cat $s/subsysnqn 2>/dev/null)" = $nqn ] && basename $s; done; }
ana_has_subsys() { [ -n "$(ana_subsys)" ]; }
vm_until "the NVMe/TCP subsystem never appeared" ana_has_subsys
subsys=$(ana_subsys)
ana_paths() { ls -d /sys/class/nvme-subsystem/$subsys/nvme*/nvme*c*n* 2>/dev/null | xargs -n1 basename | sort -u; }
ana_two_paths() { [ "$(ana_paths | wc -l)" = 2 ]; }
vm_until "the two NVMe/TCP paths never appeared" ana_two_paths
paths=$(ana_paths | tr '\n' ' ')
head=$(echo ${paths%% *} | sed 's/c[0-9]*n/n/')
vm_until "/dev/$head never appeared" test -b /dev/$head
echo round-robin > /sys/class/nvme-subsystem/$subsys/iopolicy
# Whatever the kernel reads of a new disk (its partition table), before tracing.
/bin/iogen /dev/$head read 1 4096 1 > /dev/null
disks=$(echo $head $paths | tr ' ' '|')
echo "VM-RESULT-BEGIN nvme_ana_setup"
echo "head=$head paths=$paths"
echo "VM-RESULT-END nvme_ana_setup"
trace_start nvme_ana_snoop snoop --json --device $head
trace_start nvme_ana_report report --json --duration 600 --device $head
diskstats nvme_ana_before "$disks"
/bin/iogen /dev/$head read 2000 4096 16 > /tmp/nvme_ana_iogen.out &
io=$!
path1=${paths%% *}
# Port 1 goes away with requests in flight on its path (the target drops the connection: they
# fail over), and comes back; then its ANA group flips inaccessible and back four times.
vm_until "no IO on $path1" sh -c "! kill -0 $io 2>/dev/null || ! grep -q '^ *0 *0$' /sys/block/$path1/inflight"
rm $cfs/ports/1/subsystems/$nqn
sleep 1
ln -s $cfs/subsystems/$nqn $cfs/ports/1/subsystems/$nqn
for i in 1 2 3 4; do
    kill -0 $io 2>/dev/null || break
    echo inaccessible > $cfs/ports/1/ana_groups/1/ana_state
    sleep 0.5
    echo optimized > $cfs/ports/1/ana_groups/1/ana_state
    sleep 0.5
done
wait $io || echo "VM-WARNING iogen on $head failed"
for d in $paths; do vm_idle $d; done
diskstats nvme_ana_after "$disks"
for t in nvme_ana_snoop nvme_ana_report; do trace_stop $t; done
for t in nvme_ana_iogen nvme_ana_before nvme_ana_after nvme_ana_snoop nvme_ana_report; do emit $t; done
for c in /sys/class/nvme-subsystem/$subsys/nvme*; do [ -e $c/delete_controller ] && echo 1 > $c/delete_controller; done
for p in 1 2; do rm $cfs/ports/$p/subsystems/$nqn; rmdir $cfs/ports/$p; done
echo 0 > $cfs/subsystems/$nqn/namespaces/1/enable
rmdir $cfs/subsystems/$nqn/namespaces/1 $cfs/subsystems/$nqn || echo "VM-WARNING nvmet teardown failed""#;

/// The host-kernel integration tests (tests/tests/host_kernel.rs), on this second kernel. fio
/// is not in the guest (its libraries are ~80 MB): that one test says so and skips.
const HOST_KERNEL: &str = r#"mkdir -p /dev/shm && mount -t tmpfs tmpfs /dev/shm
# /metrics is served on loopback: bring it up (the VM has no other interface).
ip link set lo up
echo "VM-RESULT-BEGIN host_kernel"
TRACERD_BIN=/bin/tracerd TRACERD_TEST_NO_FIO=1 PATH=/usr/local/sbin:/usr/local/bin:$PATH \
    /t/deps/host_kernel --test-threads=1 --show-output 2>&1
echo "host tests exit status: $?"
echo "VM-RESULT-END host_kernel""#;

/// The cgroup tests (tests/tests/cgroups.rs) on cgroup v2 with the io and memory
/// controllers, which they mount and turn on (the host has v1 blkio: no cgroup writeback).
const CGROUPS: &str = r#"mkdir -p /dev/shm && mountpoint -q /dev/shm || mount -t tmpfs tmpfs /dev/shm
ip link set lo up
echo "VM-RESULT-BEGIN cgroups"
TRACERD_BIN=/bin/tracerd TRACERD_TEST_NO_TMUX=1 PATH=/usr/local/sbin:/usr/local/bin:$PATH \
    /t/deps/cgroups --test-threads=1 --show-output 2>&1
echo "cgroup tests exit status: $?"
echo "VM-RESULT-END cgroups""#;

/// The causes tests (tests/tests/causes.rs) on this kernel: its scheduler and interrupt
/// tracepoints, its tag wait path, loop devices short of tags. Then seed 000's array: md raid1
/// with an internal bitmap (md5 over ram27, ram28), 20 writes half a second apart, with md's
/// default safe mode delay (0.2 s: each write finds the array clean and waits for md to mark it
/// dirty in both superblocks) and with it raised to 60 s (the control), then four writes in one
/// plug whose third sleeps in a suspended range (raid1 hands the plugged member writes of the
/// first two to its thread). Then who went ahead: a
/// quiet reader and a flood from another cgroup on a null_blk disk behind mq-deadline.
const CAUSES: &str = r#"ip link set lo up
mkdir -p /dev/shm && mountpoint -q /dev/shm || mount -t tmpfs tmpfs /dev/shm
echo "VM-RESULT-BEGIN causes"
TRACERD_BIN=/bin/tracerd PATH=/usr/local/sbin:/usr/local/bin:$PATH /t/deps/causes --test-threads=1 2>&1
echo "causes tests exit status: $?"
echo "VM-RESULT-END causes"
mdadm --create /dev/md5 --run --force --level=1 --raid-devices=2 --metadata=1.2 --bitmap=internal \
    --assume-clean /dev/ram27 /dev/ram28 || vm_fail "mdadm --create /dev/md5"
spaced_writes() { for i in $(seq 20); do /bin/iogen /dev/md5 write 1 4096 1 > /dev/null; sleep 0.5; done; }
cat /sys/block/md5/md/safe_mode_delay > /tmp/causes_md_delay.out
trace_start causes_md_safe_mode snoop --json --causes --device md5
spaced_writes
trace_stop causes_md_safe_mode
echo 60 > /sys/block/md5/md/safe_mode_delay
/bin/iogen /dev/md5 write 1 4096 1 > /dev/null
vm_until "md5 never left the clean state" grep -q '^active' /sys/block/md5/md/array_state
trace_start causes_md_control snoop --json --causes --device md5
spaced_writes
trace_stop causes_md_control
# A hand-off to md's thread: raid1 keeps member writes on the submitter's plug and hands them to
# md5_raid1 when the submitter sleeps with them still there. Four adjacent writes in one
# io_submit (a plug), the third's sectors suspended: it sleeps in md_handle_request, and the
# member writes of the first two go to the thread. The range is lifted once those are done.
echo 24 > /sys/block/md5/md/suspend_hi && echo 17 > /sys/block/md5/md/suspend_lo || vm_fail "md5 suspend range"
# (RAM disks keep no IO statistics: snoop's lines say when the first two writes completed.)
md5_done() { [ "$(grep -c '"device":"md5"' /tmp/causes_md_handoff.out)" -ge 2 ]; }
trace_start causes_md_handoff snoop --json --causes --device md5
/bin/iogen /dev/md5 write 4 4096 4 merge > /dev/null &
gen=$!
vm_until "the writes to md5 before its suspended range never completed" md5_done
echo 0 > /sys/block/md5/md/suspend_hi && echo 0 > /sys/block/md5/md/suspend_lo || vm_fail "lift md5's suspend range"
wait $gen || vm_fail "iogen on md5 with a suspended range"
trace_stop causes_md_handoff
for t in causes_md_delay causes_md_safe_mode causes_md_control causes_md_handoff; do emit $t; done
mdadm --stop /dev/md5 || echo "VM-WARNING mdadm --stop /dev/md5 failed"
# Who went ahead: two cgroups on nullb4 behind mq-deadline (64 driver tags, 50 ms a read, so
# requests wait in the scheduler): 20 reads one at a time from one alone (the control), then
# beside a flood of 256 reads in flight from the other, started first, stopped once they are done.
# (busybox has no `mountpoint`; the cgroups scenario may have mounted it already)
grep -q ' /sys/fs/cgroup cgroup2 ' /proc/mounts || mount -t cgroup2 none /sys/fs/cgroup || vm_fail "mount cgroup2"
mkdir -p /sys/fs/cgroup/flood /sys/fs/cgroup/quiet
# in_cgroup CGROUP COMMAND...: the command as a process of its own inside CGROUP ($! is its pid).
in_cgroup() { cg=$1; shift; exec sh -c "echo \$\$ > /sys/fs/cgroup/$cg/cgroup.procs && exec \"\$@\"" sh "$@"; }
scheduler=$(sed 's/.*\[\(.*\)\].*/\1/' /sys/block/nullb4/queue/scheduler)
echo mq-deadline > /sys/block/nullb4/queue/scheduler || vm_fail "mq-deadline on nullb4"
trace_start causes_ahead_alone report --json --causes --duration 600 --device nullb4
(in_cgroup quiet /bin/iogen /dev/nullb4 read 20 4096 1 > /dev/null)
trace_stop causes_ahead_alone
trace_start causes_ahead_flood report --json --causes --duration 600 --device nullb4
(in_cgroup flood /bin/iogen /dev/nullb4 read 100000000 4096 256 > /dev/null) &
flood=$!
reads_from() { [ "$(awk '{print $1}' /sys/block/nullb4/stat)" -ge $(($1 + 500)) ]; }
vm_until "the flood on nullb4 never started" reads_from "$(awk '{print $1}' /sys/block/nullb4/stat)"
(in_cgroup quiet /bin/iogen /dev/nullb4 read 20 4096 1 > /dev/null)
kill -0 $flood && echo "the flood outlasted the quiet reads" > /tmp/causes_ahead_outlasted.out
kill $flood; wait $flood
trace_stop causes_ahead_flood
echo "$scheduler" > /sys/block/nullb4/queue/scheduler
rmdir /sys/fs/cgroup/flood /sys/fs/cgroup/quiet
for t in causes_ahead_alone causes_ahead_flood causes_ahead_outlasted; do emit $t; done"#;

/// What tracerd sees in this kernel, for the log and tests/tests/vm/doctor.rs: `doctor` with its load
/// test (BTF, layout paths, each hook's variant and attach type, kprobes), as text and JSON.
const DOCTOR: &str = r#"/bin/tracerd doctor --json > /tmp/doctor_json.out 2> /tmp/doctor_json.err
echo "tracerd doctor exit status: $?"
/bin/tracerd doctor > /tmp/doctor_text.out 2>&1
for t in doctor_json doctor_text; do emit $t; done"#;

/// Proves the chain: the devices exist, iogen and tracerd run, and tracerd reports on nullb0.
const SMOKE: &str = r#"echo "block devices: $(ls /sys/block | tr '\n' ' ')"
/bin/iogen /dev/nullb0 read 100 4096 1
/bin/tracerd --version
/bin/tracerd report --duration 600 --json --device nullb0 >/tmp/report.json 2>/tmp/report.err &
report=$!
# Loading takes a second or more under TCG: start the IO once tracerd says it is attached, and
# end the capture once the IO is done (the report drains every record before it exits).
vm_wait_for /tmp/report.err "attached [0-9]* hooks" $report
/bin/iogen /dev/nullb0 read 500 4096 4
kill -INT $report
wait $report
echo "tracerd report exit status: $?"
echo "VM-RESULT-BEGIN smoke"
cat /tmp/report.json
echo "VM-RESULT-END smoke"
echo "--- tracerd report stderr:"
cat /tmp/report.err
echo "--- end of tracerd report stderr""#;

/// A scenario: its name (for `--scenario`, the guest's `scenarios=` and its result sections),
/// the modules it needs (without one the guest says `VM-SKIPPED` and the tests skip) and its
/// shell body.
pub struct Scenario {
    pub name: &'static str,
    pub needs: &'static [&'static str],
    body: &'static str,
}

/// Every scenario, in the order the guest runs them.
pub const SCENARIOS: &[Scenario] = &[
    Scenario { name: "smoke", needs: &["null_blk"], body: SMOKE },
    Scenario { name: "doctor", needs: &[], body: DOCTOR },
    Scenario { name: "dm_linear", needs: &["brd", "dm-mod"], body: DM_LINEAR },
    Scenario {
        name: "dm_deferred",
        needs: &["brd", "dm-mod", "dm-crypt", "dm-delay", "dm-thin-pool"],
        body: DM_DEFERRED,
    },
    Scenario {
        name: "dm_copy",
        needs: &["brd", "dm-mod", "dm-snapshot", "dm-integrity", "dm-writecache", "dm-cache", "dm-cache-smq"],
        body: DM_COPY,
    },
    Scenario { name: "md", needs: &["brd", "raid0", "raid1", "raid10"], body: MD },
    Scenario { name: "md_parity", needs: &["brd", "raid456", "dm-mod", "dm-crypt"], body: MD_PARITY },
    Scenario { name: "null_blk", needs: &["null_blk"], body: NULL_BLK },
    Scenario {
        name: "dm_multipath",
        needs: &["dm-mod", "dm-multipath", "dm-round-robin", "null_blk"],
        body: DM_MULTIPATH,
    },
    Scenario {
        name: "real_drivers",
        needs: &["nvme", "virtio_pci", "virtio_blk", "virtio_scsi", "sd_mod", "kyber-iosched", "bfq"],
        body: REAL_DRIVERS,
    },
    Scenario { name: "nvme_failover", needs: &["nvme", "virtio_pci"], body: NVME_FAILOVER },
    Scenario { name: "nvme_ana", needs: &["null_blk", "nvmet", "nvmet-tcp", "nvme-tcp"], body: NVME_ANA },
    Scenario { name: "host_kernel", needs: &["loop"], body: HOST_KERNEL },
    Scenario { name: "cgroups", needs: &["loop"], body: CGROUPS },
    Scenario { name: "causes", needs: &["loop", "brd", "raid1", "null_blk"], body: CAUSES },
];

/// Every scenario's name, in order.
pub fn names() -> Vec<&'static str> {
    SCENARIOS.iter().map(|s| s.name).collect()
}

/// The guest's text for every scenario, in order; smoke runs before [`HELPERS`]: it proves the
/// bare chain (the prologue's devices, iogen and tracerd) with nothing of the scenarios' own.
pub fn script() -> String {
    let (smoke, rest) = SCENARIOS.split_first().expect("the smoke scenario");
    let wrapped = |s: &Scenario| scenario(s.name, s.needs, s.body);
    [wrapped(smoke), HELPERS.to_string()].into_iter().chain(rest.iter().map(wrapped)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the host reads of a scenario (its trace outputs, diskstats snapshots and result
    /// sections) is named after it, so that its name alone finds its output and its tests.
    #[test]
    fn every_result_is_named_after_its_scenario() {
        for s in SCENARIOS {
            let ours = |name: &str| name == s.name || name.starts_with(&format!("{}_", s.name));
            for line in s.body.lines() {
                let words: Vec<&str> = line.split_whitespace().collect();
                let named: Vec<&str> = match words.as_slice() {
                    ["trace_start" | "diskstats", name, ..] => vec![name],
                    ["echo", "\"VM-RESULT-BEGIN", name] => vec![name.trim_end_matches('"')],
                    ["for", "t", "in", rest @ ..] if line.contains("emit $t") => {
                        rest.iter().map(|w| w.trim_end_matches(';')).take_while(|w| *w != "do").collect()
                    }
                    _ => vec![],
                };
                for name in named {
                    assert!(ours(name), "scenario {}: {name} in: {line}", s.name);
                }
            }
        }
        let mut names = names();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), SCENARIOS.len(), "scenario names are unique");
    }
}
