// Sums this rank's own partial and the partials peers copied into its
// staging slots: out[i] = mine[i] + stage_0[i] + ... + stage_{s-1}[i]. The
// AllReduce sums in place (mine == out); the ReduceScatter reads its own
// chunk from the GEMM's send buffer and writes the output rows.
//
// The copy-engine AllReduce moves bytes with no SM; this kernel is the only
// SM work it does, so it runs on the few SMs the GEMM leaves free and must
// keep HBM busy from them: 16-byte accesses, several tiles of loads in
// flight per block, fp32 sums rounded once.
#include "ptx.cuh"

// FO_VPT: vectors per thread per partial per tile; FO_STAGES: tiles in flight.
#ifndef FO_VPT
#define FO_VPT 4
#endif
#ifndef FO_STAGES
#define FO_STAGES 3
#endif
// FO_RANKS: the world size, a compile-time constant so that the loads of
// every partial are unrolled and in flight together.
#define FO_MAX_SOURCES 7
#if FO_RANKS < 2 || FO_RANKS > FO_MAX_SOURCES + 1
#error "FO_RANKS must be in 2..8"
#endif

struct alignas(16) V4 {
  unsigned x, y, z, w;
};

struct Sources {
  const V4* stage[FO_MAX_SOURCES];
};

namespace {

__device__ __forceinline__ float bits_to_float(unsigned v) {
  float f;
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"(v));
  return f;
}

__device__ __forceinline__ void unpack2(unsigned v, float& lo, float& hi) {
#if FO_BF16
  lo = bits_to_float(v << 16);
  hi = bits_to_float(v & 0xffff0000u);
#else
  unsigned short l = v & 0xffffu, h = v >> 16;
  asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(l));
  asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(h));
#endif
}

__device__ __forceinline__ void add8(float (&acc)[8], V4 v) {
  float lo, hi;
  unpack2(v.x, lo, hi); acc[0] += lo; acc[1] += hi;
  unpack2(v.y, lo, hi); acc[2] += lo; acc[3] += hi;
  unpack2(v.z, lo, hi); acc[4] += lo; acc[5] += hi;
  unpack2(v.w, lo, hi); acc[6] += lo; acc[7] += hi;
}

// Streaming loads: each value is read once, keep it out of L1.
__device__ __forceinline__ V4 pack8(const float (&a)[8]) {
  return V4{fo::pack2(a[0], a[1]), fo::pack2(a[2], a[3]), fo::pack2(a[4], a[5]), fo::pack2(a[6], a[7])};
}

// The partial of rank `p` in rank order: this rank's own (mine) at `own`,
// the peers' staging slots (in rank order, without this rank) elsewhere.
__device__ __forceinline__ const V4* partial(const V4* mine, const Sources& src, int own, int p) {
  return p == own ? mine : src.stage[p < own ? p : p - 1];
}

}  // namespace

// Each block walks tiles of FO_VPT * 512 vectors (per partial) in a grid
// stride. Loads go global -> shared with cp.async, FO_STAGES tiles ahead:
// they hold no registers while in flight, so one block keeps ~192 KiB of
// loads outstanding, which is what a few SMs need to draw a large share of
// HBM bandwidth (plain loads into registers managed ~60 GB/s per SM). Each
// thread reads back only what it loaded itself, so no block barrier is needed.
#define FO_THREADS 512
#define FO_TILE (FO_VPT * FO_THREADS)

__device__ __forceinline__ unsigned smem_u32(const void* p) { return fo::smem_addr(p); }

__device__ __forceinline__ void issue_tile(V4* ring, int stage, const V4* mine, const Sources& src, int own,
                                           long long tile, long long vectors) {
  const long long first = tile * FO_TILE + threadIdx.x;
#pragma unroll
  for (int p = 0; p < FO_RANKS; ++p) {
    const V4* from = partial(mine, src, own, p);
#pragma unroll
    for (int u = 0; u < FO_VPT; ++u) {
      const long long i = first + u * FO_THREADS;
      const bool in = i < vectors;
      V4* slot = ring + ((stage * FO_RANKS + p) * FO_VPT + u) * FO_THREADS + threadIdx.x;
      // Past the end: a zero-filled chunk from a valid address, never stored.
      fo::cp_async_16(smem_u32(slot), in ? from + i : from, in ? 16 : 0);
    }
  }
}

// `vectors` 16-byte vectors of 8 values each; FO_RANKS partials in all (this
// rank's, number `own`, and FO_RANKS - 1 staged ones). Every rank adds the
// partials in rank order, so that all ranks get bit-identical sums. `mine`
// and `out` are equal or do not overlap.
extern "C" __global__ void __launch_bounds__(FO_THREADS, 1) fo_peer_reduce(V4* out, const V4* mine, Sources src,
                                                                           int own, long long vectors) {
  extern __shared__ V4 ring[];  // [FO_STAGES][FO_RANKS][FO_VPT][FO_THREADS]
  const long long tiles = (vectors + FO_TILE - 1) / FO_TILE;
  long long next = blockIdx.x;
#pragma unroll
  for (int s = 0; s < FO_STAGES - 1; ++s) {
    if (next < tiles) issue_tile(ring, s, mine, src, own, next, vectors);
    fo::cp_async_commit();
    next += gridDim.x;
  }
  int stage = 0;
  for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    // Keep FO_STAGES - 1 tiles in flight behind the one about to be summed.
    if (next < tiles) issue_tile(ring, (stage + FO_STAGES - 1) % FO_STAGES, mine, src, own, next, vectors);
    fo::cp_async_commit();
    next += gridDim.x;
    fo::cp_async_wait<FO_STAGES - 1>();
    const long long first = tile * FO_TILE + threadIdx.x;
#pragma unroll
    for (int u = 0; u < FO_VPT; ++u) {
      const long long i = first + u * FO_THREADS;
      float acc[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = 0.f;
#pragma unroll
      for (int p = 0; p < FO_RANKS; ++p) add8(acc, ring[((stage * FO_RANKS + p) * FO_VPT + u) * FO_THREADS + threadIdx.x]);
      if (i < vectors) out[i] = pack8(acc);
    }
    stage = (stage + 1) % FO_STAGES;
  }
  fo::cp_async_wait<0>();
}
