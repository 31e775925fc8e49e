//! What the workspace's test crate shares with xtask: how the VM guest's console is read, so
//! that `cargo xtask vm-test` and tests/tests/vm parse it one way. Pure std.

pub mod vm {
    pub mod console;
}
