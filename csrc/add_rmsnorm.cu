// vLLM's fused_add_rms_norm on rows first..last-1 of an [M, N] output:
//   r = x + residual_in (rounded to 16 bits, as vLLM does);  residual_out = r;
//   x = r * rsqrt(mean(r^2) + eps) * weight   (fp32 statistics and products)
// in place on x (the reduced GEMM output).
//
// It runs on the communication stream right after each wave group's
// AllReduce, on the few SMs the GEMM leaves free, so it must keep memory
// busy from few SMs: one warp per row (no block barriers), 32 warps per
// block, 4 independent 16-byte loads per lane in flight. A first pass adds,
// stores the residual and sums the squares; the second re-reads the residual
// this lane just wrote (from L2) and writes the normalized row. N is a
// multiple of 8 (16-byte accesses); any N works.
#ifndef FO_BF16
#define FO_BF16 1
#endif

namespace {
constexpr int THREADS = 1024;
constexpr int WARPS = THREADS / 32;
constexpr int VEC = 8;
constexpr int UNROLL = 4;

__device__ __forceinline__ float to_float(unsigned short h) {
#if FO_BF16
  return __uint_as_float(static_cast<unsigned>(h) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}

__device__ __forceinline__ unsigned short from_float(float f) {
  unsigned short h;
#if FO_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
  return h;
}

__device__ __forceinline__ void unpack(uint4 v, float (&f)[VEC]) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = to_float(w[i] & 0xffffu);
    f[2 * i + 1] = to_float(w[i] >> 16);
  }
}

__device__ __forceinline__ uint4 pack(const float (&f)[VEC]) {
  unsigned w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = from_float(f[2 * i]) | (static_cast<unsigned>(from_float(f[2 * i + 1])) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
    fo_add_rmsnorm(uint4* __restrict__ x, const uint4* __restrict__ residual_in, uint4* __restrict__ residual_out,
                   const uint4* __restrict__ weight, int first, int last, int n, float eps) {
  const int lane = threadIdx.x % 32;
  const int vecs = n / VEC;
  const int warps = gridDim.x * WARPS;
  for (int row = first + blockIdx.x * WARPS + threadIdx.x / 32; row < last; row += warps) {
    const long long base = static_cast<long long>(row) * vecs;
    float squares = 0.f;
    for (int v0 = lane; v0 < vecs; v0 += 32 * UNROLL) {
      uint4 a[UNROLL], b[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int v = v0 + u * 32;
        if (v < vecs) {
          a[u] = x[base + v];
          b[u] = residual_in[base + v];
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int v = v0 + u * 32;
        if (v >= vecs) continue;
        float fa[VEC], fb[VEC];
        unpack(a[u], fa);
        unpack(b[u], fb);
        const uint4 r = [&] {
          float s[VEC];
#pragma unroll
          for (int e = 0; e < VEC; ++e) s[e] = fa[e] + fb[e];
          return pack(s);
        }();
        float fr[VEC];
        unpack(r, fr);
#pragma unroll
        for (int e = 0; e < VEC; ++e) squares += fr[e] * fr[e];
        residual_out[base + v] = r;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, o);
    const float scale = rsqrtf(squares / n + eps);
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
        float fr[VEC], fg[VEC];
        unpack(r[u], fr);
        unpack(g[u], fg);
#pragma unroll
        for (int e = 0; e < VEC; ++e) fr[e] = fr[e] * scale * fg[e];
        x[base + v] = pack(fr);
      }
    }
  }
}
