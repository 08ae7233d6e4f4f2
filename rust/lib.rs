//! flashoverlap: GEMMs that signal finished waves of tiles so that the
//! collective on each finished group overlaps the rest of the GEMM.
//!
//! Layers (one direction of dependency): `python` (bindings, thin) ->
//! `ops` -> `plan` (pure math) / `cuda` (driver, NVRTC) / `comm` (NCCL).

// Raw pointers crossing this crate's functions are opaque driver handles
// (streams, communicators), never dereferenced by Rust.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod comm;
pub mod cuda;
pub mod dtype;
pub mod error;
pub mod ops;
pub mod plan;

#[cfg(feature = "python")]
mod python;
