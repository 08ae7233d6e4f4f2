//! A plain in-place AllReduce on the communicator's stream, ordered after
//! the caller's prior work and before its later work: the collective half of
//! the sequential schedule.

use crate::comm::communicator::Communicator;
use crate::cuda::driver;
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
    driver::bind(comm.device.ordinal)?;
    let nccl = comm.nccl()?;
    let _order = comm.enqueue.lock().unwrap_or_else(|p| p.into_inner());
    comm.fork.order(caller, comm.stream.0)?;
    nccl.all_reduce_in_place(ptr, count, dtype, comm.comm(), comm.stream.0.cast())?;
    comm.join.order(comm.stream.0, caller)
}
