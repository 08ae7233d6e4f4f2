//! Streams, events and stream memory operations (waits and writes on 32-bit
//! flags that occupy no SM).

use super::driver::check;
use crate::error::Result;
use cudarc::driver::sys;

/// A raw stream handle borrowed from torch (`torch.cuda.Stream.cuda_stream`).
pub type RawStream = sys::CUstream;

pub fn from_handle(handle: usize) -> RawStream {
    handle as RawStream
}

/// A stream the library owns: the communication stream, created with the
/// highest priority so that collectives are scheduled ahead of the GEMM's
/// remaining CTAs, and non-blocking so that it never syncs with the legacy
/// default stream.
#[derive(Debug)]
pub struct OwnedStream(pub RawStream);

// SAFETY: stream handles may be used from any thread.
unsafe impl Send for OwnedStream {}
unsafe impl Sync for OwnedStream {}

impl OwnedStream {
    pub fn high_priority() -> Result<Self> {
        let (mut least, mut greatest) = (0, 0);
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: valid out pointers; the caller bound a context.
        unsafe {
            check(
                sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest),
                "cuCtxGetStreamPriorityRange",
            )?;
            check(
                sys::cuStreamCreateWithPriority(
                    &mut s,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                    greatest,
                ),
                "cuStreamCreateWithPriority",
            )?;
        }
        Ok(OwnedStream(s))
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        // SAFETY: created above; pending work still completes after destroy.
        unsafe {
            sys::cuStreamDestroy_v2(self.0);
        }
    }
}

/// An event without timing, used only to order streams.
#[derive(Debug)]
pub struct Event(sys::CUevent);

// SAFETY: event handles may be used from any thread.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    pub fn new() -> Result<Self> {
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        check(
            unsafe {
                sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            },
            "cuEventCreate",
        )?;
        Ok(Event(e))
    }

    /// Makes `waiter` wait for everything enqueued on `source` so far.
    pub fn order(&self, source: RawStream, waiter: RawStream) -> Result<()> {
        self.order_all(source, &[waiter])
    }

    /// Records what `source` has enqueued so far, for a later [`Event::wait`].
    pub fn record(&self, source: RawStream) -> Result<()> {
        // SAFETY: a live event and stream of the current context.
        check(
            unsafe { sys::cuEventRecord(self.0, source) },
            "cuEventRecord",
        )
    }

    /// Makes `waiter` wait for the work of the last [`Event::record`].
    pub fn wait(&self, waiter: RawStream) -> Result<()> {
        // SAFETY: a live event and stream of the current context.
        check(
            unsafe { sys::cuStreamWaitEvent(waiter, self.0, 0) },
            "cuStreamWaitEvent",
        )
    }

    /// Makes every stream of `waiters` wait for everything enqueued on `source` so far.
    pub fn order_all(&self, source: RawStream, waiters: &[RawStream]) -> Result<()> {
        self.record(source)?;
        waiters.iter().try_for_each(|&waiter| self.wait(waiter))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created above.
        unsafe {
            sys::cuEventDestroy_v2(self.0);
        }
    }
}

/// Blocks `stream` (not the host, not an SM) until `*flag >= value`.
pub fn wait_geq(stream: RawStream, flag: sys::CUdeviceptr, value: u32) -> Result<()> {
    // SAFETY: flag is a live device word of the current context.
    check(
        unsafe {
            sys::cuStreamWaitValue32_v2(
                stream,
                flag,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        },
        "cuStreamWaitValue32",
    )
}

/// Blocks `stream` until `*flag >= value`, then resets the flag to 0 (a
/// counter or flag consumed by its one waiter: whatever counts into it is
/// done by then, so the reset races with nothing).
pub fn take(stream: RawStream, flag: sys::CUdeviceptr, value: u32) -> Result<()> {
    wait_geq(stream, flag, value)?;
    write(stream, flag, 0)
}

/// Zeroes the device words `words` in stream order: one strided memset
/// where they are evenly spaced (a group's counters are), else a write
/// each.
pub fn zero_words(stream: RawStream, words: &[sys::CUdeviceptr]) -> Result<()> {
    let pitch = match words {
        [] => return Ok(()),
        [a, b, ..] => b.wrapping_sub(*a),
        [_] => 4,
    };
    let even = pitch >= 4 && words.windows(2).all(|w| w[1].wrapping_sub(w[0]) == pitch);
    if !even {
        return words.iter().try_for_each(|&w| write(stream, w, 0));
    }
    // SAFETY: every word is a live device word of the current context;
    // a row of one word per pitch touches nothing between them.
    check(
        unsafe { sys::cuMemsetD2D32Async(words[0], pitch as usize, 0, 1, words.len(), stream) },
        "cuMemsetD2D32Async",
    )
}

/// Writes `value` to `*flag` in stream order.
pub fn write(stream: RawStream, flag: sys::CUdeviceptr, value: u32) -> Result<()> {
    // SAFETY: flag is a live device word of the current context.
    check(
        unsafe {
            sys::cuStreamWriteValue32_v2(
                stream,
                flag,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        },
        "cuStreamWriteValue32",
    )
}

/// Copies `bytes` from `src` to `dst` in stream order; between GPUs (a peer
/// buffer mapped through IPC) the copy engines move the bytes, no SM.
pub fn copy(
    stream: RawStream,
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
) -> Result<()> {
    // SAFETY: both ranges are live device memory mapped in the current context.
    check(
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream) },
        "cuMemcpyDtoDAsync",
    )
}

/// Waits until every operation enqueued on `stream` has finished.
pub fn synchronize(stream: RawStream) -> Result<()> {
    // SAFETY: live stream of the current context.
    check(
        unsafe { sys::cuStreamSynchronize(stream) },
        "cuStreamSynchronize",
    )
}

/// Whether `stream` is being captured into a CUDA graph: then nothing may be
/// allocated, compiled or loaded, only enqueued.
pub fn is_capturing(stream: RawStream) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: valid out pointer and stream.
    check(
        unsafe { sys::cuStreamIsCapturing(stream, &mut status) },
        "cuStreamIsCapturing",
    )?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}
