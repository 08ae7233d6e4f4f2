// The copy-engine backend's reduction (csrc/peer_reduce.cu) alone on one GPU, world 2 (one
// staged partial): output bytes per us on 4..132 CTAs, alone and with an 8192^3 cuBLAS GEMM
// beside it (the reduction launched first on a high-priority stream, as in the op). The kernel
// only ever reads local memory (the copy engines put the peers' partials there), so one GPU
// measures it fully. The planner's copy-engine rate (rust/ops/gemm_all_reduce.rs,
// copy_engine_gbps) and MAX_REDUCE_CTAS come from the "beside" numbers.
//
//   for cfg in "4 3" "2 3" "4 2"; do set -- $cfg
//     nvcc -O3 -std=c++17 -arch=sm_90a -DFO_RANKS=2 -DFO_BF16=1 -DFO_VPT=$1 -DFO_STAGES=$2 \
//       -I csrc -o /tmp/bench_peer_reduce evaluation/bench_peer_reduce.cu -lcublas && /tmp/bench_peer_reduce
//   done
// (the library runs VPT 4, STAGES 3 at world 2 on Hopper).
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#include "peer_reduce.cu"
int main() {
  const long long bytes = 64ll << 20, vectors = bytes / 16;
  const int sets = 4;
  std::vector<V4*> mine(sets), stage(sets), out(sets);
  for (int s = 0; s < sets; ++s) {
    cudaMalloc(&mine[s], bytes); cudaMalloc(&stage[s], bytes); cudaMalloc(&out[s], bytes);
    cudaMemset(mine[s], 0x3c, bytes); cudaMemset(stage[s], 0x3b, bytes);
  }
  const int smem = FO_STAGES * FO_RANKS * FO_VPT * FO_THREADS * 16;
  cudaFuncSetAttribute(fo_peer_reduce, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int g = 8192;
  __nv_bfloat16 *A, *B, *C;
  cudaMalloc(&A, 2ll * g * g); cudaMalloc(&B, 2ll * g * g); cudaMalloc(&C, 2ll * g * g);
  cudaMemset(A, 0x3c, 2ll * g * g); cudaMemset(B, 0x3c, 2ll * g * g);
  cublasHandle_t h; cublasCreate(&h);
  cudaStream_t gs, rs; cudaStreamCreateWithFlags(&gs, cudaStreamNonBlocking);
  int lo, hi; cudaDeviceGetStreamPriorityRange(&lo, &hi);
  cudaStreamCreateWithPriority(&rs, cudaStreamNonBlocking, hi);
  cublasSetStream(h, gs);
  float alpha = 1, beta = 0;
  auto gemm = [&] {
    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, g, g, g, &alpha, B, CUDA_R_16BF, g, A, CUDA_R_16BF, g, &beta, C,
                 CUDA_R_16BF, g, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  printf("VPT %d STAGES %d smem %d KiB, 64 MiB output, output bytes/us (per CTA):\n", FO_VPT, FO_STAGES, smem / 1024);
  for (int beside = 0; beside < 2; ++beside) {
    printf(beside ? "beside an 8192^3 cuBLAS GEMM:\n" : "alone:\n");
    for (int ctas : {4, 8, 12, 16, 24, 132}) {
      std::vector<float> t;
      for (int i = 0; i < 15; ++i) {
        Sources src{}; src.stage[0] = stage[i % sets];
        // The reduction first (high-priority stream: it holds its SMs), the GEMM on the rest.
        cudaEventRecord(a, rs);
        fo_peer_reduce<<<ctas, FO_THREADS, smem, rs>>>(out[i % sets], mine[i % sets], src, 0, vectors);
        cudaEventRecord(b, rs);
        if (beside) { gemm(); gemm(); }
        cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b);
        if (i >= 3) t.push_back(ms * 1e3f);
        cudaDeviceSynchronize();
      }
      std::sort(t.begin(), t.end());
      float med = t[t.size() / 2];
      printf("  %3d CTAs: %8.1f us  %7.0f B/us (%6.0f per CTA)\n", ctas, med, bytes / med, bytes / med / ctas);
    }
  }
  cudaError_t e = cudaGetLastError();
  printf("%s\n", cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
