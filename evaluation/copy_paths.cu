// Copy throughput of 8-132 CTAs on 2 GPUs copying at once (one process, peer access): register
// copies (512 threads, 4 or 8 x 16 B in flight each) against 1-D bulk copies through a shared-memory
// ring driven by one thread, into local memory (local), into the peer's (push) and from the peer's
// (pull), 128 MiB; the destination is checked at 32 CTAs. What the all_reduce_rmsnorm ring was
// designed from (evaluation/results/copy_paths_h200x2.txt).
//   nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/copy_paths evaluation/copy_paths.cu && /tmp/copy_paths
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

template <int U>
__global__ void __launch_bounds__(512) ldst(uint4* __restrict__ dst, const uint4* __restrict__ src, long long n) {
  for (long long i0 = blockIdx.x * 512ll * U + threadIdx.x; i0 < n; i0 += (long long)gridDim.x * 512 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) { long long i = i0 + u * 512; if (i < n) v[u] = src[i]; }
#pragma unroll
    for (int u = 0; u < U; ++u) { long long i = i0 + u * 512; if (i < n) dst[i] = v[u]; }
  }
}

__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// One thread: ring of NB buffers of CH bytes; chunk c of this CTA = global chunk blockIdx + c*grid.
__global__ void bulk(char* dst, const char* src, long long bytes, int CH, int NB) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) unsigned long long bars[16];
  if (threadIdx.x != 0) return;
  for (int b = 0; b < NB; ++b) asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(sa(&bars[b])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  long long chunks = bytes / CH;
  long long mine = (chunks - blockIdx.x + gridDim.x - 1) / gridDim.x;
  auto issue = [&](long long c) {
    int b = c % NB; long long g = blockIdx.x + c * gridDim.x;
    unsigned bar = sa(&bars[b]);
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(bar), "r"(CH) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(sa(smem + (long long)b * CH)), "l"(src + g * CH), "r"(CH), "r"(bar) : "memory");
  };
  for (long long c = 0; c < NB && c < mine; ++c) issue(c);
  for (long long c = 0; c < mine; ++c) {
    int b = c % NB; unsigned parity = (c / NB) & 1;
    unsigned bar = sa(&bars[b]);
    asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1; @!p bra W; }" ::"r"(bar), "r"(parity) : "memory");
    long long g = blockIdx.x + c * gridDim.x;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + g * CH), "r"(sa(smem + (long long)b * CH)), "r"(CH) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (c >= 1 && c - 1 + NB < mine) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      issue(c - 1 + NB);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main() {
  const long long bytes = 128ll << 20;
  char *a[2], *b[2];
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d)); CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CK(cudaMalloc(&a[d], bytes)); CK(cudaMalloc(&b[d], bytes));
    CK(cudaMemset(a[d], 1, bytes)); CK(cudaMemset(b[d], 2, bytes));
    CK(cudaFuncSetAttribute(bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  }
  cudaStream_t s[2]; cudaEvent_t e0[2], e1[2];
  for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); CK(cudaStreamCreate(&s[d])); CK(cudaEventCreate(&e0[d])); CK(cudaEventCreate(&e1[d])); }
  const char* modes[3] = {"local", "push", "pull"};
  // kind: 0 ldst U4, 1 ldst U8, 2 bulk 16K x 4, 3 bulk 16K x 8, 4 bulk 32K x 6, 5 bulk 8K x 16
  const char* kinds[6] = {"ldst u4", "ldst u8", "bulk 16Kx4", "bulk 16Kx8", "bulk 32Kx6", "bulk 8Kx16"};
  int grids[5] = {8, 16, 24, 32, 132};
  printf("GB/s per GPU (both GPUs copying at once), 128 MiB, median of 10\n%-12s %-6s", "kind", "mode");
  for (int g : grids) printf(" %8d", g);
  printf("\n");
  for (int k = 0; k < 6; ++k) for (int m = 0; m < 3; ++m) {
    printf("%-12s %-6s", kinds[k], modes[m]);
    for (int g : grids) {
      std::vector<float> ts;
      if (g == 32) for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); CK(cudaMemset(b[d], 2, bytes)); CK(cudaDeviceSynchronize()); }
      for (int it = 0; it < 12; ++it) {
        for (int d = 0; d < 2; ++d) {
          CK(cudaSetDevice(d));
          char* src = m == 2 ? a[1 - d] : a[d];
          char* dst = m == 1 ? b[1 - d] : b[d];
          CK(cudaEventRecord(e0[d], s[d]));
          switch (k) {
            case 0: ldst<4><<<g, 512, 0, s[d]>>>((uint4*)dst, (uint4*)src, bytes / 16); break;
            case 1: ldst<8><<<g, 512, 0, s[d]>>>((uint4*)dst, (uint4*)src, bytes / 16); break;
            case 2: bulk<<<g, 32, 16384 * 4, s[d]>>>(dst, src, bytes, 16384, 4); break;
            case 3: bulk<<<g, 32, 16384 * 8, s[d]>>>(dst, src, bytes, 16384, 8); break;
            case 4: bulk<<<g, 32, 32768 * 6, s[d]>>>(dst, src, bytes, 32768, 6); break;
            case 5: bulk<<<g, 32, 8192 * 16, s[d]>>>(dst, src, bytes, 8192, 16); break;
          }
          CK(cudaGetLastError());
          CK(cudaEventRecord(e1[d], s[d]));
        }
        float worst = 0;
        for (int d = 0; d < 2; ++d) { CK(cudaEventSynchronize(e1[d])); float t; CK(cudaEventElapsedTime(&t, e0[d], e1[d])); worst = std::max(worst, t); }
        if (it >= 2) ts.push_back(worst);
      }
      if (g == 32) {  // the destination must now hold the source's bytes
        char* dst = m == 1 ? b[1] : b[0];
        std::vector<char> h(bytes);
        CK(cudaSetDevice(m == 1 ? 1 : 0)); CK(cudaMemcpy(h.data(), dst, bytes, cudaMemcpyDeviceToHost));
        for (long long i = 0; i < bytes; ++i) if (h[i] != 1) { printf(" BAD@%lld", i); break; }
      }
      std::sort(ts.begin(), ts.end());
      printf(" %8.1f", bytes / (ts[ts.size() / 2] * 1e-3) / 1e9);
    }
    printf("\n");
  }
  return 0;
}
