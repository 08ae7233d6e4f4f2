//! The CUDA driver, used through torch's primary context and the caller's
//! streams, and NVRTC with an on-disk cubin cache. No libtorch: Python hands
//! us raw pointers, device ordinals and stream handles.

pub mod cache;
pub mod driver;
pub mod kernels;
pub mod memory;
pub mod nvrtc;
pub mod stream;
pub mod tensor_map;
