//! tracerd's library: everything but the command-line entry point, so benchmarks and tests
//! can use the same decoding and aggregation the daemon runs.

pub mod aggregate;
pub mod btf;
pub mod capture;
pub mod cli;
pub mod config;
pub mod diff;
pub mod doctor;
pub mod histogram_view;
pub mod hooks;
pub mod http;
pub mod layers;
pub mod layout;
pub mod metrics;
pub mod op;
pub mod process;
pub mod record;
pub mod report;
pub mod run;
pub mod selection;
pub mod session;
pub mod snoop;
pub mod stage;
pub mod style;
pub mod topology;
pub mod tracer;
pub mod units;
