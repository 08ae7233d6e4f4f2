"""The raw handle of the current CUDA stream, asked for on every op call."""

import torch

# torch's C binding answers in ~1 us where torch.cuda.current_stream(device) builds a Stream
# object and resolves the device first (~5-10 us a call); the public route where it is missing.
_RAW = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device_index: int) -> int:
    """cudaStream_t of the current stream of device `device_index`, as an int."""
    if _RAW is not None:
        return _RAW(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream
