//! iogen: a small O_DIRECT IO generator with an exact count, size, op and queue depth.
//!
//! Uses Linux native AIO (io_submit) so the queue depth is held exactly, and places every IO
//! in its own slot with a gap after it, so no two IOs are adjacent and the block layer cannot
//! merge them: the number of requests the device sees equals the number issued.
//!
//! iogen DEVICE read|write COUNT SIZE QD [batch|seq|merge|scatter|hold]
//!   -> prints {"op":..,"count":..,"bytes":..,"io_ns":..} on success: `io_ns` sums each IO's
//!      time from just before its io_submit to its reaping by io_getevents
//!
//! By default a completed IO is replaced at once (QD stays in flight). With `batch`, IOs go in
//! rounds: QD submitted, all QD reaped, then the next round, so on a device that completes
//! slower than a round is submitted, the depth at issue runs 1..QD once per round. With `seq`,
//! slots go in order from the device's start, so IOs smaller than a page share pages (md
//! raid5 then writes several of them with one member write). With `merge`, the opposite of
//! the default: rounds of QD adjacent IOs (the device's start onwards, without gaps), each
//! round in one io_submit call, whose plug lets the block layer merge them into fewer requests.
//! With `scatter`, rounds of adjacent IOs as with `merge`, submitted odd positions first, then
//! even ones: no IO follows its neighbour into the plug (which merges a bio only into the last
//! request), so each gets a request, and an elevator merges those requests as it inserts them.

use std::{
    alloc::{Layout, alloc_zeroed},
    ffi::CString,
    time::Instant,
};

const IOCB_CMD_PREAD: u16 = 0;
const IOCB_CMD_PWRITE: u16 = 1;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Iocb {
    aio_data: u64,
    aio_key: u32,
    aio_rw_flags: i32,
    aio_lio_opcode: u16,
    aio_reqprio: i16,
    aio_fildes: u32,
    aio_buf: u64,
    aio_nbytes: u64,
    aio_offset: i64,
    aio_reserved2: u64,
    aio_flags: u32,
    aio_resfd: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct IoEvent {
    data: u64,
    obj: u64,
    res: i64,
    res2: i64,
}

fn die(msg: &str) -> ! {
    eprintln!("iogen: {msg}");
    std::process::exit(1)
}

fn check(ret: libc::c_long, what: &str) -> libc::c_long {
    if ret < 0 {
        die(&format!("{what}: {}", std::io::Error::last_os_error()));
    }
    ret
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 6
        && !(args.len() == 7 && matches!(args[6].as_str(), "batch" | "seq" | "merge" | "scatter" | "hold"))
    {
        die("usage: iogen DEVICE read|write COUNT SIZE QD [batch|seq|merge|scatter|hold]");
    }
    // hold: after the IOs and the summary line, wait for stdin to close, so that the process
    // (its /proc entry, which names an IO's submitter) outlives its IOs.
    let hold = args.len() == 7 && args[6] == "hold";
    let scatter = args.len() == 7 && args[6] == "scatter";
    let merge = scatter || args.len() == 7 && args[6] == "merge";
    let batch = merge || args.len() == 7 && args[6] == "batch";
    let seq = args.len() == 7 && args[6] == "seq";
    let write = match args[2].as_str() {
        "read" => false,
        "write" => true,
        other => die(&format!("op must be read or write, not {other}")),
    };
    let parse = |s: &str, what: &str| s.parse::<u64>().unwrap_or_else(|_| die(&format!("bad {what}: {s}")));
    let (count, size, qd) = (parse(&args[3], "count"), parse(&args[4], "size"), parse(&args[5], "qd"));
    if size == 0 || size % 512 != 0 || qd == 0 || qd > 1024 {
        die("SIZE must be a positive multiple of 512 and QD in 1..=1024");
    }
    let path = CString::new(args[1].as_str()).unwrap();
    let flags = libc::O_DIRECT | if write { libc::O_WRONLY } else { libc::O_RDONLY };
    // SAFETY: valid C string.
    let fd = unsafe { libc::open(path.as_ptr(), flags) };
    check(fd as libc::c_long, "open");
    // SAFETY: fd is open.
    let dev_bytes = unsafe { libc::lseek(fd, 0, libc::SEEK_END) } as u64;
    // A slot is an IO and the gap after it; `merge` has no gaps.
    let gap = if merge { 1 } else { 2 };
    let slots = dev_bytes / (gap * size);
    if slots == 0 {
        die("device too small for this IO size");
    }
    // Slot order: a fixed permutation (stride coprime with the slot count) for random-looking IO.
    let mut stride = if seq || merge { 1 } else { slots / 3 * 2 + 1 };
    while gcd(stride, slots) != 1 {
        stride += 1;
    }
    let layout = Layout::from_size_align(size.max(4096) as usize, 4096).unwrap();
    let buffers: Vec<*mut u8> = (0..qd)
        .map(|i| {
            // SAFETY: non-zero size.
            let p = unsafe { alloc_zeroed(layout) };
            // SAFETY: p points to size bytes.
            unsafe { std::ptr::write_bytes(p, i as u8 | 1, size as usize) };
            p
        })
        .collect();
    let mut ctx: libc::c_ulong = 0;
    // SAFETY: io_setup with a valid out pointer.
    check(unsafe { libc::syscall(libc::SYS_io_setup, qd as libc::c_long, &mut ctx) }, "io_setup");
    let mut iocbs = vec![Iocb::default(); qd as usize];
    let (mut submitted, mut done) = (0u64, 0u64);
    let prepare = |slot: usize, n: u64, iocbs: &mut [Iocb]| {
        iocbs[slot] = Iocb {
            aio_data: slot as u64,
            aio_lio_opcode: if write { IOCB_CMD_PWRITE } else { IOCB_CMD_PREAD },
            aio_fildes: fd as u32,
            aio_buf: buffers[slot] as u64,
            aio_nbytes: size,
            aio_offset: ((n * stride % slots) * gap * size) as i64,
            ..Default::default()
        };
    };
    // Slots `first..first + n` in one io_submit call (one plug).
    let send = |first: usize, n: usize, iocbs: &mut [Iocb]| {
        let mut ptrs: Vec<*mut Iocb> = iocbs[first..first + n].iter_mut().map(|c| c as *mut Iocb).collect();
        // SAFETY: valid iocbs whose buffers outlive the IO.
        let sent = check(
            unsafe { libc::syscall(libc::SYS_io_submit, ctx, n as libc::c_long, ptrs.as_mut_ptr()) },
            "io_submit",
        );
        if sent != n as libc::c_long {
            die(&format!("io_submit took {sent} of {n} IOs"));
        }
    };
    let submit = |slot: usize, n: u64, iocbs: &mut [Iocb]| {
        prepare(slot, n, iocbs);
        send(slot, 1, iocbs);
    };
    // A round of `n` IOs from IO number `from`: in one call with `merge`, else one by one.
    let round = |n: u64, from: u64, iocbs: &mut [Iocb]| {
        if merge {
            // The round's positions in submission order: in order, or odd ones, then even ones.
            let order: Vec<u64> =
                if scatter { (1..n).step_by(2).chain((0..n).step_by(2)).collect() } else { (0..n).collect() };
            order.iter().enumerate().for_each(|(slot, &i)| prepare(slot, from + i, iocbs));
            send(0, n as usize, iocbs);
        } else {
            (0..n).for_each(|slot| submit(slot as usize, from + slot, iocbs));
        }
    };
    let mut started = vec![Instant::now(); qd as usize];
    let mut io_ns: u128 = 0;
    round(count.min(qd), 0, &mut iocbs);
    submitted += count.min(qd);
    let mut events = vec![IoEvent::default(); qd as usize];
    while done < count {
        // SAFETY: events has room for qd entries.
        let n = check(
            unsafe {
                libc::syscall(
                    libc::SYS_io_getevents,
                    ctx,
                    1 as libc::c_long,
                    qd as libc::c_long,
                    events.as_mut_ptr(),
                    std::ptr::null_mut::<libc::timespec>(),
                )
            },
            "io_getevents",
        );
        for ev in &events[..n as usize] {
            // Every IO must transfer exactly its size: the tests compare traced bytes with these.
            assert_eq!(ev.res, size as i64, "IO {} returned {} instead of {size}", ev.data, ev.res);
            done += 1;
            io_ns += started[ev.data as usize].elapsed().as_nanos();
            if !batch && submitted < count {
                started[ev.data as usize] = Instant::now();
                submit(ev.data as usize, submitted, &mut iocbs);
                submitted += 1;
            }
        }
        // A round is over when nothing is in flight.
        if batch && done == submitted && submitted < count {
            let n = qd.min(count - submitted);
            started.fill(Instant::now());
            round(n, submitted, &mut iocbs);
            submitted += n;
        }
    }
    // SAFETY: ctx from io_setup; fd open.
    unsafe {
        libc::syscall(libc::SYS_io_destroy, ctx);
        libc::close(fd);
    }
    println!(
        "{{\"op\":\"{}\",\"count\":{count},\"size\":{size},\"bytes\":{},\"qd\":{qd},\"io_ns\":{io_ns}}}",
        args[2],
        count * size
    );
    if hold {
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}
