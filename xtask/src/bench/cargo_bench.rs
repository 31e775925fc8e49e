//! tracerd's own `cargo bench` targets that the summary quotes: decode+aggregate of records,
//! and the flight recorder's memory and cost.

use std::process::Command;

use anyhow::Result;

use super::machine::output;
use crate::root_dir;

/// The decode+aggregate rate of records, and whether it meets its target.
pub(super) fn records_benchmark() -> Result<String> {
    let out = output(
        Command::new("cargo")
            .current_dir(root_dir())
            .args(["bench", "--quiet", "-p", "tracerd", "--bench", "records"]),
    )?;
    Ok(out
        .lines()
        .find(|l| l.starts_with("decode+aggregate"))
        .unwrap_or("decode+aggregate: no result")
        .to_owned())
}

/// The flight recorder's memory for 8 busy devices over its whole window, and a window's cost.
pub(super) fn recorder_benchmark() -> Result<String> {
    let out = output(
        Command::new("cargo")
            .current_dir(root_dir())
            .args(["bench", "--quiet", "-p", "tracerd", "--bench", "recorder"]),
    )?;
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("recorder")).collect();
    Ok(if lines.is_empty() { "recorder: no result".into() } else { lines.join("\n") })
}
