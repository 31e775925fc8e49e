//! The output layer: what a command shows, built from the model and rendered as text or JSON.
//! The report (its model, builder and tables), the per-IO line, the histogram view, and the one
//! `Style` that decides colour. Commands choose a source and hand what it gives to a view.

pub mod diff;
pub mod doctor;
pub mod histogram;
pub mod io_line;
pub mod report;
pub mod style;
pub mod top;
