#!/bin/sh
# /init of tracerd's test VM, filled in by xtask/src/vm/guest.rs.
# Kernel command-line words key=value arrive here as environment variables.
export PATH=/sbin:/bin:/usr/sbin:/usr/bin
: "${scenarios:=all}" "${absent:=}" "${builtin:=}"
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mount -t debugfs debugfs /sys/kernel/debug
mount -t tracefs tracefs /sys/kernel/tracing

# poweroff -f ends qemu (-no-reboot); without it /init exits and the kernel panics.
vm_poweroff() { sync; poweroff -f; sleep 60; }
vm_fail() { echo "VM-SETUP-FAILED $*"; vm_poweroff; }
# vm_until WHAT COMMAND...: runs COMMAND until it succeeds. Nothing here may depend on how fast
# the guest runs, so the only bound is one for a hang (@HANG_S@ s): then it prints VM-HANG WHAT,
# which fails the run.
vm_until() {
    what=$1; shift
    i=0
    until "$@"; do
        if [ $i -ge @HANG_TENTHS@ ]; then echo "VM-HANG $what"; return 1; fi
        sleep 0.1; i=$((i + 1))
    done
}
# vm_wait_for FILE PATTERN PID: waits until FILE has PATTERN or process PID is gone.
vm_wait_for() {
    vm_until "no '$2' in $1" vm_has_or_gone "$@" || return 1
    grep -q "$2" "$1" 2>/dev/null || echo "VM-WARNING process $3 exited before '$2' appeared in $1"
}
vm_has_or_gone() { grep -q "$2" "$1" 2>/dev/null || ! kill -0 "$3" 2>/dev/null; }

# A leading newline: the firmware leaves the cursor at the end of its last line.
printf "\nVM-BOOTED %s scenarios=%s absent=%s\n" "$(uname -r)" "$scenarios" "$absent"
@SCENARIO_SELECTION@
# A module the kernel has built in (the command line's builtin=) is there already.
vm_load() { vm_have "$1" && ! vm_listed "$1" "$builtin" || return 0; modprobe "$@" || vm_fail "modprobe $1"; }
# ram0-1 md0, ram2 lin0, ram3 crypt0, ram4 delay0, ram5-6 the thin pool's metadata and data,
# ram7-8 md1 (raid10), ram16-17 md4 (raid0, both made by the md scenario), ram9-11 md2 (raid5)
# and ram12-15 md3 (raid6, both made by the md_parity scenario), ram18-26 the dm_copy scenario's
# targets, ram27-28 md5 (raid1 with an internal bitmap, the causes scenario).
vm_load brd rd_nr=29 rd_size=65536
vm_load raid0
vm_load raid1
vm_load raid10
vm_load dm-mod
# The thin pool's persistent data and raid456 checksum with crc32c: its implementation before
# libcrc32c.
vm_load crc32c_generic
vm_load raid456
vm_load dm-crypt
vm_load dm-delay
vm_load dm-thin-pool
vm_load dm-multipath
vm_load dm-round-robin
vm_load loop
vm_load virtio_pci
vm_load nvme
vm_load nvmet
vm_load nvmet-tcp
vm_load nvme-tcp
vm_load virtio_blk
vm_load virtio_scsi
vm_load sd_mod
vm_load kyber-iosched
vm_load bfq
# nullb0..5 for the null_blk scenario's queue depths (nullb5 then backs the nvme_ana scenario's
# NVMe/TCP namespace), nullb6 under multipath; timer completions keep requests in flight.
vm_load null_blk nr_devices=7 irqmode=2 completion_nsec=50000000 hw_queue_depth=64
# No udev in here: mdadm and dmsetup create their device nodes themselves.
export MDADM_NO_UDEV=1 DM_DISABLE_UDEV=1
devices=""
if vm_have brd raid1; then
    mdadm --create /dev/md0 --run --force --level=1 --raid-devices=2 --metadata=1.2 --assume-clean \
        /dev/ram0 /dev/ram1 || vm_fail "mdadm --create /dev/md0"
    devices="$devices ram0 ram1 md0"
fi
if vm_have brd dm-mod; then
    dmsetup create lin0 --table "0 131072 linear /dev/ram2 0" || vm_fail "dmsetup create lin0"
    devices="$devices ram2 dm-0 mapper/lin0"
fi
# Request-based dm: a one-path multipath device (dm-1) over nullb6.
if vm_have dm-mod dm-multipath dm-round-robin null_blk; then
    dmsetup create mp0 --table "0 131072 multipath 0 0 1 1 round-robin 0 1 1 /dev/nullb6 1" \
        || vm_fail "dmsetup create mp0"
    devices="$devices dm-1 mapper/mp0"
fi
vm_have null_blk && devices="$devices nullb0 nullb6"
for d in $devices; do
    [ -b /dev/$d ] || vm_fail "/dev/$d is missing"
done
echo VM-SETUP-DONE

@SCENARIOS@
echo VM-TEARDOWN
[ -b /dev/mapper/mp0 ] && dmsetup remove mp0
[ -b /dev/mapper/lin0 ] && dmsetup remove lin0
[ -b /dev/md0 ] && mdadm --stop /dev/md0
echo VM-DONE
# PREEMPT_RT writes the console from a thread: give it a moment to send the last lines before
# the power goes (the run's result is already complete; this only keeps the log whole).
sleep 1
vm_poweroff
