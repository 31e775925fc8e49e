//! The flight recorder's memory over its whole window, and what a view's window costs the
//! agent: 8 busy devices, each reading and writing, one frame a second for the default hour,
//! every frame holding 20,000 IOs per device and op with stages spread as a saturated loop
//! device spreads them (hundreds of ns to hundreds of µs), folded in as the kernel's counts
//! are (`run`'s default). Prints the bytes the frames take against the default bound, and the
//! time to add up the last 10 minutes and the whole hour. Then the same hour written to a
//! store on disk (under the temp directory, removed after) as the agent writes it, one frame
//! a second with a sync every 5: the write cost per frame, the bytes on disk, a day of them
//! against the store's default bound, and the time to read the hour back from disk.
//!
//! cargo bench -p tracerd --bench recorder

use std::time::Instant;

use tracer_common::{IoRecord, SeriesAgg, event, kind};
use tracerd::{
    model::{
        aggregate::Lost,
        op::Op,
        recorder::{FrameBuilder, Recorder, RecorderLimits},
        series::Series,
        topology::Device,
    },
    store::{Store, StoreLimits},
};

const DEVICES: u32 = 8;
const IOS_PER_SERIES: u64 = 20_000;
/// Distinct IOs a series' frame is drawn from; each counts IOS_PER_SERIES / SAMPLE times,
/// which gives the buckets and counts of that many IOs of the same spread.
const SAMPLE: u64 = 500;

fn main() {
    let limits = RecorderLimits::default();
    let frames = limits.retention.as_secs() / limits.resolution.as_secs();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut recorder = Recorder::new(limits);
    let mut builder = FrameBuilder::default();
    let mut rec = IoRecord { kind: kind::REQUEST, bytes: 4096, ..Default::default() };
    for f in 0..frames {
        for dev in 1..=DEVICES {
            for op in [Op::Read, Op::Write] {
                let mut counted = SeriesAgg::default();
                for _ in 0..SAMPLE {
                    let q = 1_000_000_000;
                    rec.queue_depth = 1 + (next() % 32) as u32;
                    rec.ts[event::Q] = q;
                    rec.ts[event::G] = q + 200 + next() % 500;
                    rec.ts[event::D] = rec.ts[event::G] + 300 + next() % 2000;
                    // Log-spread device time: 5 µs to about 330 µs.
                    rec.ts[event::C] = rec.ts[event::D] + (5_000 << (next() % 7)) + next() % 5_000;
                    counted.add_record(&rec, &[]);
                }
                builder.add_kernel(dev, op, &scaled(&counted, IOS_PER_SERIES / SAMPLE));
            }
        }
        let start = 1_764_500_000_000 + f * 1000;
        recorder.push(builder.seal(start, start + 1000, &Lost::default()), []);
    }
    let (first, last) = recorder.span().expect("frames");
    let bytes = recorder.bytes();
    let mut timed = |span_ms: u64| {
        let t = Instant::now();
        let (agg, _) = recorder.window(last - span_ms, last).aggregate().expect("frames decode");
        let requests: u64 = agg.series.values().map(|s| s.requests).sum();
        assert_eq!(requests, span_ms / 1000 * DEVICES as u64 * 2 * IOS_PER_SERIES);
        t.elapsed().as_secs_f64() * 1e3
    };
    let (ten_minutes, hour) = (timed(600_000), timed(last - first));
    println!(
        "recorder: {DEVICES} devices x read+write, {frames} frames of 1 s ({} kept, {:.0} s): {:.1} MiB, \
         {:.0} bytes per device, op and frame; bound {:.0} MiB: {}",
        recorder.len(),
        (last - first) as f64 / 1e3,
        bytes as f64 / (1 << 20) as f64,
        bytes as f64 / (frames * DEVICES as u64 * 2) as f64,
        limits.max_bytes as f64 / (1 << 20) as f64,
        if recorder.len() as u64 == frames && recorder.dropped_for_memory == 0 { "met" } else { "NOT met" }
    );
    println!(
        "recorder: adding up a window: last 10 minutes {ten_minutes:.0} ms, the whole hour {hour:.0} ms"
    );
    store(&recorder.window(first, last).frames, first, last);
}

/// The hour's frames written to a store as the agent writes them, and read back.
fn store(frames: &[tracerd::model::recorder::Frame], first: u64, last: u64) {
    let dir = std::env::temp_dir().join(format!("tracerd-bench-store-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let defaults = StoreLimits::new(dir.clone());
    let mut store = Store::open(StoreLimits { max_bytes: u64::MAX, ..defaults.clone() }).expect("a store");
    let every = defaults.sync_every.as_secs() as usize;
    let t = Instant::now();
    for (i, frame) in frames.iter().enumerate() {
        store.append(frame, &[] as &[Device]);
        if (i + 1) % every == 0 {
            store.sync();
        }
    }
    store.sync();
    let write_us = t.elapsed().as_secs_f64() * 1e6 / frames.len() as f64;
    assert_eq!(store.health.frames_not_stored, 0, "{:?}", store.health);
    let bytes = store.bytes();
    drop(store);
    let t = Instant::now();
    let mut recorder = Recorder::default();
    recorder.attach_store(Store::open_read_only(&dir).expect("the store reads back"));
    let read = recorder.window(first, last);
    let (agg, _) = read.aggregate().expect("frames decode");
    let read_ms = t.elapsed().as_secs_f64() * 1e3;
    let requests: u64 = agg.series.values().map(|s| s.requests).sum();
    assert_eq!(requests, (last - first) / 1000 * DEVICES as u64 * 2 * IOS_PER_SERIES);
    let day = bytes as f64 * 86_400e3 / (last - first) as f64;
    let mib = |b: f64| b / (1 << 20) as f64;
    println!(
        "recorder store: an hour written at {write_us:.0} µs a frame (a second of the agent; a sync every \
         {every}): {:.1} MiB on disk, a day {:.0} MiB; default bound {:.0} MiB: {}",
        mib(bytes as f64),
        mib(day),
        mib(defaults.max_bytes as f64),
        if day <= defaults.max_bytes as f64 {
            "met".to_owned()
        } else {
            format!("NOT met: it keeps {:.1} h of them", 24.0 * defaults.max_bytes as f64 / day)
        }
    );
    println!("recorder store: reading the hour back from disk and adding it up: {read_ms:.0} ms");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `c` as if each of its IOs had happened `k` times.
fn scaled(c: &SeriesAgg, k: u64) -> SeriesAgg {
    let mut s = *c;
    for v in [&mut s.requests, &mut s.bytes, &mut s.errors, &mut s.qd_sum, &mut s.qd_count] {
        *v *= k;
    }
    s.stage_ns.iter_mut().for_each(|v| *v *= k);
    s.qd.iter_mut().chain(s.paths.iter_mut()).chain(s.hist.iter_mut().flatten()).for_each(|v| *v *= k as u32);
    s
}
