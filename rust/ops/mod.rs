//! One file per op: each enqueues its GEMM, waits, collectives and counter
//! resets on the caller's stream and the communicator's stream, in order.

pub mod all_reduce;
pub mod all_reduce_rmsnorm;
pub mod backend;
pub mod copy_engine;
pub mod gathered_all_reduce;
pub mod gemm;
pub mod gemm_all_reduce;
pub mod gemm_all_to_all;
pub mod gemm_reduce_scatter;
pub mod norm_copy_engines;
pub mod profile;
