// vLLM's fused_add_rms_norm on rows first..last-1 of an [M, N] output:
//   r = s + residual_in (rounded to 16 bits, as vLLM does);  residual_out = r;
//   x = r * rsqrt(mean(r^2) + eps) * weight   (fp32 statistics and products)
// where s, the reduced GEMM output, is read from `src` (row first at src[0]):
// x itself (in place), or the staging slot a peer pushed the rows' sums into
// (the gathered AllReduce: no copy of them into x first).
//
// It runs on the communication stream right after each wave group's
// AllReduce, on the few SMs the GEMM leaves free, so it must keep memory
// busy from few SMs. One warp per row (no block barriers). The first pass
// (x and residual_in, the bytes that come from HBM) goes global -> shared
// with cp.async, FO_STAGES - 1 steps ahead across row ends: loads in flight
// hold no registers. Each lane reads back only the chunks it loaded itself.
// The pass adds, stores the residual and sums the squares; the second pass
// re-reads the residual this lane just wrote (from L2) and writes the
// normalized row. On H200 this moves ~20 K output bytes/us per CTA on few
// CTAs (the register-only version spilled and managed ~13 K): the loop is
// short of issue slots more than of bytes in flight, hence the counters
// instead of divisions and the packed conversions.
// N is a multiple of 8 (16-byte accesses); any N works.
#include "ptx.cuh"

#ifndef FO_BF16
#define FO_BF16 1
#endif

// FO_THREADS per block; FO_VPT 16-byte vectors per lane per tensor per
// step; FO_STAGES steps in the shared-memory ring (FO_STAGES - 1 in flight).
#ifndef FO_THREADS
#define FO_THREADS 512
#endif
#ifndef FO_VPT
#define FO_VPT 2
#endif
#ifndef FO_STAGES
#define FO_STAGES 3
#endif

namespace {
constexpr int THREADS = FO_THREADS;
constexpr int WARPS = THREADS / 32;
constexpr int VEC = 8;
constexpr int VPT = FO_VPT;
constexpr int STAGES = FO_STAGES;
// The second pass reads L2-resident data into registers, FO_UNROLL vectors
// of the residual and of the weight per lane in flight.
#ifndef FO_UNROLL
#define FO_UNROLL 8
#endif
constexpr int UNROLL = FO_UNROLL;

// One 32-bit word = two 16-bit values, the low half first; packing rounds
// both with one instruction (fo::pack2).
using fo::high;
using fo::low;
using fo::pack2;
using fo::word;
}  // namespace

// The ring slot of (stage, tensor 0 = x / 1 = residual_in, vector u) of this thread.
__device__ __forceinline__ uint4* slot(uint4* ring, int stage, int tensor, int u) {
  return ring + ((stage * 2 + tensor) * VPT + u) * THREADS + threadIdx.x;
}

extern "C" __global__ void __launch_bounds__(THREADS)
    fo_add_rmsnorm(uint4* x, const uint4* src, const uint4* __restrict__ residual_in, uint4* __restrict__ residual_out,
                   const uint4* __restrict__ weight, int first, int last, int n, float eps) {
  extern __shared__ uint4 ring[];  // [STAGES][2][VPT][THREADS]
  const int lane = threadIdx.x % 32;
  const int vecs = n / VEC;
  // This warp's rows: first + warp, then every `warps` rows; each row in
  // `steps` steps of VPT vectors per lane. Two cursors walk them: the loads
  // (STAGES - 1 steps ahead, across row ends) and the sums.
  const int warp = blockIdx.x * WARPS + threadIdx.x / 32;
  const int warps = gridDim.x * WARPS;
  const int steps = (vecs + 32 * VPT - 1) / (32 * VPT);
  int load_row = first + warp, load_step = 0, load_stage = 0;
  // Every step commits a group, empty past the end, so wait_group counts stay uniform.
  auto issue = [&]() {
    if (load_row < last) {
      const long long base = static_cast<long long>(load_row) * vecs;
      const long long from = static_cast<long long>(load_row - first) * vecs;
#pragma unroll
      for (int u = 0; u < VPT; ++u) {
        const int v = lane + 32 * (load_step * VPT + u);
        const bool in = v < vecs;
        // Past the row's end: a zero-filled chunk from a valid address, never used.
        fo::cp_async_16(fo::smem_addr(slot(ring, load_stage, 0, u)), in ? src + from + v : src, in ? 16 : 0);
        fo::cp_async_16(fo::smem_addr(slot(ring, load_stage, 1, u)), in ? residual_in + base + v : residual_in,
                        in ? 16 : 0);
      }
      if (++load_step == steps) {
        load_step = 0;
        load_row += warps;
      }
      load_stage = load_stage + 1 == STAGES ? 0 : load_stage + 1;
    }
    fo::cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue();
  float squares = 0.f;
  int stage = 0;
  for (int row = first + warp; row < last; row += warps) {
    const long long base = static_cast<long long>(row) * vecs;
    for (int step = 0; step < steps; ++step) {
      issue();
      fo::cp_async_wait<STAGES - 1>();
#pragma unroll
      for (int u = 0; u < VPT; ++u) {
        const int v = lane + 32 * (step * VPT + u);
        if (v >= vecs) continue;
        const uint4 a = *slot(ring, stage, 0, u), b = *slot(ring, stage, 1, u);
        uint4 r;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const unsigned ai = word(a, i), bi = word(b, i);
          const unsigned w = pack2(low(ai) + low(bi), high(ai) + high(bi));
          // The statistics are of the rounded sum, as vLLM's are.
          squares += low(w) * low(w) + high(w) * high(w);
          word(r, i) = w;
        }
        residual_out[base + v] = r;
      }
      stage = stage + 1 == STAGES ? 0 : stage + 1;
    }
    // The row's statistics, then the second pass.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, o);
    const float scale = rsqrtf(squares / n + eps);
    squares = 0.f;
    for (int v0 = lane; v0 < vecs; v0 += 32 * UNROLL) {
      uint4 r[UNROLL], g[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int v = v0 + u * 32;
        if (v < vecs) {
          // This lane wrote residual_out[base + v] above: program order makes it visible.
          r[u] = residual_out[base + v];
          g[u] = weight[v];
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int v = v0 + u * 32;
        if (v >= vecs) continue;
        uint4 y;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const unsigned rw = word(r[u], i), gw = word(g[u], i);
          word(y, i) = pack2(low(rw) * scale * low(gw), high(rw) * scale * high(gw));
        }
        x[base + v] = y;
      }
    }
  }
  fo::cp_async_wait<0>();
}
