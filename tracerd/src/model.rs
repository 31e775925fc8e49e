//! The IO model and aggregation: stages, ops, per-layer splits, histograms per series, the
//! device topology and which devices are traced.

pub mod aggregate;
pub mod layers;
pub mod op;
pub mod selection;
pub mod stage;
pub mod topology;
