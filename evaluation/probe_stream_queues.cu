// Do the copy-engine backend's streams block each other through shared
// hardware queues? One GPU, no peers needed.
//
// The copy-engine exchange puts a stream memory wait (for a peer's flag) on
// one stream and the next chunk's copy on another. The driver maps streams
// onto a fixed number of hardware queues (CUDA_DEVICE_MAX_CONNECTIONS,
// default 8); two streams on one queue are serialized, so a wait on one
// holds back the other's work. On 2x H200 the 8-chunk pipelined
// ReduceScatter ran no faster than one unchunked exchange, as if that
// happened; this program measures whether it can.
//
// 1. blocked pairs: for pairs (i, j) of `streams` non-blocking streams,
//    stream i waits on a host-mapped flag while stream j runs a tiny kernel;
//    the pair is blocked if the kernel has not finished 20 ms later.
// 2. pipeline: 8 chunks of 4 MiB; a copy stream copies chunk c (copy
//    engine) and writes flag c with a stream memory write; a reduce stream
//    waits for flag c (stream memory wait) and sums chunk c on 8 CTAs. With
//    independent queues the pipeline takes ~max(copies, sums); serialized,
//    their sum. `extra` streams are created between the two (the library's
//    streams are made after torch's and NCCL's).
//
//   nvcc -O2 -arch=sm_90 -o /tmp/probe evaluation/probe_stream_queues.cu -lcuda
//   /tmp/probe [streams=16] [extra=0]
//   CUDA_DEVICE_MAX_CONNECTIONS=32 /tmp/probe
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "probe_check.cuh"

__global__ void tiny(int* p) {
  if (threadIdx.x == 0) atomicAdd(p, 1);
}

// out = a + b over n 16-byte vectors of 8 bf16 values each, summed as fp32
// (the copy-engine reduction's arithmetic; its loads are plain here).
__global__ void sum2(uint4* out, const uint4* a, const uint4* b, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    uint4 x = a[i], y = b[i], r;
    unsigned* xs = &x.x;
    unsigned* ys = &y.x;
    unsigned* rs = &r.x;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float lo = __uint_as_float(xs[k] << 16) + __uint_as_float(ys[k] << 16);
      float hi = __uint_as_float(xs[k] & 0xffff0000u) + __uint_as_float(ys[k] & 0xffff0000u);
      rs[k] = (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u);
    }
    out[i] = r;
  }
}

static int blocked_pairs(int n) {
  std::vector<cudaStream_t> s(n);
  for (auto& x : s) CK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  unsigned* flag = nullptr;
  CK(cudaHostAlloc(&flag, sizeof(unsigned), cudaHostAllocMapped));
  unsigned* dflag = nullptr;
  CK(cudaHostGetDevicePointer(&dflag, flag, 0));
  int* counter = nullptr;
  CK(cudaMalloc(&counter, sizeof(int)));
  cudaEvent_t done, released;
  CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&released, cudaEventDisableTiming));
  int blocked = 0, pairs = 0;
  std::printf("blocked pairs among %d streams (row: the waiting stream, column: the stream that runs a kernel)\n", n);
  for (int i = 0; i < n; ++i) {
    std::printf("  %2d ", i);
    std::fflush(stdout);
    for (int j = 0; j < n; ++j) {
      if (i == j) {
        std::printf(" .");
        continue;
      }
      *(volatile unsigned*)flag = 0;
      CKD(cuStreamWaitValue32((CUstream)s[i], (CUdeviceptr)dflag, 1, CU_STREAM_WAIT_VALUE_GEQ));
      CK(cudaEventRecord(released, s[i]));
      tiny<<<1, 32, 0, s[j]>>>(counter);
      CK(cudaGetLastError());
      CK(cudaEventRecord(done, s[j]));
      auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
      cudaError_t q = cudaErrorNotReady;
      while (std::chrono::steady_clock::now() < until && (q = cudaEventQuery(done)) == cudaErrorNotReady) {
        std::this_thread::yield();
      }
      const bool b = q == cudaErrorNotReady;
      *(volatile unsigned*)flag = 1;
      // Bounded: a wait that the host's store does not release ends the program.
      until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while ((q = cudaEventQuery(released)) == cudaErrorNotReady && std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
      }
      if (q != cudaSuccess) {
        std::printf("\nthe wait on stream %d was not released by the host's store (%s): stopping\n", i,
                    cudaGetErrorString(q));
        std::exit(2);
      }
      CK(cudaDeviceSynchronize());
      blocked += b;
      ++pairs;
      std::printf(" %c", b ? 'X' : '-');
    }
    std::printf("\n");
  }
  std::printf("blocked: %d of %d pairs\n", blocked, pairs);
  for (auto& x : s) CK(cudaStreamDestroy(x));
  CK(cudaFreeHost(flag));
  CK(cudaFree(counter));
  CK(cudaEventDestroy(done));
  CK(cudaEventDestroy(released));
  return blocked;
}

struct Pipe {
  cudaStream_t copies, reduces;
  std::vector<cudaStream_t> extra;
  char *src, *dst, *other, *out;
  CUdeviceptr flags;
  unsigned epoch = 0;
};

// One pass: the copies of `chunks` chunks of `bytes` each, and/or their sums;
// flags gate each sum on its copy when both run. Returns microseconds.
static float pass(Pipe& p, int chunks, size_t bytes, bool copy, bool sum, bool use_events) {
  cudaEvent_t start, end, cdone, rdone;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&end));
  CK(cudaEventCreateWithFlags(&cdone, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&rdone, cudaEventDisableTiming));
  std::vector<cudaEvent_t> ev(chunks);
  for (auto& e : ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  ++p.epoch;
  CK(cudaEventRecord(start, p.copies));
  CK(cudaStreamWaitEvent(p.reduces, start, 0));
  const long long vectors = (long long)(bytes / 16);
  for (int c = 0; c < chunks; ++c) {
    const size_t off = (size_t)c * bytes;
    if (copy) {
      CK(cudaMemcpyAsync(p.dst + off, p.src + off, bytes, cudaMemcpyDeviceToDevice, p.copies));
      if (use_events) {
        CK(cudaEventRecord(ev[c], p.copies));
      } else {
        CKD(cuStreamWriteValue32((CUstream)p.copies, p.flags + 4 * c, p.epoch, CU_STREAM_WRITE_VALUE_DEFAULT));
      }
    }
    if (sum) {
      if (copy) {
        if (use_events) {
          CK(cudaStreamWaitEvent(p.reduces, ev[c], 0));
        } else {
          CKD(cuStreamWaitValue32((CUstream)p.reduces, p.flags + 4 * c, p.epoch, CU_STREAM_WAIT_VALUE_GEQ));
        }
      }
      sum2<<<8, 512, 0, p.reduces>>>((uint4*)(p.out + off), (const uint4*)(p.dst + off),
                                     (const uint4*)(p.other + off), vectors);
      CK(cudaGetLastError());
    }
  }
  CK(cudaEventRecord(cdone, p.copies));
  CK(cudaEventRecord(rdone, p.reduces));
  CK(cudaStreamWaitEvent(p.copies, rdone, 0));
  CK(cudaEventRecord(end, p.copies));
  CK(cudaEventSynchronize(end));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, start, end));
  for (auto& e : ev) CK(cudaEventDestroy(e));
  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(end));
  CK(cudaEventDestroy(cdone));
  CK(cudaEventDestroy(rdone));
  return ms * 1000.f;
}

static float median_pass(Pipe& p, int chunks, size_t bytes, bool copy, bool sum, bool use_events) {
  std::vector<float> t;
  for (int i = 0; i < 25; ++i) {
    float v = pass(p, chunks, bytes, copy, sum, use_events);
    if (i >= 5) t.push_back(v);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

static void pipeline(int extra) {
  Pipe p;
  int lo = 0, hi = 0;
  CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  CK(cudaStreamCreateWithPriority(&p.copies, cudaStreamNonBlocking, hi));
  p.extra.resize(extra);
  for (auto& x : p.extra) CK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithPriority(&p.reduces, cudaStreamNonBlocking, hi));
  const int chunks = 8;
  const size_t bytes = 4u << 20, total = chunks * bytes;
  CK(cudaMalloc(&p.src, total));
  CK(cudaMalloc(&p.dst, total));
  CK(cudaMalloc(&p.other, total));
  CK(cudaMalloc(&p.out, total));
  CK(cudaMemset(p.src, 0x3c, total));
  CK(cudaMemset(p.other, 0x3c, total));
  CKD(cuMemAlloc(&p.flags, 4 * chunks));
  CKD(cuMemsetD32(p.flags, 0, chunks));
  const float copies = median_pass(p, chunks, bytes, true, false, false);
  const float sums = median_pass(p, chunks, bytes, false, true, false);
  const float flags = median_pass(p, chunks, bytes, true, true, false);
  const float events = median_pass(p, chunks, bytes, true, true, true);
  std::printf("pipeline, %d chunks of %zu MiB, %d streams made between the copy and reduce streams:\n", chunks,
              bytes >> 20, extra);
  std::printf("  copies alone %.1f us, sums alone %.1f us (sum of both %.1f, max %.1f)\n", copies, sums,
              copies + sums, std::max(copies, sums));
  std::printf("  pipelined with stream memory flags %.1f us (overlap %.0f%%), with events %.1f us (overlap %.0f%%)\n",
              flags, 100.f * (copies + sums - flags) / std::min(copies, sums), events,
              100.f * (copies + sums - events) / std::min(copies, sums));
  for (auto& x : p.extra) CK(cudaStreamDestroy(x));
  CK(cudaStreamDestroy(p.copies));
  CK(cudaStreamDestroy(p.reduces));
  CK(cudaFree(p.src));
  CK(cudaFree(p.dst));
  CK(cudaFree(p.other));
  CK(cudaFree(p.out));
  CKD(cuMemFree(p.flags));
}

int main(int argc, char** argv) {
  const int streams = argc > 1 ? std::atoi(argv[1]) : 16;
  const int extra = argc > 2 ? std::atoi(argv[2]) : -1;
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  CK(cudaSetDevice(0));
  CK(cudaFree(nullptr));
  const char* conn = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, CUDA_DEVICE_MAX_CONNECTIONS=%s\n", prop.name, conn ? conn : "(unset: 8)");
  if (extra >= 0) {
    pipeline(extra);
  } else {
    for (int e : {0, 1, 3, 7, 15}) pipeline(e);
  }
  blocked_pairs(streams);
  return 0;
}
