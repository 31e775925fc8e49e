//! The commands: the agent (`run`), `report`, `snoop`,
//! `diff`, `doctor`, `top`; shell completions and man pages (`generate`).

pub mod diff;
pub mod doctor;
pub mod generate;
pub mod report;
pub mod run;
pub mod snoop;
pub mod top;
