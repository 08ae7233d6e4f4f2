//! An analytic latency model of the overlapped schedule, and the search for
//! the group layout it predicts to be fastest. The constants are rough until
//! a profile-based predictor replaces them; the structure (wave-quantised
//! GEMM, collectives serialised on one stream) is what the kernel does.

mod cost;
mod hardware;
mod search;
mod timeline;

pub use hardware::{CollectiveModel, HardwareModel, FUSED_NORM_CAP, H200_FUSED_NORM_PER_SM};
pub use search::{best_partition, best_staged_partition};
pub use timeline::{predict, predict_sequential, predict_staged, GroupTiming, Timeline};
