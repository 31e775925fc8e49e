//! The IO model and aggregation: stages, ops, per-layer splits, histograms per series, the
//! device topology and which devices are traced, the flight recorder of the past hour, and
//! the capture format that `report --save` writes and `diff` reads.

pub mod aggregate;
pub mod ahead;
pub mod capture;
pub mod causes;
pub mod cgroups;
pub mod layers;
pub mod op;
pub mod recorder;
pub mod selection;
pub mod series;
pub mod slowest;
pub mod stage;
pub mod topology;
