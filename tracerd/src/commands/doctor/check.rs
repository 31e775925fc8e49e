//! One finding of `tracerd doctor`: its status, what was found, and what to do about it; the
//! JSON output is a list of these.

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    /// Works, with something missing or unverified.
    Warn,
    /// tracerd cannot run here.
    Fail,
}

impl Status {
    pub(super) fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "FAIL",
        }
    }
}

/// One line of the report; the JSON output is an array of these.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Stable identifier for scripts: `btf`, `tracepoint:block_rq_issue`, `kprobe:md_submit_bio`.
    pub name: String,
    pub status: Status,
    /// What was found, and for a warn or FAIL what that costs.
    pub detail: String,
    /// What to do about it, where something can be done.
    pub advice: Option<String>,
}

impl Check {
    pub(super) fn new(name: impl Into<String>, status: Status, detail: impl Into<String>) -> Check {
        Check { name: name.into(), status, detail: detail.into(), advice: None }
    }

    pub(super) fn advice(mut self, advice: impl Into<String>) -> Check {
        self.advice = Some(advice.into());
        self
    }
}

/// Nothing FAILed (warnings pass).
pub fn passed(checks: &[Check]) -> bool {
    checks.iter().all(|c| c.status != Status::Fail)
}

#[cfg(test)]
pub(super) mod tests {
    use super::Check;

    /// The check named `name`, for tests that look at one of many.
    pub fn find<'a>(checks: &'a [Check], name: &str) -> &'a Check {
        checks.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no {name} in {checks:?}"))
    }
}
