//! Pure planning math for overlapping a GEMM with the AllReduce of its
//! output: which tiles finish when, how finished row bands group into
//! collectives, and whether overlapping beats running the two back to back.
//! Nothing here touches CUDA, so every decision is testable on any machine.

pub mod all_to_all;
pub mod error;
pub mod gemm_all_reduce;
pub mod groups;
pub mod order;
pub mod predictor;
pub mod reduce_scatter;
pub mod staged;
pub mod tiles;
pub mod token_split;
pub mod waves;

#[cfg(test)]
mod testing;

pub use all_to_all::{plan_gemm_all_to_all, AllToAllGroup, AllToAllPlan, Exchange};
pub use error::PlanError;
pub use gemm_all_reduce::{
    plan_gemm_all_reduce, GemmAllReducePlan, ModeRequest, OrderRequest, PlanRequest, Schedule,
};
pub use groups::{Collective, CollectiveSlice, GroupPartition, Partition, WaveGroup};
pub use order::{default_raster_bands, OrderKind, TileOrder};
pub use predictor::{
    best_all_to_all_groups, best_partition, best_staged_partition, call_us, combined_sequence,
    predict, predict_all_to_all, predict_combined, predict_sequential, predict_staged,
    AllToAllShape, CollectiveKind, CollectiveModel, Curve, Gather, GroupTiming, HardwareModel,
    Timeline, CURVE_CAPACITY, MAX_ALL_TO_ALL_GROUPS,
};
pub use reduce_scatter::{
    plan_gemm_reduce_scatter, ReduceScatterPlan, ReduceScatterRequest, ScatterGroup,
};
pub use staged::{staging_elems, StagedGroup, StagedPartition};
pub use tiles::{
    dual_row, hopper_tile_n, pushed_row, OutputTiles, TileShape, HOPPER_TILE_N, MAX_TABLE_ROWS,
};
pub use token_split::{wave_aware_split, LayerGemm, TokenSplit};
pub use waves::Waves;
