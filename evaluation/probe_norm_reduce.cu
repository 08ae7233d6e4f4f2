// The SM side of all_reduce_rmsnorm alone, on one GPU: csrc/allreduce_rmsnorm.cu's copy-engine
// kernel (fo_arn_ce) summing two ranks' rows that already lie in local memory (its one-shot form:
// this rank's x and the peer's landed rows, plus the residual; r and the normalized rows written),
// so no flag, no peer and no copy engine is in the time: the rate at which 8-32 CTAs reduce.
// A plain copy kernel of the same shape (512 threads, 4 vectors in flight) is the reference.
//   nvcc -O3 -arch=sm_90a -std=c++17 -Icsrc -DFO_BF16=1 -DFO_THREADS=512 -DFO_UNROLL=4 -DFO_RING=0 \
//        -DFO_RING_BYTES=196608 evaluation/probe_norm_reduce.cu -o /tmp/pnr && /tmp/pnr [tokens]
#include "../csrc/allreduce_rmsnorm.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.cuh"
#include "probe_copy.cuh"

__global__ void fill(uint4* p, long long n, unsigned seed) {
  for (long long i = blockIdx.x * 256ll + threadIdx.x; i < n; i += 256ll * gridDim.x) {
    uint4 v;
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
    for (int k = 0; k < 4; ++k) {
      h = h * 1664525u + 1013904223u;
      // Two 16-bit values of modest size (bf16 or fp16 alike: exponent bits near 1.0).
      const unsigned a = 0x3c00u | (h & 0x3ffu), b = 0x3c00u | ((h >> 16) & 0x3ffu);
      (&v.x)[k] = (a ^ ((h >> 15) & 1u) << 15) | (b ^ ((h >> 31) & 1u) << 15) << 16;
    }
    p[i] = v;
  }
}

int main(int argc, char** argv) {
  const int tokens = argc > 1 ? std::atoi(argv[1]) : 16384, hidden = argc > 2 ? std::atoi(argv[2]) : 8192;
  const long long row = hidden * 2ll, bytes = tokens * row, vecs = bytes / 16;
  char *x, *residual, *weight, *out, *rout, *buf;
  CK(cudaMalloc(&x, bytes));
  CK(cudaMalloc(&residual, bytes));
  CK(cudaMalloc(&weight, row));
  CK(cudaMalloc(&out, bytes));
  CK(cudaMalloc(&rout, bytes));
  CK(cudaMalloc(&buf, 65536 + 3 * bytes));
  CK(cudaMemset(buf, 0, 65536));
  fill<<<1024, 256>>>(reinterpret_cast<uint4*>(x), vecs, 1);
  fill<<<1024, 256>>>(reinterpret_cast<uint4*>(residual), vecs, 2);
  fill<<<16, 256>>>(reinterpret_cast<uint4*>(weight), row / 16, 3);
  fill<<<1024, 256>>>(reinterpret_cast<uint4*>(buf + 65536), vecs, 4);
  CK(cudaGetLastError());
  Params p{};
  p.x = reinterpret_cast<const uint4*>(x);
  p.residual = reinterpret_cast<const uint4*>(residual);
  p.weight = reinterpret_cast<const uint4*>(weight);
  p.out = reinterpret_cast<uint4*>(out);
  p.residual_out = reinterpret_cast<uint4*>(rout);
  p.bases[0] = p.bases[1] = reinterpret_cast<unsigned long long>(buf);
  p.slot_bytes = bytes;
  p.out_offset = 65536 + bytes;
  p.res_offset = 65536 + 2 * bytes;
  p.rank = 0;
  p.world = 2;
  p.tokens = tokens;
  p.hidden = hidden;
  p.eps = 1e-6f;
  p.residual_full = 1;
  p.stages = 1;
  p.oneshot = 1;
  p.copy_engines = 1;
  const int smem = FO_RING ? FO_RING_BYTES : 0;
  CK(cudaFuncSetAttribute(fo_arn_ce, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto median_us = [&](auto launch) {
    std::vector<float> t;
    for (int i = 0; i < 12; ++i) {
      CK(cudaEventRecord(e0));
      launch();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 2) t.push_back(ms * 1e3f);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  std::printf("# tokens %d hidden %d threads %d unroll %d ring %d; GB/s per CTA = bytes moved / time / CTAs\n",
              tokens, hidden, FO_THREADS, FO_UNROLL, FO_RING);
  std::printf("ctas   reduce_us  GB/s/CTA (5 x %.0f MB)   copy_us  GB/s/CTA (2 x %.0f MB)\n", bytes / 1e6,
              bytes / 1e6);
  for (int ctas : {8, 16, 32}) {
    const int threads = FO_THREADS + (FO_RING ? 32 : 0);
    const float r = median_us([&] { fo_arn_ce<<<ctas, threads, smem>>>(p, 0, tokens, 1); });
    CK(cudaGetLastError());
    const float c = median_us([&] {
      reg_copy<<<ctas, 512>>>(reinterpret_cast<uint4*>(out), reinterpret_cast<const uint4*>(x), vecs);
    });
    CK(cudaGetLastError());
    std::printf("%4d %11.1f %9.1f %24.1f %9.1f\n", ctas, r, 5.0 * bytes / r / 1e3 / ctas, c,
                2.0 * bytes / c / 1e3 / ctas);
  }
  CK(cudaDeviceSynchronize());
  // With a second GPU: the same kernel on 32 CTAs while copy-engine copies of x move between the
  // GPUs both ways (what the copy-engine mode runs beside its kernels), against each alone.
  int gpus = 0;
  CK(cudaGetDeviceCount(&gpus));
  if (gpus < 2) return 0;
  char* far;
  cudaStream_t copy, copy_back, work;
  CK(cudaDeviceEnablePeerAccess(1, 0));
  CK(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&work, cudaStreamNonBlocking));
  CK(cudaSetDevice(1));
  CK(cudaDeviceEnablePeerAccess(0, 0));
  CK(cudaMalloc(&far, 2 * bytes));
  CK(cudaStreamCreateWithFlags(&copy_back, cudaStreamNonBlocking));
  CK(cudaSetDevice(0));
  cudaEvent_t c0, c1, b0, b1, k0, k1;
  for (cudaEvent_t* e : {&c0, &c1, &k0, &k1}) CK(cudaEventCreate(e));
  CK(cudaSetDevice(1));
  CK(cudaEventCreate(&b0));
  CK(cudaEventCreate(&b1));
  CK(cudaSetDevice(0));
  const int ctas = argc > 3 ? std::atoi(argv[3]) : 32, threads = FO_THREADS + (FO_RING ? 32 : 0);
  std::printf("# both ways: %.0f MB to GPU 1 (GPU 0's copy engine) and from GPU 1's far buffer into GPU 0's "
              "slot area; kernel on %d CTAs of GPU 0\nmode        kernel_us  copy_us  copy_back_us\n",
              bytes / 1e6, ctas);
  for (int mode = 0; mode < 3; ++mode) {  // 0: kernel alone, 1: copies alone, 2: together
    std::vector<float> kt, ct, bt;
    for (int i = 0; i < 8; ++i) {
      CK(cudaDeviceSynchronize());
      CK(cudaSetDevice(1));
      CK(cudaDeviceSynchronize());
      CK(cudaSetDevice(0));
      if (mode >= 1) {
        CK(cudaEventRecord(c0, copy));
        CK(cudaMemcpyPeerAsync(far, 1, x, 0, bytes, copy));
        CK(cudaEventRecord(c1, copy));
        CK(cudaSetDevice(1));
        CK(cudaEventRecord(b0, copy_back));
        CK(cudaMemcpyPeerAsync(buf + 65536 + bytes, 0, far + bytes, 1, bytes, copy_back));
        CK(cudaEventRecord(b1, copy_back));
        CK(cudaSetDevice(0));
      }
      if (mode != 1) {
        CK(cudaEventRecord(k0, work));
        fo_arn_ce<<<ctas, threads, smem, work>>>(p, 0, tokens, 1);
        CK(cudaEventRecord(k1, work));
      }
      CK(cudaDeviceSynchronize());
      CK(cudaSetDevice(1));
      CK(cudaDeviceSynchronize());
      CK(cudaSetDevice(0));
      float ms;
      if (mode != 1) {
        CK(cudaEventElapsedTime(&ms, k0, k1));
        kt.push_back(ms * 1e3f);
      }
      if (mode >= 1) {
        CK(cudaEventElapsedTime(&ms, c0, c1));
        ct.push_back(ms * 1e3f);
        CK(cudaSetDevice(1));
        CK(cudaEventElapsedTime(&ms, b0, b1));
        CK(cudaSetDevice(0));
        bt.push_back(ms * 1e3f);
      }
    }
    auto med = [](std::vector<float> v) {
      if (v.empty()) return 0.f;
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const char* names[3] = {"kernel", "copies", "together"};
    std::printf("%-10s %10.1f %8.1f %13.1f\n", names[mode], med(kt), med(ct), med(bt));
  }
  return 0;
}
