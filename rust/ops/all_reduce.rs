//! A plain in-place AllReduce on the communicator's stream, ordered after
//! the caller's prior work and before its later work: the collective half of
//! the sequential schedule.

use crate::comm::communicator::Communicator;
use crate::cuda::stream::RawStream;
use crate::dtype::Dtype;
use crate::error::{Error, Result};

pub fn all_reduce(
    comm: &Communicator,
    ptr: u64,
    count: usize,
    dtype: Dtype,
    caller: RawStream,
) -> Result<()> {
    if ptr == 0 && count > 0 {
        return Err(Error::Invalid("tensor: null device pointer".into()));
    }
    comm.on_comm_stream(caller, |nccl, nccl_comm, stream| {
        nccl.all_reduce_in_place(ptr, count, dtype, nccl_comm, stream.cast())
    })
}
