//! The running kernel's struct layout, read from BTF at start-up and handed to the programs.
//! Each kernel difference is one named choice here, never a constant for one kernel.

use anyhow::{Result, anyhow, bail};
use tracer_common::{KernelLayout, bio_dev_path, rq_disk_path};

use crate::kernel::btf::{Btf, BtfError};

/// Resolves every offset the kernel programs read; errors name `kernel` (the release) and what
/// its BTF lacks.
pub fn resolve(btf: &Btf, kernel: &str) -> Result<KernelLayout> {
    let cannot = format!("kernel {kernel}: cannot trace");
    let off = |s: &str, path: &[&str]| {
        btf.member_offset(s, path).map_err(|e| match e {
            BtfError::NoStruct(_) => anyhow!("{cannot}: its BTF has no struct {s}"),
            _ => anyhow!("{cannot}: struct {s} lacks {} in its BTF", path.join(".")),
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
    } else if btf.has_member("bio", "bi_disk") {
        l.bio_dev_path = bio_dev_path::DISK_PARTNO;
        l.bio_bi_disk = off("bio", &["bi_disk"])?;
        l.bio_bi_partno = off("bio", &["bi_partno"])?;
    } else {
        bail!("{cannot}: struct bio has neither bi_bdev (5.12+) nor bi_disk (before 5.12) in its BTF");
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
    } else if btf.has_member("request_queue", "disk") {
        l.rq_disk_path = rq_disk_path::QUEUE;
        l.queue_disk = off("request_queue", &["disk"])?;
    } else {
        bail!("{cannot}: struct request has neither rq_disk (before 5.17) nor q->disk (5.17+) in its BTF");
    }
    Ok(l)
}

/// The choices `resolve` made, in the words `tracerd doctor` prints.
pub fn describe(l: &KernelLayout) -> String {
    let bio = match l.bio_dev_path {
        bio_dev_path::BDEV => "bio->bi_bdev (5.12+)",
        _ => "bio->bi_disk + bi_partno (before 5.12)",
    };
    let rq = match l.rq_disk_path {
        rq_disk_path::QUEUE => "rq->q->disk (5.17+)",
        _ => "rq->rq_disk (before 5.17)",
    };
    let cgroup = match l.bio_cgroup {
        0 => "the submitting task's (no CONFIG_BLK_CGROUP)",
        _ => "bio->bi_blkg (CONFIG_BLK_CGROUP)",
    };
    // Offset 0 is `q`, never a timestamp: 0 means absent.
    let stamps: Vec<&str> =
        [(l.rq_start_time_ns, "start_time_ns"), (l.rq_io_start_time_ns, "io_start_time_ns")]
            .into_iter()
            .filter(|&(off, _)| off != 0)
            .map(|(_, name)| name)
            .collect();
    let stamps = if stamps.is_empty() { "none".to_owned() } else { stamps.join("+") };
    format!("{bio}, {rq}, cgroup: {cgroup}, request timestamps: {stamps}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::btf::fixtures::Fixture;

    #[test]
    fn real_kernels_take_bi_bdev_q_disk_and_the_blkcg_chain() {
        // (kernel, bio bi_status, block_device bd_dev, request_queue disk, task_struct comm,
        // cgroup kn, kernfs_node id): what differs between them.
        let kernels = [
            ("6.1.0-57-amd64", 24, 36, 160, 2976, 248, 104),
            ("6.12.117+deb12-amd64", 25, 52, 104, 2976, 256, 96),
            ("6.12.117+deb12-rt-amd64", 25, 52, 168, 3016, 256, 96),
            ("6.12.117+deb12-cloud-amd64", 25, 52, 104, 2976, 256, 96),
            ("6.18.44-fc-v595", 26, 52, 104, 1752, 256, 96),
        ];
        assert_eq!(kernels.len(), Fixture::all().len(), "every fixture is checked");
        for (kernel, bi_status, bd_dev, queue_disk, comm, kn, kn_id) in kernels {
            let l = resolve(&Fixture::load(kernel).btf(), kernel).unwrap();
            assert_eq!(
                (l.bio_dev_path, l.rq_disk_path),
                (bio_dev_path::BDEV, rq_disk_path::QUEUE),
                "{kernel}"
            );
            let bio = (l.bio_bi_next, l.bio_bi_bdev, l.bio_bi_opf, l.bio_bi_status, l.bio_bi_sector);
            assert_eq!(bio, (0, 8, 16, bi_status, 32), "{kernel}");
            assert_eq!((l.bio_bi_size, l.bio_bi_private, l.bio_bi_blkg), (40, 64, 72), "{kernel}");
            let rq = (l.rq_q, l.rq_cmd_flags, l.rq_data_len, l.rq_sector, l.rq_bio);
            assert_eq!(rq, (0, 24, 44, 48, 56), "{kernel}");
            assert_eq!((l.rq_start_time_ns, l.rq_io_start_time_ns), (104, 112), "{kernel}");
            assert_eq!((l.bdev_bd_dev, l.queue_disk, l.task_comm), (bd_dev, queue_disk, comm), "{kernel}");
            assert_eq!((l.disk_major, l.disk_first_minor, l.queue_data_rq), (0, 4, 0), "{kernel}");
            assert_eq!(l.bio_cgroup, 1, "{kernel}");
            let chain = (l.blkg_blkcg, l.blkcg_css_cgroup, l.cgroup_kn, l.kernfs_node_id);
            assert_eq!(chain, (40, 0, kn, kn_id), "{kernel}");
            assert_eq!((l.bio_bi_disk, l.bio_bi_partno, l.rq_rq_disk), (0, 0, 0), "{kernel}: not read");
        }
    }

    #[test]
    fn before_5_12_a_bio_names_its_disk_and_partition() {
        let mut f = Fixture::load("6.1.0-57-amd64");
        // struct bio of 5.10.
        f.member("bio", "bi_bdev", None).member("bio", "bi_disk", Some(8));
        f.member("bio", "bi_partno", Some(27)).member("bio", "bi_status", Some(26));
        let l = resolve(&f.btf(), &f.kernel).unwrap();
        assert_eq!(l.bio_dev_path, bio_dev_path::DISK_PARTNO);
        assert_eq!((l.bio_bi_disk, l.bio_bi_partno, l.bio_bi_status), (8, 27, 26));
        assert_eq!((l.bio_bi_bdev, l.bdev_bd_dev), (0, 0), "not read");
        assert!(describe(&l).starts_with("bio->bi_disk + bi_partno (before 5.12), rq->q->disk"));
    }

    #[test]
    fn before_5_17_a_request_names_its_disk() {
        let mut f = Fixture::load("6.12.117+deb12-amd64");
        f.member("request", "rq_disk", Some(160));
        let l = resolve(&f.btf(), &f.kernel).unwrap();
        assert_eq!((l.rq_disk_path, l.rq_rq_disk, l.queue_disk), (rq_disk_path::RQ_DISK, 160, 0));
        assert!(describe(&l).starts_with("bio->bi_bdev (5.12+), rq->rq_disk (before 5.17), cgroup"));
    }

    #[test]
    fn without_blk_cgroup_the_task_cgroup_is_used() {
        let mut f = Fixture::load("6.18.44-fc-v595");
        f.member("bio", "bi_blkg", None);
        let l = resolve(&f.btf(), &f.kernel).unwrap();
        assert_eq!(l.bio_cgroup, 0);
        assert_eq!((l.bio_bi_blkg, l.blkg_blkcg, l.cgroup_kn, l.kernfs_node_id), (0, 0, 0, 0), "not read");
        assert!(describe(&l).contains(", cgroup: the submitting task's (no CONFIG_BLK_CGROUP), "));
    }

    #[test]
    fn request_timestamps_are_read_where_present() {
        let mut f = Fixture::load("6.12.117+deb12-rt-amd64");
        f.member("request", "start_time_ns", None);
        let l = resolve(&f.btf(), &f.kernel).unwrap();
        assert_eq!((l.rq_start_time_ns, l.rq_io_start_time_ns), (0, 112));
        assert!(describe(&l).ends_with("request timestamps: io_start_time_ns"));
        f.member("request", "io_start_time_ns", None);
        let l = resolve(&f.btf(), &f.kernel).unwrap();
        assert_eq!((l.rq_start_time_ns, l.rq_io_start_time_ns), (0, 0));
        assert!(describe(&l).ends_with("request timestamps: none"));
    }

    #[test]
    fn what_a_kernel_lacks_is_named_with_the_kernel() {
        let error = |f: &Fixture| format!("{:#}", resolve(&f.btf(), &f.kernel).unwrap_err());
        let mut f = Fixture::load("6.1.0-57-amd64");
        f.member("bio", "bi_bdev", None);
        assert_eq!(
            error(&f),
            "kernel 6.1.0-57-amd64: cannot trace: struct bio has neither bi_bdev (5.12+) nor bi_disk \
             (before 5.12) in its BTF"
        );
        f.member("bio", "bi_disk", Some(8));
        assert_eq!(error(&f), "kernel 6.1.0-57-amd64: cannot trace: struct bio lacks bi_partno in its BTF");

        let mut f = Fixture::load("6.18.44-fc-v595");
        f.member("request_queue", "disk", None);
        assert_eq!(
            error(&f),
            "kernel 6.18.44-fc-v595: cannot trace: struct request has neither rq_disk (before 5.17) nor \
             q->disk (5.17+) in its BTF"
        );

        let mut f = Fixture::load("6.12.117+deb12-cloud-amd64");
        f.member("bio", "bi_iter.bi_sector", None);
        assert_eq!(
            error(&f),
            "kernel 6.12.117+deb12-cloud-amd64: cannot trace: struct bio lacks bi_iter.bi_sector in its BTF"
        );
        let mut f = Fixture::load("6.12.117+deb12-cloud-amd64");
        f.sizes.remove("blk_mq_queue_data");
        f.member("blk_mq_queue_data", "rq", None);
        assert_eq!(
            error(&f),
            "kernel 6.12.117+deb12-cloud-amd64: cannot trace: its BTF has no struct blk_mq_queue_data"
        );
    }
}
