// The plain register copy the standalone probes under evaluation/ time as a
// reference: 512 threads a CTA, 4 vectors of 16 B in flight each, every CTA
// copying one contiguous share of the n vectors.
#pragma once
#include <cuda_runtime.h>

__global__ void __launch_bounds__(512) reg_copy(uint4* to, const uint4* from, long long n) {
  const long long per = (n + gridDim.x - 1) / gridDim.x;
  const long long b0 = per * blockIdx.x, b1 = min(n, b0 + per);
  for (long long i0 = b0 + threadIdx.x; i0 < b1; i0 += 512 * 4) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const long long i = i0 + u * 512;
      if (i < b1) v[u] = from[i];
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const long long i = i0 + u * 512;
      if (i < b1) to[i] = v[u];
    }
  }
}
