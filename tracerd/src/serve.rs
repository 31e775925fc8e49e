//! Serving: the agent's API socket, the HTTP listener, the Prometheus exposition, the
//! process's own resource use.

pub mod api;
pub mod exemplars;
pub mod exposition;
#[cfg(test)]
mod fuzz;
pub mod http;
pub mod metrics;
pub mod process;
