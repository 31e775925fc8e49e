//! What one IO adds to a series, written once for every series the daemon keeps: the agent's
//! HdrHistogram series (`OpStats`), the recorder's bucket series (`SeriesFrame`, per cgroup
//! too) and the kernel's own counters (`SeriesAgg`), which `run --aggregation check` holds
//! the kernel's against. A series says only where each part goes; `Series::add_record` decides
//! what a record adds (which stages, bytes, errors, queue depth, path, in which unit), and
//! `KernelSeries::add_kernel` what a fold of the kernel's counters adds.

use tracer_common::{IoRecord, SeriesAgg, agg, event, flag, kind, own};

use crate::model::{
    layers::LayerSplit,
    stage::{Stage, path_mask},
};

/// Where each part of an IO goes in one series. Times are in ns.
pub trait Series {
    /// Completed requests (a merged bio is none), their bytes, and those completed with an
    /// error.
    fn count_requests(&mut self, requests: u64, bytes: u64, errors: u64);
    /// Requests by event path: `mask` has bit i set where event i fired.
    fn count_path(&mut self, mask: usize, requests: u64);
    /// One request's queue depth at issue (non-zero: known).
    fn record_queue_depth(&mut self, depth: u32);
    fn record_stage(&mut self, stage: Stage, ns: u64);
    /// A bio merged into another request.
    fn count_merged_bio(&mut self);
    /// An IO below a stacked device that names no upper IO, by its own kind's index
    /// (`tracer_common::own::index`).
    fn count_unlinked(&mut self, own: usize);
    /// A stacked device's IO, against one lower device.
    fn record_layer(&mut self, split: &LayerSplit);
    /// Time inside a stacked driver's submit function.
    fn record_submit(&mut self, ns: u64);
    /// Time inside the md personality.
    fn record_personality(&mut self, ns: u64);
    /// An rq-qos wait inside Q2G, by the policies waited in (`tracer_common::qos` bits).
    fn record_qos(&mut self, policies: u8, ns: u64);

    /// What one record adds, with its layer splits (a stacked device's upper IO): the same
    /// for every series.
    fn add_record(&mut self, rec: &IoRecord, layers: &[LayerSplit]) {
        for split in layers {
            self.record_layer(split);
        }
        if rec.submit_ns != 0 {
            self.record_submit(rec.submit_ns);
        }
        if rec.personality_ns != 0 {
            self.record_personality(rec.personality_ns);
        }
        if rec.qos != 0 {
            self.record_qos(rec.qos, rec.qos_ns);
        }
        if rec.kind == kind::MERGE {
            self.count_merged_bio();
        } else {
            self.count_requests(1, rec.bytes as u64, (rec.error != 0) as u64);
            if rec.flags & flag::UNLINKED != 0 {
                self.count_unlinked(own::index(rec.own));
            }
            self.count_path(path_mask(rec), 1);
            if rec.queue_depth != 0 {
                self.record_queue_depth(rec.queue_depth);
            }
        }
        Stage::each_of(rec, |stage, ns| self.record_stage(stage, ns));
    }
}

/// A series that also takes what the kernel counted (in-kernel aggregation), in its buckets.
pub trait KernelSeries: Series {
    /// Queue depths at issue in the kernel's buckets, with their sum and count.
    fn add_queue_depths(&mut self, buckets: &[u32; agg::QD_BUCKETS], sum: u64, count: u64);
    /// IOs known only by their bucket of `agg::BOUNDS_NS` in `stage`, with their exact sum.
    fn add_stage_buckets(&mut self, stage: Stage, counts: &[u32; agg::BUCKETS], sum_ns: u64);

    /// What the kernel counted since its last fold: the same for every series.
    fn add_kernel(&mut self, c: &SeriesAgg) {
        self.count_requests(c.requests, c.bytes, c.errors);
        // The kernel counts completions: its paths leave out C, which every one of them has.
        for (path, &n) in c.paths.iter().enumerate().filter(|(_, n)| **n != 0) {
            self.count_path(path | 1 << event::C, n as u64);
        }
        self.add_queue_depths(&c.qd, c.qd_sum, c.qd_count);
        for (k, counts) in c.hist.iter().enumerate() {
            // A sum without counts is an IO the kernel was counting while it was read: its
            // counts come with the next fold, and its ns are kept so that sums stay exact.
            if counts.iter().all(|&n| n == 0) && c.stage_ns[k] == 0 {
                continue;
            }
            self.add_stage_buckets(Stage::KERNEL[k], counts, c.stage_ns[k]);
        }
    }
}

/// The kernel's counters, filled from records by the daemon's own definitions: what
/// `run --aggregation check` compares with the kernel's. The kernel counts completed requests,
/// their paths without C, and the stages of `Stage::KERNEL`; nothing else.
impl Series for SeriesAgg {
    fn count_requests(&mut self, requests: u64, bytes: u64, errors: u64) {
        self.requests += requests;
        self.bytes += bytes;
        self.errors += errors;
    }

    fn count_path(&mut self, mask: usize, requests: u64) {
        self.paths[mask & (agg::PATHS - 1)] += requests as u32;
    }

    fn record_queue_depth(&mut self, depth: u32) {
        self.qd_sum += depth as u64;
        self.qd_count += 1;
        self.qd[agg::qd_bucket(depth)] += 1;
    }

    fn record_stage(&mut self, stage: Stage, ns: u64) {
        if let Some(k) = Stage::KERNEL.iter().position(|&s| s == stage) {
            self.stage_ns[k] += ns;
            self.hist[k][agg::bucket_of(ns)] += 1;
        }
    }

    fn count_merged_bio(&mut self) {}

    fn count_unlinked(&mut self, _own: usize) {}

    fn record_layer(&mut self, _split: &LayerSplit) {}

    fn record_submit(&mut self, _ns: u64) {}

    fn record_personality(&mut self, _ns: u64) {}

    fn record_qos(&mut self, _policies: u8, _ns: u64) {}
}
