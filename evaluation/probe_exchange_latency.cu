// Where does a copy-engine exchange's fixed cost come from? One GPU, one
// process, two streams playing the two ranks.
//
// On 2x H200 an exchange of the copy-engine backend (a peer copy on the
// copy engines, a stream memory write of a flag after it, the peer's stream
// memory wait on that flag) cost ~35 us however small. Its pieces on one
// GPU: a ping-pong of K rounds between streams A and B, each round A -> B
// -> A, timed with events on A over all rounds (every call is enqueued up
// front, so this is the GPU's latency, not the host's), per round:
//   memops        A writes a flag (cuStreamWriteValue32), B waits for it
//                 (cuStreamWaitValue32 GEQ), B writes another, A waits
//   events        the same ordering with cudaEventRecord / cudaStreamWaitEvent
//   memops+copy   each side first copies `bytes` (cudaMemcpyAsync D2D, the
//                 copy engines), then signals with memops
//   events+copy   the same with events
//   memops+kernel each side first runs a one-CTA kernel, then memops
// and on one stream alone, per call: a `bytes` copy; a flag write then a
// wait that is already satisfied; a one-CTA kernel.
//
//   nvcc -O2 -arch=sm_90 -o /tmp/probe_x evaluation/probe_exchange_latency.cu -lcuda
//   /tmp/probe_x [bytes=4096] [rounds=500]
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "probe_check.cuh"

__global__ void one_cta(int* p) {
  if (threadIdx.x == 0) atomicAdd(p, 1);
}

enum Signal { MEMOPS, EVENTS };
enum Work { NOTHING, COPY, KERNEL };

struct Rig {
  cudaStream_t a, b;
  CUdeviceptr flags;  // [0]: A -> B, [1]: B -> A
  char *src, *dst;
  int* counter;
  size_t bytes;
  unsigned epoch = 0;
};

static void work(Rig& r, cudaStream_t s, Work w) {
  if (w == COPY) CK(cudaMemcpyAsync(r.dst, r.src, r.bytes, cudaMemcpyDeviceToDevice, s));
  if (w == KERNEL) one_cta<<<1, 32, 0, s>>>(r.counter);
}

// One A -> B -> A round.
static void round_trip(Rig& r, Signal sig, Work w, cudaEvent_t ea, cudaEvent_t eb) {
  const unsigned v = ++r.epoch;
  work(r, r.a, w);
  if (sig == MEMOPS) {
    CKD(cuStreamWriteValue32(r.a, r.flags, v, 0));
    CKD(cuStreamWaitValue32(r.b, r.flags, v, CU_STREAM_WAIT_VALUE_GEQ));
  } else {
    CK(cudaEventRecord(ea, r.a));
    CK(cudaStreamWaitEvent(r.b, ea, 0));
  }
  work(r, r.b, w);
  if (sig == MEMOPS) {
    CKD(cuStreamWriteValue32(r.b, r.flags + 4, v, 0));
    CKD(cuStreamWaitValue32(r.a, r.flags + 4, v, CU_STREAM_WAIT_VALUE_GEQ));
  } else {
    CK(cudaEventRecord(eb, r.b));
    CK(cudaStreamWaitEvent(r.a, eb, 0));
  }
}

template <typename F>
static float per_call_us(cudaStream_t s, int calls, F enqueue) {
  cudaEvent_t t0, t1;
  CK(cudaEventCreate(&t0));
  CK(cudaEventCreate(&t1));
  for (int i = 0; i < 20; ++i) enqueue();  // warm-up
  CK(cudaDeviceSynchronize());
  CK(cudaEventRecord(t0, s));
  for (int i = 0; i < calls; ++i) enqueue();
  CK(cudaEventRecord(t1, s));
  CK(cudaEventSynchronize(t1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, t0, t1));
  CK(cudaEventDestroy(t0));
  CK(cudaEventDestroy(t1));
  return 1000.f * ms / calls;
}

int main(int argc, char** argv) {
  Rig r;
  r.bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 4096;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 500;
  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  CK(cudaStreamCreateWithFlags(&r.a, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&r.b, cudaStreamNonBlocking));
  CK(cudaMalloc(reinterpret_cast<void**>(&r.flags), 256));
  CK(cudaMemset(reinterpret_cast<void*>(r.flags), 0, 256));
  CK(cudaMalloc(&r.src, r.bytes));
  CK(cudaMalloc(&r.dst, r.bytes));
  CK(cudaMalloc(&r.counter, 4));
  CK(cudaMemset(r.src, 1, r.bytes));
  cudaEvent_t ea, eb;
  CK(cudaEventCreateWithFlags(&ea, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&eb, cudaEventDisableTiming));

  std::printf("%s, %zu-byte copies, %d rounds; us per A -> B -> A round (two signals, two waits)\n", prop.name,
              r.bytes, rounds);
  const struct {
    const char* name;
    Signal sig;
    Work w;
  } cases[] = {{"memops", MEMOPS, NOTHING}, {"events", EVENTS, NOTHING},     {"memops+copy", MEMOPS, COPY},
               {"events+copy", EVENTS, COPY}, {"memops+kernel", MEMOPS, KERNEL}, {"events+kernel", EVENTS, KERNEL}};
  for (const auto& c : cases) {
    const float us = per_call_us(r.a, rounds, [&] { round_trip(r, c.sig, c.w, ea, eb); });
    std::printf("  %-14s %8.2f us per round\n", c.name, us);
  }
  std::printf("one stream, us per call:\n");
  std::printf("  %-14s %8.2f\n", "copy", per_call_us(r.a, rounds, [&] { work(r, r.a, COPY); }));
  std::printf("  %-14s %8.2f\n", "kernel", per_call_us(r.a, rounds, [&] { work(r, r.a, KERNEL); }));
  std::printf("  %-14s %8.2f\n", "write+wait", per_call_us(r.a, rounds, [&] {
                const unsigned v = ++r.epoch;
                CKD(cuStreamWriteValue32(r.a, r.flags + 8, v, 0));
                CKD(cuStreamWaitValue32(r.a, r.flags + 8, v, CU_STREAM_WAIT_VALUE_GEQ));
              }));
  std::printf("  %-14s %8.2f\n", "copy+write", per_call_us(r.a, rounds, [&] {
                work(r, r.a, COPY);
                CKD(cuStreamWriteValue32(r.a, r.flags + 12, ++r.epoch, 0));
              }));
  return 0;
}
