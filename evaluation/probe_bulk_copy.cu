// Per-CTA copy bandwidth on one GPU: register copies (512 threads, 4 x 16 B in flight each) against TMA
// bulk copies through an 8-stage shared-memory ring driven by one thread, 256 MiB, 2-132 CTAs.
//   nvcc -O3 -arch=sm_90a -std=c++17 evaluation/probe_bulk_copy.cu -o /tmp/bc && /tmp/bc
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

#include "probe_copy.cuh"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("err %s line %d\n", cudaGetErrorString(e), __LINE__); return 1; } } while (0)

__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

template <int S, int K, int CHUNK>
__global__ void bulk_copy(char* to, const char* from, long long bytes) {
  extern __shared__ __align__(128) char ring[];
  __shared__ __align__(8) unsigned long long full[S];
  const long long chunks = bytes / CHUNK;
  const long long per = (chunks + gridDim.x - 1) / gridDim.x;
  const long long c0 = per * blockIdx.x, c1 = min(chunks, c0 + per);
  if (threadIdx.x != 0) return;
  for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(sa(&full[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  auto load = [&](long long c) {
    const int s = (int)((c - c0) % S);
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(sa(&full[s])), "r"(CHUNK) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(sa(ring + s * CHUNK)), "l"(from + c * CHUNK), "r"(CHUNK), "r"(sa(&full[s])) : "memory");
  };
  for (long long c = c0; c < min(c1, c0 + S); ++c) load(c);
  for (long long c = c0; c < c1; ++c) {
    const long long i = c - c0;
    const int s = (int)(i % S);
    const unsigned parity = (unsigned)((i / S) & 1);
    asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1; @!p bra W; }"
                 ::"r"(sa(&full[s])), "r"(parity) : "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(to + c * CHUNK), "r"(sa(ring + s * CHUNK)), "r"(CHUNK) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(K) : "memory");
    // store i - K finished reading its stage: refill it with chunk i - K + S
    const long long j = i - K;
    if (j >= 0 && c0 + j + S < c1) load(c0 + j + S);
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main() {
  const long long bytes = 256ll << 20;
  char *a, *b;
  CK(cudaMalloc(&a, bytes)); CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes)); CK(cudaMemset(b, 0, bytes));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  const int S = 8, K = 3, CHUNK = 16384;
  auto bk = bulk_copy<S, K, CHUNK>;
  CK(cudaFuncSetAttribute(bk, cudaFuncAttributeMaxDynamicSharedMemorySize, S * CHUNK));
  const int grids[] = {2, 4, 8, 16, 32, 64, 132};
  for (int g : grids) {
    float best_r = 1e9, best_b = 1e9;
    for (int it = 0; it < 10; ++it) {
      cudaEventRecord(e0); reg_copy<<<g, 512>>>((uint4*)b, (const uint4*)a, bytes / 16); cudaEventRecord(e1);
      CK(cudaEventSynchronize(e1)); float ms; cudaEventElapsedTime(&ms, e0, e1); if (ms < best_r) best_r = ms;
      cudaEventRecord(e0); bk<<<g, 32, S * CHUNK>>>(b, a, bytes); cudaEventRecord(e1);
      CK(cudaEventSynchronize(e1)); cudaEventElapsedTime(&ms, e0, e1); if (ms < best_b) best_b = ms;
    }
    CK(cudaGetLastError());
    printf("ctas %4d  reg %8.1f us %7.1f GB/s/SM   bulk %8.1f us %7.1f GB/s/SM  (copy GB/s total reg %.0f bulk %.0f)\n", g,
           best_r * 1e3, bytes / (best_r * 1e-3) / 1e9 / g, best_b * 1e3, bytes / (best_b * 1e-3) / 1e9 / g,
           bytes / (best_r * 1e-3) / 1e9, bytes / (best_b * 1e-3) / 1e9);
  }
  // check
  char* h = (char*)malloc(1 << 20);
  CK(cudaMemcpy(h, b + bytes - (1 << 20), 1 << 20, cudaMemcpyDeviceToHost));
  int bad = 0; for (int i = 0; i < (1 << 20); ++i) bad += h[i] != 1;
  printf("tail check bad=%d\n", bad);
  return 0;
}
