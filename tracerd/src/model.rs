//! The IO model and aggregation: stages, ops, per-layer splits, histograms per series, the
//! device topology and which devices are traced, and the flight recorder of the past hour.

pub mod aggregate;
pub mod cgroups;
pub mod layers;
pub mod op;
pub mod recorder;
pub mod selection;
pub mod series;
pub mod slowest;
pub mod stage;
pub mod topology;
