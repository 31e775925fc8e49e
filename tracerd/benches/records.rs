//! Userspace hot path, on one core: ring-buffer bytes -> decoded record -> traced device ->
//! per-stage HdrHistograms, exactly as the daemon's reader does it. Prints records per second
//! (median of several passes over a million synthetic records).
//!
//! cargo bench -p tracerd --bench records

use std::time::Instant;

use tracer_common::{IoRecord, event, kind};
use tracerd::{
    kernel::btf::Btf,
    kernel::record,
    model::aggregate::Aggregator,
    model::layers::{LayerSplit, Layers, MAX_LOWERS},
    model::selection::Selection,
    model::topology::Topology,
};

const RECORDS: usize = 1_000_000;
const PASSES: usize = 7;

fn main() {
    let btf = Btf::from_sys_fs().expect("needs /sys/kernel/btf/vmlinux (the op numbering comes from it)");
    let ops = tracerd::kernel::ops::op_decoder(&btf).expect("op numbering");
    let topo = Topology::scan().expect("sysfs");
    let resolved = Selection::default().resolve(&topo).expect("devices");
    let disks: Vec<u32> = topo.devices().filter(|d| !d.partition).map(|d| d.dev).take(4).collect();
    assert!(!disks.is_empty(), "no block device to attribute records to");

    // Synthetic but realistic records: a few disks, reads and writes, µs-scale stages.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let bytes: Vec<[u8; size_of::<IoRecord>()]> = (0..RECORDS)
        .map(|i| {
            let q = 1_000_000_000 + i as u64 * 1000;
            let mut r = IoRecord {
                kind: kind::REQUEST,
                disk: disks[i % disks.len()],
                dev: disks[i % disks.len()],
                cmd_flags: (next() % 2) as u32,
                bytes: 4096,
                queue_depth: 1 + (next() % 32) as u32,
                ..Default::default()
            };
            r.ts[event::Q] = q;
            r.ts[event::G] = q + 200 + next() % 500;
            r.ts[event::D] = r.ts[event::G] + 300 + next() % 2000;
            r.ts[event::C] = r.ts[event::D] + 5_000 + next() % 200_000;
            // SAFETY: IoRecord is plain old data.
            unsafe { std::mem::transmute::<IoRecord, [u8; size_of::<IoRecord>()]>(r) }
        })
        .collect();

    let mut rates = Vec::new();
    for _ in 0..PASSES {
        let mut agg = Aggregator::new(false);
        let mut layers = Layers::default();
        let mut splits = [LayerSplit::default(); MAX_LOWERS];
        let start = Instant::now();
        for b in &bytes {
            let rec = record::decode(b).expect("valid record");
            let Some(target) = resolved.target_of(&rec) else { continue };
            layers.lower_done(target, &rec);
            let n = layers.upper_done(&rec, &mut splits);
            agg.add(target, ops.op(rec.cmd_flags), &rec, &splits[..n], |d| topo.name_of(d));
        }
        let secs = start.elapsed().as_secs_f64();
        let total: u64 = agg.series.values().map(|s| s.requests).sum();
        assert_eq!(total, RECORDS as u64);
        rates.push(RECORDS as f64 / secs);
    }
    rates.sort_by(f64::total_cmp);
    let median = rates[PASSES / 2];
    println!(
        "decode+aggregate: {:.2} M records/s on one core (median of {PASSES} passes of {RECORDS}; \
         target >= 5 M/s: {})",
        median / 1e6,
        if median >= 5e6 { "met" } else { "NOT met" }
    );
}
