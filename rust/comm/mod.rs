//! NCCL, opened from the very libnccl torch already mapped into the process,
//! communicators registered under the names the ops receive, and the peer
//! buffers of the copy-engine backend.

pub mod communicator;
pub mod nccl;
pub mod peer;
