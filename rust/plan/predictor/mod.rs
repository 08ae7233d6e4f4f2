//! A latency model of the overlapped schedule, and the search for the group
//! layout it predicts to be fastest. The structure (wave-quantised GEMM,
//! collectives serialised on one stream) is what the kernel does; the rates
//! are measured constants, replaced by a machine's profile (measured
//! collective curves and GEMM rates) where `flashoverlap tune` made one.

mod all_to_all;
mod cost;
mod curve;
mod hardware;
mod search;
mod timeline;

pub use all_to_all::{
    best_all_to_all_groups, call_us, predict_all_to_all, AllToAllShape, Segments,
    MAX_ALL_TO_ALL_GROUPS,
};
pub use curve::{Curve, CURVE_CAPACITY};
pub use hardware::{
    CollectiveKind, CollectiveModel, HardwareModel, FUSED_NORM_CAP, FUSED_NORM_LAUNCH_US,
    FUSED_NORM_ROWS_PER_CTA, H200_FUSED_NORM_PER_SM,
};
pub use search::{best_partition, best_staged_partition};
pub use timeline::{
    combined_sequence, predict, predict_combined, predict_sequential, predict_staged, Gather,
    GroupTiming, Timeline,
};
