// PTX wrappers shared by the kernels. Written against PTX directly (no CUDA
// headers), so NVRTC compiles every kernel with nothing but its own sources.
#pragma once

namespace fo {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

// 16-byte async copy global -> shared; src_bytes == 0 zero-fills the chunk,
// which is how rows past M / N and columns past K are masked.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D += A(16x16, row) * B(16x8, col), fp32 accumulate. FO_BF16 selects the type.
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#if FO_BF16
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Two fp32 values -> packed pair of 16-bit values, `lo` in the low half
// (the lower address once stored).
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  unsigned r;
#if FO_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

// The two 16-bit values of a 32-bit word as floats, the low half first
// (FO_BF16 selects the type), and the words of a 16-byte vector.
#if FO_BF16
__device__ __forceinline__ float low(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float high(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
#else
__device__ __forceinline__ float half_to_float(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ float low(unsigned w) { return half_to_float(w & 0xffffu); }
__device__ __forceinline__ float high(unsigned w) { return half_to_float(w >> 16); }
#endif
// a + b and a * b of two pairs of 16-bit values, each result rounded once
// (the fma forms, which sm_80 has for bf16x2 too): one instruction a pair
// where unpacking to fp32 and packing again takes five or more.
__device__ __forceinline__ unsigned fma2(unsigned a, unsigned b, unsigned c) {
  unsigned d;
#if FO_BF16
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#else
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#endif
  return d;
}
#if FO_BF16
constexpr unsigned ONES2 = 0x3f803f80u;  // 1.0, 1.0
#else
constexpr unsigned ONES2 = 0x3c003c00u;
#endif
constexpr unsigned NEG_ZEROS2 = 0x80008000u;  // -0.0 twice: x * y + (-0) keeps the sign of a zero product
// The larger of each pair of 16-bit values, a NaN (the canonical one) where either is NaN.
__device__ __forceinline__ unsigned max_nan2(unsigned a, unsigned b) {
  unsigned d;
#if FO_BF16
  asm("max.NaN.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
#else
  asm("max.NaN.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
#endif
  return d;
}
__device__ __forceinline__ unsigned add2(unsigned a, unsigned b) { return fma2(a, ONES2, b); }
__device__ __forceinline__ unsigned mul2(unsigned a, unsigned b) { return fma2(a, b, NEG_ZEROS2); }

__device__ __forceinline__ unsigned& word(uint4& v, int i) { return reinterpret_cast<unsigned*>(&v)[i]; }
__device__ __forceinline__ unsigned word(const uint4& v, int i) { return reinterpret_cast<const unsigned*>(&v)[i]; }

// The signal: a release at GPU scope, so every store the block made before
// the preceding __syncthreads() is visible to whoever observes the count.
__device__ __forceinline__ void signal_add(unsigned* counter, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(counter), "r"(v) : "memory");
}

// The same at system scope: the counter lives in another GPU's memory and
// the stores it publishes crossed NVLink.
__device__ __forceinline__ void signal_add_sys(unsigned* counter, unsigned v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;\n" ::"l"(counter), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned load_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The same at GPU scope: a word only this GPU's kernels write.
__device__ __forceinline__ unsigned load_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

}  // namespace fo
