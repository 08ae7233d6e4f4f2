// vLLM's fused_add_rms_norm on rows first..last-1 of an [M, N] output:
//   r = x + residual_in (fp32);  residual_out = r;  x = r * rsqrt(mean(r^2) + eps) * weight
// in place on x (the reduced GEMM output), rounded once to 16 bits.
//
// It runs on the communication stream right after each wave group's
// AllReduce, on the few SMs the GEMM leaves free, so most of the norm hides
// behind the rest of the GEMM. One block per row at a time (grid-stride over
// the rows), each thread holding its share of the row in fp32 registers:
// N <= FO_MAX_N, a multiple of 8 (16-byte accesses).
#ifndef FO_BF16
#define FO_BF16 1
#endif
#ifndef FO_MAX_N
#define FO_MAX_N 16384
#endif

namespace {
constexpr int THREADS = 256;
constexpr int VEC = 8;
constexpr int MAX_VECS = (FO_MAX_N / VEC + THREADS - 1) / THREADS;  // 16-byte vectors per thread

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
  __shared__ float partial[THREADS / 32];
  const int vecs = n / VEC;
  for (int row = first + blockIdx.x; row < last; row += gridDim.x) {
    const long long base = static_cast<long long>(row) * vecs;
    float r[MAX_VECS][VEC];
    float squares = 0.f;
#pragma unroll
    for (int j = 0; j < MAX_VECS; ++j) {
      const int v = threadIdx.x + j * THREADS;
      if (v < vecs) {
        float a[VEC], b[VEC];
        unpack(x[base + v], a);
        unpack(residual_in[base + v], b);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          r[j][e] = a[e] + b[e];
          squares += r[j][e] * r[j][e];
        }
        residual_out[base + v] = pack(r[j]);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = squares;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) total += partial[w];
    const float scale = rsqrtf(total / n + eps);
#pragma unroll
    for (int j = 0; j < MAX_VECS; ++j) {
      const int v = threadIdx.x + j * THREADS;
      if (v < vecs) {
        float g[VEC];
        unpack(weight[v], g);
#pragma unroll
        for (int e = 0; e < VEC; ++e) r[j][e] = r[j][e] * scale * g[e];
        x[base + v] = pack(r[j]);
      }
    }
    // `partial` is rewritten by the next row.
    __syncthreads();
  }
}
