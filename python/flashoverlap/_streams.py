"""The raw handle of the current CUDA stream, asked for on every op call."""

import torch

# torch's C binding returns the handle directly, where torch.cuda.current_stream(device) resolves
# the device and builds a Stream object first (all_reduce_rmsnorm's core launch went from 12.5 to
# 10.8 us of host time with it; norm_host_overhead_h200x2.txt). The public route where it is missing.
_RAW = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device_index: int) -> int:
    """cudaStream_t of the current stream of device `device_index`, as an int."""
    if _RAW is not None:
        return _RAW(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream
