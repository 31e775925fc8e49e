//! Loading the kernel side: BTF, struct offsets, hook variants, the loaded programs and maps, the
//! ring-buffer session and record decoding.

pub mod btf;
pub mod causes;
pub mod cgroup_series;
pub mod cgroupfs;
pub mod hooks;
pub mod layout;
pub mod ops;
pub mod record;
pub mod series;
pub mod session;
pub mod slot_view;
pub mod stacking;
pub mod tracer;
pub mod uevents;
