// Sums the partials peers copied into this rank's staging slots into the
// rank's own partial, in place: out[i] += stage_0[i] + ... + stage_{s-1}[i].
//
// The copy-engine AllReduce moves bytes with no SM; this kernel is the only
// SM work it does, so it runs on the few SMs the GEMM leaves free and must
// keep HBM busy from them: 16-byte accesses, FO_UNROLL independent vectors
// per thread in flight, fp32 sums rounded once.
#include "ptx.cuh"

#ifndef FO_UNROLL
#define FO_UNROLL 4
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
__device__ __forceinline__ V4 load_stream(const V4* p) {
  V4 r;
  asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ V4 pack8(const float (&a)[8]) {
  return V4{fo::pack2(a[0], a[1]), fo::pack2(a[2], a[3]), fo::pack2(a[4], a[5]), fo::pack2(a[6], a[7])};
}

// The partial of rank `p` in rank order: this rank's own (out) at `own`,
// the peers' staging slots (in rank order, without this rank) elsewhere.
__device__ __forceinline__ const V4* partial(const V4* out, const Sources& src, int own, int p) {
  return p == own ? out : src.stage[p < own ? p : p - 1];
}

}  // namespace

// `vectors` 16-byte vectors of 8 values each; FO_RANKS partials in all (this
// rank's, number `own`, and FO_RANKS - 1 staged ones). Every rank adds the
// partials in rank order, so that all ranks get bit-identical sums.
extern "C" __global__ void __launch_bounds__(512) fo_peer_reduce(V4* out, Sources src, int own, long long vectors) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (FO_UNROLL - 1) * stride < vectors; i += FO_UNROLL * stride) {
    float acc[FO_UNROLL][8];
#pragma unroll
    for (int u = 0; u < FO_UNROLL; ++u) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[u][j] = 0.f;
    }
    V4 v[FO_RANKS][FO_UNROLL];
#pragma unroll
    for (int p = 0; p < FO_RANKS; ++p) {
      const V4* from = partial(out, src, own, p);
#pragma unroll
      for (int u = 0; u < FO_UNROLL; ++u) v[p][u] = load_stream(from + i + u * stride);
    }
#pragma unroll
    for (int p = 0; p < FO_RANKS; ++p) {
#pragma unroll
      for (int u = 0; u < FO_UNROLL; ++u) add8(acc[u], v[p][u]);
    }
#pragma unroll
    for (int u = 0; u < FO_UNROLL; ++u) out[i + u * stride] = pack8(acc[u]);
  }
  // The remainder, one vector at a time.
  for (; i < vectors; i += stride) {
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = 0.f;
#pragma unroll
    for (int p = 0; p < FO_RANKS; ++p) add8(acc, partial(out, src, own, p)[i]);
    out[i] = pack8(acc);
  }
}
