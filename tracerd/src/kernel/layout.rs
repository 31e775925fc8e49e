//! The running kernel's struct layout, read from BTF at start-up and handed to the programs.
//! Each kernel difference is one named choice here, never a constant for one kernel.

use anyhow::{Context, Result};
use tracer_common::{KernelLayout, bio_dev_path, rq_disk_path};

use crate::kernel::btf::Btf;

/// Resolves every offset the kernel programs read.
pub fn resolve(btf: &Btf) -> Result<KernelLayout> {
    let off = |s: &str, path: &[&str]| {
        btf.member_offset(s, path).with_context(|| {
            format!("cannot trace this kernel: struct {s} lacks {} in its BTF", path.join("."))
        })
    };
    let mut l = KernelLayout {
        bio_bi_opf: off("bio", &["bi_opf"])?,
        bio_bi_sector: off("bio", &["bi_iter", "bi_sector"])?,
        bio_bi_size: off("bio", &["bi_iter", "bi_size"])?,
        bio_bi_private: off("bio", &["bi_private"])?,
        bio_bi_status: off("bio", &["bi_status"])?,
        bio_bi_next: off("bio", &["bi_next"])?,
        rq_bio: off("request", &["bio"])?,
        rq_cmd_flags: off("request", &["cmd_flags"])?,
        rq_data_len: off("request", &["__data_len"])?,
        rq_sector: off("request", &["__sector"])?,
        rq_q: off("request", &["q"])?,
        disk_major: off("gendisk", &["major"])?,
        disk_first_minor: off("gendisk", &["first_minor"])?,
        queue_data_rq: off("blk_mq_queue_data", &["rq"])?,
        task_comm: off("task_struct", &["comm"])?,
        ..KernelLayout::ZERO
    };
    // 5.12 moved bio->bi_disk/bi_partno to bio->bi_bdev.
    if btf.has_member("bio", "bi_bdev") {
        l.bio_dev_path = bio_dev_path::BDEV;
        l.bio_bi_bdev = off("bio", &["bi_bdev"])?;
        l.bdev_bd_dev = off("block_device", &["bd_dev"])?;
    } else {
        l.bio_dev_path = bio_dev_path::DISK_PARTNO;
        l.bio_bi_disk = off("bio", &["bi_disk"])?;
        l.bio_bi_partno = off("bio", &["bi_partno"])?;
    }
    // The request's own timestamps, read beside the probes' (not needed to trace).
    if btf.has_member("request", "start_time_ns") {
        l.rq_start_time_ns = off("request", &["start_time_ns"])?;
    }
    if btf.has_member("request", "io_start_time_ns") {
        l.rq_io_start_time_ns = off("request", &["io_start_time_ns"])?;
    }
    // The cgroup an IO is charged to (CONFIG_BLK_CGROUP; without it the programs fall back to
    // the submitting task's cgroup).
    if btf.has_member("bio", "bi_blkg") {
        l.bio_cgroup = 1;
        l.bio_bi_blkg = off("bio", &["bi_blkg"])?;
        l.blkg_blkcg = off("blkcg_gq", &["blkcg"])?;
        l.blkcg_css_cgroup = off("blkcg", &["css", "cgroup"])?;
        l.cgroup_kn = off("cgroup", &["kn"])?;
        l.kernfs_node_id = off("kernfs_node", &["id"])?;
    }
    // 5.17 dropped rq->rq_disk in favour of rq->q->disk.
    if btf.has_member("request", "rq_disk") {
        l.rq_disk_path = rq_disk_path::RQ_DISK;
        l.rq_rq_disk = off("request", &["rq_disk"])?;
    } else {
        l.rq_disk_path = rq_disk_path::QUEUE;
        l.queue_disk = off("request_queue", &["disk"])?;
    }
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::btf::tests::Builder;

    fn kernel(new_style: bool) -> Btf {
        let mut b = Builder::new();
        let u32t = b.int("unsigned int", 4);
        let u64t = b.int("long long unsigned int", 8);
        let iter = b.strukt("bvec_iter", 4, 16, &[("bi_sector", u64t, 0), ("bi_size", u32t, 8)]);
        b.strukt("gendisk", 4, 64, &[("major", u32t, 0), ("first_minor", u32t, 4)]);
        b.strukt("block_device", 4, 64, &[("bd_start_sect", u64t, 0), ("bd_dev", u32t, 12)]);
        let dev_member = if new_style { "bi_bdev" } else { "bi_disk" };
        let mut bio = vec![
            (dev_member, u64t, 8),
            ("bi_partno", u32t, 16),
            ("bi_opf", u32t, 20),
            ("bi_iter", iter, 32),
            ("bi_private", u64t, 64),
            ("bi_status", u32t, 72),
            ("bi_next", u64t, 0),
        ];
        // Kernels built without CONFIG_BLK_CGROUP have no bi_blkg.
        if new_style {
            bio.push(("bi_blkg", u64t, 80));
        }
        b.strukt("bio", 4, 128, &bio);
        b.strukt("request_queue", 4, 64, &[("disk", u64t, 40)]);
        b.strukt("blk_mq_queue_data", 4, 16, &[("rq", u64t, 0), ("last", u32t, 8)]);
        b.strukt("task_struct", 4, 4096, &[("comm", u64t, 3000)]);
        let css = b.strukt("cgroup_subsys_state", 4, 64, &[("cgroup", u64t, 0), ("ss", u64t, 8)]);
        b.strukt("blkcg_gq", 4, 64, &[("q", u64t, 0), ("blkcg", u64t, 40)]);
        b.strukt("blkcg", 4, 128, &[("lock", u32t, 0), ("css", css, 16)]);
        b.strukt("cgroup", 4, 256, &[("self", css, 0), ("kn", u64t, 200)]);
        b.strukt("kernfs_node", 4, 128, &[("count", u32t, 0), ("id", u64t, 88)]);
        let mut rq = vec![
            ("q", u64t, 0),
            ("cmd_flags", u32t, 24),
            ("__data_len", u32t, 44),
            ("__sector", u64t, 48),
            ("bio", u64t, 56),
        ];
        if new_style {
            rq.extend([("start_time_ns", u64t, 104), ("io_start_time_ns", u64t, 112)]);
        } else {
            rq.push(("rq_disk", u64t, 96));
        }
        b.strukt("request", 4, 128, &rq);
        Btf::parse(&b.build()).unwrap()
    }

    #[test]
    fn new_kernels_use_bdev_and_queue_disk() {
        let l = resolve(&kernel(true)).unwrap();
        assert_eq!(l.bio_dev_path, bio_dev_path::BDEV);
        assert_eq!((l.bio_bi_bdev, l.bdev_bd_dev), (8, 12));
        assert_eq!(l.rq_disk_path, rq_disk_path::QUEUE);
        assert_eq!(l.queue_disk, 40);
        assert_eq!((l.bio_bi_sector, l.bio_bi_size, l.bio_bi_private), (32, 40, 64));
        assert_eq!((l.rq_cmd_flags, l.rq_data_len, l.rq_sector, l.rq_bio), (24, 44, 48, 56));
        assert_eq!(l.task_comm, 3000);
        assert_eq!((l.rq_start_time_ns, l.rq_io_start_time_ns), (104, 112));
        assert_eq!(l.bio_cgroup, 1);
        assert_eq!(
            (l.bio_bi_blkg, l.blkg_blkcg, l.blkcg_css_cgroup, l.cgroup_kn, l.kernfs_node_id),
            (80, 40, 16, 200, 88)
        );
    }

    #[test]
    fn old_kernels_use_bi_disk_and_rq_disk() {
        let l = resolve(&kernel(false)).unwrap();
        assert_eq!(l.bio_dev_path, bio_dev_path::DISK_PARTNO);
        assert_eq!((l.bio_bi_disk, l.bio_bi_partno), (8, 16));
        assert_eq!(l.rq_disk_path, rq_disk_path::RQ_DISK);
        assert_eq!(l.rq_rq_disk, 96);
        assert_eq!((l.rq_start_time_ns, l.rq_io_start_time_ns), (0, 0), "absent: not read");
        assert_eq!(l.bio_cgroup, 0, "no blkcg: the task's cgroup is used");
    }

    #[test]
    fn a_missing_member_says_which() {
        let mut b = Builder::new();
        let u32t = b.int("unsigned int", 4);
        b.strukt("bio", 4, 8, &[("bi_opf", u32t, 0)]);
        let err = resolve(&Btf::parse(&b.build()).unwrap()).unwrap_err();
        assert!(format!("{err:#}").contains("struct bio lacks bi_iter.bi_sector"), "{err:#}");
    }
}
