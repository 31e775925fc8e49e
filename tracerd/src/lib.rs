//! tracerd's library: everything but the command-line entry point, so benchmarks and tests
//! can use the same decoding and aggregation the daemon runs.

pub mod build_info;
pub mod cli;
pub mod commands;
pub mod config;
pub mod kernel;
pub mod model;
pub mod reference;
pub mod serve;
pub mod source;
pub mod store;
pub mod units;
pub mod view;
