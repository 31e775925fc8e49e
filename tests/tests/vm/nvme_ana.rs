//! The nvme_ana scenario: NVMe multipath over NVMe/TCP on loopback while a port goes away and its
//! ANA state flips.

use crate::{
    assert_counts_match_diskstats, assert_each_head_bio_served_once, device, diskstats_delta, json_lines, op,
    ran, release, report, section,
};

#[test]
fn nvme_ana_failover_under_io_counts_each_head_bio_once_and_links_the_failed_over_request() {
    if !ran("nvme_ana") {
        return;
    }
    // NVMe/TCP on loopback, 2000 reads at qd 16: port 1 goes away with requests in flight and
    // comes back, then its ANA group flips to inaccessible and back four times. The requests
    // on the lost connection, and a command sent through the inaccessible port, fail, and NVMe
    // sends their bios down the other path: each failed request is flagged failed over and is
    // a lower IO of its bio beside the one that served it.
    let setup = section("nvme_ana_setup");
    let head =
        setup.split_whitespace().find_map(|w| w.strip_prefix("head=")).unwrap_or_else(|| panic!("{setup}"));
    let paths: Vec<&str> = setup.split("paths=").nth(1).unwrap().split_whitespace().collect();
    assert_eq!(paths.len(), 2, "{setup}");
    let (heads, served, failed_over) =
        assert_each_head_bio_served_once(&json_lines("nvme_ana_snoop"), head, &paths);
    assert_eq!((heads, served), (2000, 2000), "each head bio counted once, served once");
    assert!(failed_over >= 1, "no request failed over: a lost connection and four ANA transitions under IO");
    let r = report("nvme_ana_report");
    assert_counts_match_diskstats(&r, "nvme_ana", &paths);
    assert_eq!(op(device(&r, head), "read")["requests"], 2000);
    // Where the head's iostats is on (6.12), the kernel counts a bio again each time NVMe
    // sends it down another path; tracerd counts it once.
    let (head_reads, _) = diskstats_delta("nvme_ana")[head];
    if head_reads != 0 {
        assert_eq!(head_reads, 2000 + failed_over, "{head} in /proc/diskstats");
    }
    eprintln!("{}: 2000 head bios, {failed_over} path requests failed over", release());
}
