//! When to rescan sysfs for block devices. A scan reads about twenty sysfs files per device,
//! which on a host with dozens of disks is most of an idle agent's CPU; so the agent listens to
//! the kernel's device events (`NETLINK_KOBJECT_UEVENT`, the socket udev reads) and rescans
//! when a block device is added, removed or changed, shortly after, and every
//! [`FULL_RESCAN_TICKS`] in case a change came without an event.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

/// Ticks between rescans when no event came: a change that sends no uevent (an md member
/// added to a running array, a dm table reloaded in place) is seen within this many.
pub const FULL_RESCAN_TICKS: u32 = 10;
/// Ticks rescanned after an event: a stacked device's lowers (`slaves/`) appear just after it.
pub const SETTLE_TICKS: u32 = 3;

/// The kernel's uevent multicast group (udev re-sends processed events on group 2).
const KERNEL_GROUP: u32 = 1;

/// A non-blocking uevent socket, read once per tick.
pub struct Uevents {
    fd: OwnedFd,
    buf: Vec<u8>,
}

impl Uevents {
    /// Joins the kernel's uevent group (no privilege needed).
    pub fn open() -> io::Result<Uevents> {
        // SAFETY: socket(2) with constant arguments; the fd is owned at once.
        let raw = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                libc::NETLINK_KOBJECT_UEVENT,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: an all-zero sockaddr_nl is valid; the fields that matter are set below.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        addr.nl_groups = KERNEL_GROUP;
        // SAFETY: `addr` is a sockaddr_nl of the size given.
        let bound = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const addr).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if bound < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Uevents { fd, buf: vec![0; 16 << 10] })
    }

    /// Reads every event that arrived; true if one was a block device's, or if events were
    /// dropped (the socket's buffer overflowed) or the socket failed: then nothing is known.
    pub fn block_changed(&mut self) -> bool {
        let mut changed = false;
        loop {
            // SAFETY: recv(2) into our own buffer, at most its length.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), self.buf.as_mut_ptr().cast(), self.buf.len(), 0) };
            if n < 0 {
                match io::Error::last_os_error().raw_os_error() {
                    Some(libc::EAGAIN) => return changed,
                    Some(libc::EINTR) => continue,
                    // ENOBUFS: events were dropped; read on, and rescan.
                    Some(libc::ENOBUFS) => changed = true,
                    _ => return true,
                }
                continue;
            }
            changed |= is_block_event(&self.buf[..n as usize]);
        }
    }
}

/// Whether a uevent (`ACTION@DEVPATH\0KEY=VALUE\0...`) concerns a block device.
pub fn is_block_event(msg: &[u8]) -> bool {
    msg.split(|&b| b == 0).any(|field| field == b"SUBSYSTEM=block")
}

/// Decides, tick by tick, whether sysfs is scanned.
#[derive(Debug, Default)]
pub struct Rescan {
    since_scan: u32,
    settle: u32,
}

impl Rescan {
    /// `changed`: what the uevents said since the last tick, None without them (then every
    /// tick scans).
    pub fn due(&mut self, changed: Option<bool>) -> bool {
        let Some(changed) = changed else { return true };
        if changed {
            self.settle = SETTLE_TICKS;
        }
        self.since_scan += 1;
        let due = self.settle > 0 || self.since_scan >= FULL_RESCAN_TICKS;
        if due {
            self.since_scan = 0;
            self.settle = self.settle.saturating_sub(1);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_events_are_told_from_others() {
        let add = b"add@/devices/virtual/block/loop9\0ACTION=add\0DEVPATH=/devices/virtual/block/loop9\0SUBSYSTEM=block\0DEVNAME=loop9\0DEVTYPE=disk\0SEQNUM=4711\0";
        let net = b"add@/devices/virtual/net/veth0\0ACTION=add\0SUBSYSTEM=net\0INTERFACE=veth0\0";
        let tricky = b"change@/x\0ACTION=change\0SUBSYSTEM=block_extra\0DEVNAME=SUBSYSTEM=block\0";
        assert!(is_block_event(add));
        assert!(!is_block_event(net));
        assert!(!is_block_event(tricky), "only the SUBSYSTEM field itself counts");
    }

    #[test]
    fn without_events_every_tick_scans() {
        let mut r = Rescan::default();
        assert!((0..5).all(|_| r.due(None)));
    }

    #[test]
    fn events_scan_for_a_few_ticks_and_quiet_scans_now_and_then() {
        let mut r = Rescan::default();
        let quiet: Vec<bool> = (0..2 * FULL_RESCAN_TICKS).map(|_| r.due(Some(false))).collect();
        assert_eq!(quiet.iter().filter(|&&d| d).count(), 2, "one scan per {FULL_RESCAN_TICKS} quiet ticks");
        assert!(quiet[FULL_RESCAN_TICKS as usize - 1] && quiet[2 * FULL_RESCAN_TICKS as usize - 1]);
        assert!(r.due(Some(true)), "an event: scan at once");
        for _ in 1..SETTLE_TICKS {
            assert!(r.due(Some(false)), "and on the ticks after it, for the lowers that follow");
        }
        assert!(!r.due(Some(false)), "then quiet again");
        // An event during the settle window extends it.
        assert!(r.due(Some(true)) && r.due(Some(true)) && r.due(Some(false)));
    }
}
