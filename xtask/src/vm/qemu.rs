//! qemu: the command line (TCG, the emulated disks) and one boot, its console captured, cleaned
//! and checked for a hang, a crash or a qemu error.

use std::{
    fs,
    io::{Read, Write},
    path::Path,
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use xtask::vm::console::{kernel_crash, tail};

use super::{kernel::VmKernel, out_dir};

/// qemu's emulated disks, each backed by qemu's null driver (reads return zeros, writes are
/// dropped: no image files): a plain NVMe namespace, one namespace shared by two controllers of
/// one NVMe subsystem (native multipath: a head disk over two hidden path disks; qemu wants
/// one serial for a subsystem's controllers), a virtio-scsi
/// disk and a virtio-blk disk.
const REAL_DISKS: &[&str] = &[
    "-blockdev",
    "driver=null-co,node-name=nvme_plain,size=67108864,read-zeroes=on",
    "-device",
    "nvme,serial=tracerd-plain,drive=nvme_plain",
    "-device",
    "nvme-subsys,id=mpath,nqn=tracerd-mpath",
    "-device",
    "nvme,serial=tracerd-mpath,subsys=mpath",
    "-device",
    "nvme,serial=tracerd-mpath,subsys=mpath",
    "-blockdev",
    // 2 ms per IO: a controller reset finds requests in flight.
    "driver=null-co,node-name=nvme_shared,size=67108864,read-zeroes=on,latency-ns=2000000",
    "-device",
    "nvme-ns,drive=nvme_shared,nsid=1,shared=on",
    "-device",
    "virtio-scsi-pci,id=scsi0",
    "-blockdev",
    "driver=null-co,node-name=scsi_disk,size=67108864,read-zeroes=on",
    "-device",
    "scsi-hd,drive=scsi_disk,bus=scsi0.0",
    "-blockdev",
    "driver=null-co,node-name=virtio_disk,size=67108864,read-zeroes=on",
    "-device",
    "virtio-blk-pci,drive=virtio_disk",
];

/// Boots `kernel` with `initramfs` and returns the serial console (kernel messages and the output
/// of /init, without carriage returns or terminal escapes), also written to
/// `target/vm/<initramfs name>.log`. Words `key=value` in
/// `cmdline_extra` reach /init as environment variables. Fails on a timeout (qemu is killed), a
/// kernel panic, BUG or oops, or a qemu error, with the console lines that show it.
pub fn boot(kernel: &VmKernel, initramfs: &Path, cmdline_extra: &str, timeout: Duration) -> Result<String> {
    let stem = initramfs.file_stem().unwrap_or_default().to_string_lossy();
    boot_logged(kernel, initramfs, cmdline_extra, timeout, &out_dir().join(format!("{stem}.log")))
}

/// [`boot`], with the console log written to `log`.
pub fn boot_logged(
    kernel: &VmKernel,
    initramfs: &Path,
    cmdline_extra: &str,
    timeout: Duration,
    log: &Path,
) -> Result<String> {
    // oops=panic panic=-1 with -no-reboot: a crashed guest ends qemu instead of hanging.
    // noirqdebug: under TCG, PREEMPT_RT's threaded serial interrupt looked unhandled often enough
    // that the kernel disabled IRQ 4, printing that (an emergency message) in the middle of a
    // result line.
    let append = format!("console=ttyS0 oops=panic panic=-1 quiet noirqdebug {cmdline_extra}");
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-accel", "tcg,thread=single", "-cpu", "max", "-m", "1G", "-smp", "2"])
        .args(["-nographic", "-no-reboot", "-nic", "none"])
        .args(REAL_DISKS)
        .arg("-kernel")
        .arg(&kernel.image)
        .arg("-initrd")
        .arg(initramfs)
        .args(["-append", append.trim_end()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start qemu-system-x86_64 (apt-get install qemu-system-x86)")?;

    if let Some(dir) = log.parent() {
        fs::create_dir_all(dir)?;
    }
    let console = Arc::new(Mutex::new(Vec::new()));
    let stdout_reader = {
        let (console, mut stdout) = (console.clone(), child.stdout.take().expect("piped"));
        let mut file = fs::File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
        thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n @ 1..) = stdout.read(&mut buf) {
                let _ = file.write_all(&buf[..n]);
                console.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        })
    };
    let stderr_reader = {
        let mut stderr = child.stderr.take().expect("piped");
        thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        })
    };

    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(50));
    };
    let _ = stdout_reader.join();
    let qemu_stderr = stderr_reader.join().unwrap_or_default();
    let text = strip_escapes(&String::from_utf8_lossy(&console.lock().unwrap()));
    // The raw stream was there to follow a run live (tail -f); keep the clean text for readers.
    fs::write(log, &text).with_context(|| format!("cannot write {}", log.display()))?;
    let where_ = format!("console log: {}", log.display());

    let Some(status) = status else {
        bail!(
            "the VM did not power off within {timeout:?} and was killed. Last console lines:\n{}\n{where_}",
            tail(&text, 60)
        );
    };
    if let Some(crash) = kernel_crash(&text) {
        bail!("the guest kernel crashed:\n{crash}\n{where_}");
    }
    if !status.success() {
        bail!(
            "qemu failed ({status}): {}\nLast console lines:\n{}\n{where_}",
            qemu_stderr.trim(),
            tail(&text, 60)
        );
    }
    Ok(text)
}

/// The console without carriage returns and the terminal escapes SeaBIOS prints.
fn strip_escapes(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\r' => {}
            // CSI: ESC [ parameters, then one final byte in @..~; anything else: ESC and one char.
            '\x1b' => {
                if chars.next() == Some('[') {
                    while chars.next().is_some_and(|c| !('@'..='~').contains(&c)) {}
                }
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_are_stripped() {
        assert_eq!(strip_escapes("\x1bc\x1b[?7l\x1b[2J\x1b[0mSeaBIOS\r\nok\r\n"), "SeaBIOS\nok\n");
    }
}
