//! The host_kernel scenario: the host-kernel integration tests (tests/tests/host_kernel.rs), run in
//! the guest.

use crate::{ran, section};

#[test]
fn host_kernel_tests_pass_on_the_second_kernel() {
    if !ran("host_kernel") {
        return;
    }
    let out = section("host_kernel");
    assert!(out.contains("host tests exit status: 0"), "host-kernel tests failed in the VM:\n{out}");
    let result =
        out.lines().find(|l| l.starts_with("test result:")).unwrap_or_else(|| panic!("no result:\n{out}"));
    // Every test of host_kernel.rs ran and passed there (the fio one passes by skipping).
    let tests = include_str!("../host_kernel.rs").matches("#[test]").count();
    assert!(result.starts_with(&format!("test result: ok. {tests} passed; 0 failed")), "{result}");
    assert!(
        out.contains("SKIPPED fio_and_tracerd_agree_io_for_io"),
        "only the fio test may skip, loudly:\n{out}"
    );
}
