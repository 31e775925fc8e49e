//! The cgroups scenario: the cgroup tests (tests/tests/cgroups.rs), run in the guest on cgroup v2.

use crate::{ran, section};

#[test]
fn cgroup_tests_pass_on_cgroup_v2_with_writeback() {
    if !ran("cgroups") {
        return;
    }
    let out = section("cgroups");
    assert!(out.contains("cgroup tests exit status: 0"), "cgroup tests failed in the VM:\n{out}");
    let tests = include_str!("../cgroups.rs").matches("#[test]").count();
    let result =
        out.lines().find(|l| l.starts_with("test result:")).unwrap_or_else(|| panic!("no result:\n{out}"));
    assert!(result.starts_with(&format!("test result: ok. {tests} passed; 0 failed")), "{result}");
    // The guest runs v2 with io and memory: the writeback test must have met the dirtying
    // cgroup, not the root (which is what a v1 blkio host gives).
    assert!(out.contains("cgroup writeback: on (v2 io+memory)"), "{out}");
    assert!(
        out.contains("SKIPPED top_shows_a_row_per_cgroup_on_c"),
        "only the tmux test may skip, loudly:\n{out}"
    );
}
