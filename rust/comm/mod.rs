//! NCCL, opened from the very libnccl torch already mapped into the process,
//! and communicators registered under the names the ops receive.

pub mod communicator;
pub mod nccl;
