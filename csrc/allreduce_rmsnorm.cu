// AllReduce + residual add + RMSNorm over peer memory (NVLink loads and
// stores, no multicast), on a few CTAs, with vLLM's fused_add_rms_norm
// semantics:
//   s = sum over ranks of x (fp32, rank order, rounded to 16 bits: what an
//       AllReduce returns);  r = round(s + residual);  residual_out = r;
//   out = r * rsqrt(mean(r^2) + eps) * weight.
//
// Rank `o` owns the rows of slice o (a near-equal split of the tokens), and
// CTA b of every rank handles chunk b of every slice, so each barrier is
// between the CTAs b of the ranks only, never grid-wide. A chunk is cut into
// `stages` consecutive parts, and each part goes through three steps:
//   1. push: CTA b copies its part of every other owner's slice of its x
//      into that owner's buffer (slot of this rank), then raises
//      ready[part][rank] in the owner's buffer;
//   2. reduce: once ready[part][p] is up for every peer p, CTA b sums its
//      part of this rank's slice (its own x read in place, the peers' from
//      the slots, all local reads), adds the residual, normalizes, and
//      writes the rows to its own out; into every peer's buffer it writes one
//      array of the rows: the summed residual r when every rank keeps the
//      full residual (res area), else the normalized rows (out area); then
//      raises done[part][rank] in every peer's buffer;
//   3. gather: once done[part][p] is up for every peer, CTA b takes the rows
//      peers wrote for its part of their slices: the normalized rows are
//      copied to out; r is copied to residual_out and normalized into out
//      here (the same arithmetic in the same order as the owner's, so every
//      rank gets bit-identical rows), which sends each row across NVLink
//      once instead of twice (r and out).
// With one stage the steps run one after the other: NVLink idles while the
// CTA gathers, and the local memory while it pushes. With more, step t
// pushes part t + 1, reduces part t and gathers part t - 1 before one barrier
// raises the flags of all three: the stores of a push drain over NVLink
// while the CTA reads and writes its local rows, and every wait is for flags
// the peers raised one step earlier.
// One-shot (2 ranks, full residual, push mode: the `o` configs, and the
// default for small calls: all_reduce_rmsnorm::resolved): no owners
// and a single flag exchange. CTA b copies its part of ALL rows of x into
// its own buffer (one of two halves, alternating by the call's epoch),
// raises ready, and once the peer's ready is up sums its part of all rows
// from its own x and the peer's half (peer loads), adds its own residual
// and normalizes: as many bytes cross NVLink as in the two steps above, no
// peer store, no gather, and every rank computes its rows with its own
// residual and weight, exactly the torch composition. The halves alternate
// so that no closing exchange is needed: a rank writes a half again two
// calls later, after seeing the peer's flags of the call in between, which
// the peer raises only once its kernel of the call before (the last to
// read that half) has ended.
// In the plain build the host launches every one-shot call's steps as
// fo_arn_oneshot, which holds no other mode's code (a short call runs each
// instruction about once, so fetching the code is part of its latency), or,
// up to 256 tokens, as fo_arn_oneshot_st: by peer stores, each rank storing
// its x into the peer's store half (stored_x) and loading only local rows.
// With the copy engines (copy_engines, fo_arn_ce below) one-shot's rows of
// the peer are not loaded over NVLink: its copy engines landed all of its x
// in this rank's slot area first (`landed`).
// Two ranks sum in one packed 16-bit add (exactly rounded, as the AllReduce
// would return); more ranks in fp32 in rank order. A row stays in registers
// from its loads to its stores, held by a group of warps (row_group).
// Pull mode (x_offset != 0: gemm_all_reduce_rmsnorm, one call per wave
// group): the producing GEMM stored each rank's partial straight into its
// own buffer's x area, so step 1 pushes nothing and only raises ready;
// step 2 reads every source's rows there (peer loads). A call then covers
// rows [row0, row0 + tokens) of arrays of the whole output's rows, split
// among the owners like the tokens of a plain call.
// The flags hold the call's epoch (a counter in each rank's buffer, moved
// on once every CTA of the launch is done with it: finish, begin_call), so
// they never need resetting and CUDA-graph replays work. A wait that lasts
// longer than `timeout_ns` (0: forever) records an error in the buffer's
// header and abandons the call.
// FO_RING (Hopper, two-shot): the same steps, flags and buffers, with the
// rows moved by bulk copies through a shared-memory ring (see "Ring" below).
#include "ptx.cuh"
#ifndef FO_RING
#define FO_RING 0
#endif
// The hidden size the build's hidden-size paths are compiled for (0: none):
// fo_arn_ce_watch's reduce (a call of another size takes its general path)
// and the plain build's one-shot entries fo_arn_oneshot[_st]_h.
#ifndef FO_HIDDEN
#define FO_HIDDEN 0
#endif
#if FO_RING
#include "ptx_sm90.cuh"
#endif

#ifndef FO_BF16
#define FO_BF16 1
#endif
#ifndef FO_THREADS
#define FO_THREADS 512
#endif
// Vectors per lane in flight in the row loops, and per thread in the copies.
#ifndef FO_UNROLL
#define FO_UNROLL 4
#endif
#define FO_MAX_WORLD 8

namespace {
constexpr int THREADS = FO_THREADS;
constexpr int WARPS = THREADS / 32;
constexpr int VEC = 8;
constexpr int UNROLL = FO_UNROLL;

// Header words of a rank's buffer (u32 indices); keep in step with rust/ops/all_reduce_rmsnorm.rs.
// COUNTED: the CTAs of a launch counted (finish, begin_call).
constexpr int EPOCH = 0, COUNTED = 1, ERROR = 2;
// Flags of one kind: a word per (part, source); ready and done fill the
// 64 KiB header after its first 16 words but the last 128 (the copy-engine
// mode's flags, which only stream memory operations touch), so CTAs x
// stages <= FLAG_SLOTS.
constexpr int FLAG_SLOTS = 1015;
constexpr int READY = 16;
constexpr int DONE = READY + FLAG_SLOTS * FO_MAX_WORLD;
// The copy-engine modes' words (after the kernel's flags; keep in step with
// rust/ops/norm_copy_engines.rs): x arrived per landed range, consumed (the
// one-shot close), and the CTAs of a launch done.
constexpr int CE_ARRIVED = DONE + FLAG_SLOTS * FO_MAX_WORLD;
constexpr int CE_CONSUMED = CE_ARRIVED + 64;
constexpr int CE_FINISHED = 3;
// A watched call outside graph capture (Params::watch_epoch): the number of
// the peer's last such call whose copy has landed here, written by its copy
// lane after the copy, never reset.
constexpr int CE_WATCH_EPOCH = 4;
// Params::copy_engines: 0, or the rows moved by copy engines with a flag
// per landed range (1), or in one copy into a watch area whose every 16-bit
// value not yet landed holds the sentinel (CE_WATCH).
constexpr int CE_WATCH = 2;

using fo::add2;
using fo::high;
using fo::low;
using fo::mul2;
using fo::pack2;
using fo::word;

// A thread's running sum of squares over the words of r, in one fixed
// order wherever a row's scale is computed (owner and gatherer alike).
__device__ __forceinline__ float add_squares(float squares, unsigned t) {
  squares = fmaf(low(t), low(t), squares);
  return fmaf(high(t), high(t), squares);
}

// a + b of two vectors of eight 16-bit values, each rounded once.
__device__ __forceinline__ uint4 added(uint4 a, uint4 b) {
  uint4 s;
#pragma unroll
  for (int i = 0; i < 4; ++i) word(s, i) = add2(word(a, i), word(b, i));
  return s;
}

// More than two ranks sum in fp32 in rank order: acc += w's eight values,
// then the sum rounded to 16 bits (every rank gets bit-identical sums).
__device__ __forceinline__ void accumulate(float (&acc)[8], uint4 w) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += low(word(w, i));
    acc[2 * i + 1] += high(word(w, i));
  }
}
__device__ __forceinline__ uint4 packed(const float (&acc)[8]) {
  uint4 s;
#pragma unroll
  for (int i = 0; i < 4; ++i) word(s, i) = pack2(acc[2 * i], acc[2 * i + 1]);
  return s;
}

__device__ __forceinline__ void store_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
using fo::load_acquire_gpu;
using fo::load_acquire_sys;
using fo::now_ns;
}  // namespace

struct Params {
  const uint4* x;         // [tokens, hidden] this rank's partial
  const uint4* residual;  // [tokens, hidden], or this rank's slice rows (residual_sliced)
  const uint4* weight;    // [hidden]
  uint4* out;             // [tokens, hidden]
  uint4* residual_out;    // full: [tokens, hidden]; sharded: this rank's slice rows
  unsigned long long bases[FO_MAX_WORLD];  // every rank's buffer, as mapped here
  unsigned long long slot_bytes;           // one source's slot: ceil(tokens / world) rows
  unsigned long long out_offset;           // the out area: [tokens, hidden]
  unsigned long long res_offset;           // the residual area (full mode): [tokens, hidden]
  unsigned long long timeout_ns;
  unsigned long long x_offset;             // pull mode: every rank's partial, [row0 + tokens, hidden]; 0: push
  unsigned long long watch_offset;         // the watch area (2 ranks, push mode): [tokens, hidden]
  unsigned long long store_offset;         // the store halves (2 ranks, push mode), store_half bytes each
  unsigned long long store_half;
  int rank, world, tokens, hidden;
  float eps;
  int residual_full;
  int row0;                                // first row of this call (0 in push mode)
  int stages;                              // parts per chunk, CTAs x stages <= FLAG_SLOTS
  int oneshot;                             // every rank reduces every row (2 ranks, full, push)
  int residual_sliced;                     // sharded: residual holds this rank's slice rows only
  int copy_engines;                        // the copy engines move the rows (1: flagged, CE_WATCH): no peer store here
  unsigned watch_epoch;                    // CE_WATCH: the call's number (CE_WATCH_EPOCH); 0: x arrived 0 and the close
};

namespace {
__device__ __forceinline__ unsigned* header(const Params& p, int rank) {
  return reinterpret_cast<unsigned*>(p.bases[rank]);
}
__device__ __forceinline__ char* area(const Params& p, int rank, unsigned long long offset) {
  return reinterpret_cast<char*>(p.bases[rank]) + offset;
}
// Slot of `source` in `owner`'s buffer (after the 64 KiB header).
__device__ __forceinline__ uint4* slot(const Params& p, int owner, int source) {
  return reinterpret_cast<uint4*>(area(p, owner, 65536ull + static_cast<unsigned long long>(source) * p.slot_bytes));
}
// One-shot: the half of `rank`'s buffer that holds its x in the call of
// `epoch`. Each half spans an area (a third of the buffer, fixed for its
// life), so calls of different sizes alternate on the same two halves.
__device__ __forceinline__ uint4* half(const Params& p, int rank, unsigned epoch) {
  return reinterpret_cast<uint4*>(area(p, rank, 65536ull + (epoch & 1u) * (p.out_offset - 65536ull)));
}
// One-shot by peer stores (fo_arn_oneshot_st): the half of `rank`'s store
// halves that the peer stores its x into in the call of `epoch`. No other
// mode writes them, so a rank may store into the peer's before it has waited
// for anything: the peer read that half last two calls before, and its
// kernel of the call in between has started (this rank saw its flags).
__device__ __forceinline__ uint4* stored_x(const Params& p, int rank, unsigned epoch) {
  return reinterpret_cast<uint4*>(area(p, rank, p.store_offset + (epoch & 1u) * p.store_half));
}
// One-shot with the copy engines: where they landed the peer's x (every row)
// in this rank's own buffer, the slot area's start (2 ranks).
// Watching: the watch area.
__device__ __forceinline__ const uint4* landed(const Params& p) {
  return reinterpret_cast<const uint4*>(area(p, p.rank, p.copy_engines == CE_WATCH ? p.watch_offset : 65536ull));
}
// One-shot: where the peer `src`'s x lies for this rank, from its first row.
__device__ __forceinline__ const uint4* peer_x(const Params& p, int src, unsigned epoch) {
  return p.copy_engines ? landed(p) : half(p, src, epoch);
}
__device__ __forceinline__ int slice_start(const Params& p, int owner) {
  return p.row0 + static_cast<int>(static_cast<long long>(p.tokens) * owner / p.world);
}
// Owner's slice as the steps cut it, [slice_first, slice_end): one-shot's is every row.
__device__ __forceinline__ int slice_first(const Params& p, int owner) {
  return p.oneshot ? p.row0 : slice_start(p, owner);
}
__device__ __forceinline__ int slice_end(const Params& p, int owner) {
  return p.oneshot ? p.row0 + p.tokens : slice_start(p, owner + 1);
}
// Part `stage` of chunk b of owner's slice: rows [first, last). The slice
// is cut into CTAs x stages parts, CTA b's chunk being parts bS .. bS + S - 1.
__device__ __forceinline__ void part(const Params& p, int owner, int stage, int& first, int& last) {
  const int s0 = slice_first(p, owner), s1 = slice_end(p, owner);
  const long long rows = s1 - s0, parts = static_cast<long long>(gridDim.x) * p.stages;
  const long long k = static_cast<long long>(blockIdx.x) * p.stages + stage;
  first = s0 + static_cast<int>(rows * k / parts);
  last = s0 + static_cast<int>(rows * (k + 1) / parts);
}
// Flag slot of this CTA's part `stage`.
__device__ __forceinline__ int flag_slot(int stage) { return stage * gridDim.x + blockIdx.x; }

// Copies `count` vectors, the whole block, UNROLL in flight per thread.
__device__ __forceinline__ void copy(uint4* __restrict__ to, const uint4* __restrict__ from, long long count) {
  for (long long i0 = threadIdx.x; i0 < count; i0 += static_cast<long long>(THREADS) * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long i = i0 + static_cast<long long>(u) * THREADS;
      if (i < count) v[u] = from[i];
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long i = i0 + static_cast<long long>(u) * THREADS;
      if (i < count) to[i] = v[u];
    }
  }
}

// Set once a wait timed out: the CTA abandons the call. Never reset within a
// call, so a thread that reads it late still reads what the others read.
__shared__ int abandoned;

// Raises ready[ready_slot][rank] and done[done_slot][rank] (a slot < 0:
// not that flag) in each peer's buffer once every thread's stores are done:
// thread i stores peer rank + 1 + i's flags with system-scope release
// semantics, which (cumulative over the barrier before them) make every
// thread's earlier loads and stores visible to the peer before the flag.
__device__ __forceinline__ void raise(const Params& p, int ready_slot, int done_slot, unsigned epoch) {
  __syncthreads();
  if (threadIdx.x < p.world - 1) {
    unsigned* h = header(p, (p.rank + 1 + threadIdx.x) % p.world);
    if (ready_slot >= 0) store_release_sys(h + READY + ready_slot * FO_MAX_WORLD + p.rank, epoch);
    if (done_slot >= 0) store_release_sys(h + DONE + done_slot * FO_MAX_WORLD + p.rank, epoch);
  }
}

// Whether a wait that began at `start` has lasted past `timeout_ns`: then
// records `error` in this rank's header and abandons the call.
__device__ __forceinline__ bool timed_out(const Params& p, unsigned long long start, unsigned error) {
  if (!p.timeout_ns || now_ns() - start <= p.timeout_ns) return false;
  atomicExch(header(p, p.rank) + ERROR, error);
  abandoned = 1;
  return true;
}

// Spins until the word at `flag` reaches `value` (an acquire), or the call
// was abandoned; after `timeout_ns` records `error` in this rank's header
// and abandons the call. True if the value came.
// await_peer: the word of flag[at][peer] of the kind at base_word in this
// rank's buffer, raised to `epoch` by `peer`.
__device__ __forceinline__ bool await_word(const Params& p, const unsigned* flag, unsigned value, unsigned error) {
  const unsigned long long start = p.timeout_ns ? now_ns() : 0;
  // Signed distance: epochs wrap around without harm.
  while (static_cast<int>(load_acquire_sys(flag) - value) < 0 && !*static_cast<volatile int*>(&abandoned)) {
    timed_out(p, start, error);
  }
  return !*static_cast<volatile int*>(&abandoned);
}
__device__ __forceinline__ bool await_peer(const Params& p, int base_word, int at, int peer, unsigned epoch) {
  return await_word(p, header(p, p.rank) + base_word + at * FO_MAX_WORLD + peer, epoch, 1u + base_word);
}

// Waits until every peer raised flag[at][peer] of the kind at base_word in
// this rank's buffer to `epoch` (thread i watches peer rank + 1 + i; its
// acquire, ordered before the other threads by the barrier after it, makes
// the peer's data visible to all); false (and the error recorded) on timeout.
__device__ __forceinline__ bool wait_all(const Params& p, int base_word, int at, unsigned epoch) {
  __syncthreads();  // no thread still reads the verdict of a wait before
  if (threadIdx.x < p.world - 1) await_peer(p, base_word, at, (p.rank + 1 + threadIdx.x) % p.world, epoch);
  __syncthreads();
  return !abandoned;
}

// Thread 0 of a CTA, once its stores are done: whether its CTA is the
// launch's last to get here (counted at `counter`, reset for the next launch).
__device__ __forceinline__ bool last_cta(unsigned* counter) {
  __threadfence();
  if (atomicAdd(counter, 1u) != gridDim.x - 1) return false;
  *counter = 0;
  return true;
}

// fo_allreduce_rmsnorm: the last CTA of the call to finish moves this rank
// to the next epoch.
__device__ __forceinline__ void finish(unsigned* own) {
  __syncthreads();
  if (threadIdx.x == 0 && last_cta(own + COUNTED)) atomicAdd(own + EPOCH, 1u);
}

// fo_arn_oneshot's epoch (this rank's counter + 1), which thread 0 of each
// CTA reads and hands the others in shared memory. The launch's CTAs are
// counted as they read it (the acquire keeps the count behind the read), and
// the last to read it moves the counter on at its end (end_call): no CTA's
// tail waits for a fence and an atomic. On 2x H200 that took 0.95x the time
// of a 128- or 256-token call on 32 CTAs; fo_allreduce_rmsnorm counted so
// took 1.02-1.03x at 256 tokens on 8 and 16 CTAs and keeps finish. Both
// count in the same word, which the last CTA zeroes, so launches of either
// follow each other. `counted`: thread 0's place in the count.
struct CallEpoch {
  unsigned value, counted;
};
__device__ __forceinline__ CallEpoch begin_call(unsigned* own) {
  __shared__ unsigned epoch;
  unsigned counted = 0;
  if (threadIdx.x == 0) {
    epoch = load_acquire_gpu(own + EPOCH) + 1;
    counted = atomicAdd(own + COUNTED, 1u);
  }
  __syncthreads();
  return {epoch, counted};
}
// Every CTA has read the epoch once the count is full (its last value long
// arrived by now), so the counter moves on for the next launch.
__device__ __forceinline__ void end_call(unsigned* own, const CallEpoch& call) {
  if (threadIdx.x == 0 && call.counted == gridDim.x - 1) {
    own[COUNTED] = 0;
    atomicAdd(own + EPOCH, 1u);
  }
}

// Watch mode: the peer's copy engine lands all of its x in one copy into
// this rank's watch area, whose every 16-bit value holds WATCH_SENTINEL (a
// NaN in bf16 and fp16) until its byte pair lands; then x_arrived[0] = 1
// (in graph capture), or CE_WATCH_EPOCH = the call's watch_epoch. A vector
// holding the sentinel has not landed, unless that word says so (x itself
// held it); the reader puts the sentinel back once it has the value.
constexpr unsigned WATCH_SENTINEL = 0xffffffffu;
__device__ __forceinline__ uint4 load_volatile(const uint4* at) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(at)
               : "memory");
  return v;
}
__device__ __forceinline__ void store_sentinel(uint4* at) {
  asm volatile("st.global.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"l"(at), "r"(WATCH_SENTINEL) : "memory");
}
// Whether any 16-bit value of v is the sentinel's (0xffff): a zero half of ~v.
__device__ __forceinline__ bool unlanded(uint4 v) {
  const unsigned w[4] = {~v.x, ~v.y, ~v.z, ~v.w};
  unsigned zero = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) zero |= (w[i] - 0x00010001u) & ~w[i] & 0x80008000u;
  return zero != 0;
}
// Whether any of v's eight values is a NaN (the sentinel is one): a max
// that passes NaNs on over the words, then the halves of the one word left
// tested (magnitude bits above infinity's). A sum of two vectors holds a NaN
// wherever either did, so a sum without one shows the peer's vector landed
// in 6 instructions where unlanded() on it takes 13 (with the rank's pick).
// On 2x H200 (hidden 8192, the ring's watched rows) 0.98x the time at 512
// tokens on 8 CTAs, a tie on 16 and 32 and at 1K tokens, where the rows'
// landing and latency bound the call rather than its instructions.
__device__ __forceinline__ bool any_nan(uint4 v) {
  const unsigned m = fo::max_nan2(fo::max_nan2(v.x, v.y), fo::max_nan2(v.z, v.w));
#if FO_BF16
  constexpr unsigned TO_SIGN = 0x007f007fu;  // 0x7fff - 0x7f80 (infinity) in each half
#else
  constexpr unsigned TO_SIGN = 0x03ff03ffu;  // 0x7fff - 0x7c00
#endif
  // A half's magnitude above infinity's carries into its bit 15 (never into the next half).
  return (((m & 0x7fff7fffu) + TO_SIGN) & 0x80008000u) != 0;
}

// The vector at `at` once landed (or the call abandoned: garbage, never used).
// With an epoch, a later one there says as much (the peer's copies land in
// order, and its next may follow before this call ends).
__device__ __forceinline__ uint4 await_landed(const Params& p, const uint4* at) {
  const int word = p.watch_epoch ? CE_WATCH_EPOCH : CE_ARRIVED;
  const unsigned* arrived = header(p, p.rank) + word;
  const unsigned long long start = p.timeout_ns ? now_ns() : 0;
  for (;;) {
    const uint4 v = load_volatile(at);
    if (!unlanded(v) || *static_cast<volatile int*>(&abandoned)) return v;
    // The acquire orders the load after it behind every byte of the copy.
    const unsigned seen = load_acquire_sys(arrived);
    if (p.watch_epoch ? static_cast<int>(seen - p.watch_epoch) >= 0 : seen != 0) return load_volatile(at);
    __nanosleep(256);
    if (timed_out(p, start, 1u + word)) return v;
  }
}

// The warps that share a row, which its threads hold in registers from its
// loads to its stores: REG_VECS vectors a thread at most, so a row of `vecs`
// vectors takes at least vecs / (32 REG_VECS) warps (hidden 8192: 4). A part
// with fewer rows than the CTA has warps gives each row more (a power of
// two, at most 15 groups: the named barriers 1..15), so that a short call is
// not a few warps' chains of loads. Thread `t` of the group's `threads`
// takes vectors t, t + threads, ... (k-th: t + k threads).
constexpr int REG_VECS = 2048 / (THREADS < 256 ? THREADS : 256);
struct RowGroup {
  int size, index, count, t, threads;
};

// The fewest warps (a power of two) that hold a row of `vecs` vectors, in
// at most 15 groups where a group has more than one warp (row_group's rule).
__host__ __device__ constexpr int fewest_warps(int vecs) {
  int size = 1;
  while (size * 32 * REG_VECS < vecs) size *= 2;
  while (size > 1 && WARPS / size > 15) size *= 2;
  return size;
}

__device__ __forceinline__ RowGroup row_group(int rows, int vecs) {
  // fewest_warps' first loop written out (calling it compiled the growth below to more instructions).
  int size = 1;
  while (size * 32 * REG_VECS < vecs) size *= 2;
  for (int c = 2 * size; c <= WARPS && rows * c <= WARPS; c *= 2) {
    if (WARPS / c <= 15) size = c;
  }
  // Groups of more than a warp each take a named barrier (1..15): with 32 warps, rows of 2 warps
  // (1024 threads, hidden 2056-4096) would make 16 groups. (Fewer warps: never more than 15.)
  if constexpr (WARPS / 2 > 15) {
    while (size > 1 && WARPS / size > 15) size *= 2;
  }
  const int warp = threadIdx.x / 32;
  return {size, warp / size, WARPS / size, (warp % size) * 32 + threadIdx.x % 32, size * 32};
}

// Threads that share a row: WARP_ROWS (32) where the caller knows each row
// is a warp's, so that its loops stride by a constant; else the group's.
constexpr int WARP_ROWS = 32, ANY_ROWS = 0;
template <int FIXED>
__device__ __forceinline__ int row_threads(const RowGroup& g) {
  return FIXED ? FIXED : g.threads;
}

// The group's sum of each thread's `v`, the same in every thread: over each
// warp by shuffles, then over the group's warps in order (a slot per warp,
// `parity` alternating between rows so one barrier per row suffices).
template <int FIXED>
__device__ __forceinline__ float group_sum(float v, const RowGroup& g, int parity) {
  __shared__ float slots[2][WARPS];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (FIXED == WARP_ROWS || (!FIXED && g.size == 1)) return v;
  constexpr int SIZE = FIXED / 32;  // the group's warps where FIXED says (0: g.size)
  const int size = SIZE ? SIZE : g.size;
  const int first = g.index * size;
  if (threadIdx.x % 32 == 0) slots[parity][first + g.t / 32] = v;
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + g.index), "r"(SIZE ? FIXED : g.threads) : "memory");
  float total = 0.f;
  for (int w = 0; w < size; ++w) total += slots[parity][first + w];
  return total;
}

// r * scale rounded to 16 bits, times the weight rounded again: vLLM's
// fused_add_rms_norm arithmetic, the weight's product one packed instruction.
__device__ __forceinline__ uint4 normalized(uint4 r, uint4 g, float scale) {
  uint4 y;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned rw = word(r, i);
    word(y, i) = mul2(pack2(low(rw) * scale, high(rw) * scale), word(g, i));
  }
  return y;
}

// Whether a thread's vectors k0.. of a row exist for any thread of its group
// (the same answer in all of them: the loops below stop there together).
__device__ __forceinline__ bool block_live(int k0, int threads, int vecs) { return k0 * threads < vecs; }

// Whether rows of HV vectors (a compile-time hidden size; 0: read at run
// time) fill a group of FIXED threads exactly: every thread then holds a
// vector of every k, so no index needs clamping or testing.
template <int FIXED, int HV>
__host__ __device__ constexpr bool exact_rows() {
  return HV > 0 && FIXED > 0 && HV % FIXED == 0 && HV / FIXED <= REG_VECS;
}

// The row's scale from r in registers (a thread's vectors k = 0, 1, ..., in
// this order on every rank, so the owner and a gatherer get the same bits),
// then its normalized vectors handed to store(v, r, y). HV: the row's
// vectors as a constant (reduce_rows' hidden-size path), else 0.
template <int FIXED, int HV = 0, typename Store>
__device__ __forceinline__ void normalize_regs(const uint4 (&r)[REG_VECS], const uint4* weight, int vecs,
                                               const RowGroup& grp, int parity, float hidden, float eps,
                                               Store store) {
  constexpr bool EXACT = exact_rows<FIXED, HV>();
  if constexpr (HV > 0) vecs = HV;
  const int threads = row_threads<FIXED>(grp);
  float squares = 0.f;
#pragma unroll
  for (int k = 0; k < REG_VECS; ++k) {
    if (!block_live(k, threads, vecs)) break;
    if (EXACT || grp.t + k * threads < vecs) {
#pragma unroll
      for (int i = 0; i < 4; ++i) squares = add_squares(squares, word(r[k], i));
    }
  }
  const float scale = rsqrtf(group_sum<FIXED>(squares, grp, parity) / hidden + eps);
#pragma unroll
  for (int k0 = 0; k0 < REG_VECS; k0 += UNROLL) {
    if (!block_live(k0, threads, vecs)) break;
    uint4 g[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int v = grp.t + (k0 + u) * threads;
      g[u] = weight[EXACT ? v : min(v, vecs - 1)];
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int v = grp.t + (k0 + u) * threads;
      if (EXACT || v < vecs) store(v, r[k0 + u], normalized(r[k0 + u], g[u], scale));
    }
  }
}
}  // namespace

namespace {
// One-shot's step 1 for part `stage`: its part of every row into this
// rank's half of the call (STORE: into the peer's store half).
template <bool STORE = false>
__device__ __forceinline__ void push_oneshot(const Params& p, int stage, int vecs, unsigned epoch) {
  int first, last;
  part(p, p.rank, stage, first, last);
  const long long at = static_cast<long long>(first - p.row0) * vecs;
  uint4* const to = STORE ? stored_x(p, 1 - p.rank, epoch) : half(p, p.rank, epoch);
  copy(to + at, p.x + static_cast<long long>(first) * vecs, static_cast<long long>(last - first) * vecs);
}
// Step 1 for part `stage`: copies it of every other owner's slice of x into
// that owner's slot for this rank (one-shot: push_oneshot).
__device__ __forceinline__ void push(const Params& p, int stage, int vecs, unsigned epoch) {
  if (p.oneshot) {
    push_oneshot(p, stage, vecs, epoch);
    return;
  }
  for (int i = 1; i < p.world; ++i) {
    const int owner = (p.rank + i) % p.world;
    int first, last;
    part(p, owner, stage, first, last);
    const long long offset = static_cast<long long>(first - slice_first(p, owner)) * vecs;
    copy(slot(p, owner, p.rank) + offset, p.x + static_cast<long long>(first) * vecs,
         static_cast<long long>(last - first) * vecs);
  }
}

// Step 2 over rows [first, last) of this rank's slice: a row group per row.
// TWO: p.world == 2 (the sources' sum one packed add; else an fp32 sum).
// ONESHOT: one-shot alone (2 ranks, full residual, push), every other
// mode's code left out: by peer loads (LOADS, fo_arn_oneshot), or by peer
// stores (STORES, fo_arn_oneshot_st: the peer's rows lie in this rank's
// store half).
constexpr int LOADS = 1, STORES = 2;
// HV (the one-shot entries' hidden-size path): rows of HV vectors, a
// constant, on groups of FIXED threads.
template <int FIXED, bool TWO, int ONESHOT = 0, int HV = 0>
__device__ __forceinline__ void reduce_rows(const Params& p, int first, int last, int vecs, bool pull,
                                            const RowGroup& grp, unsigned epoch) {
  constexpr bool EXACT = exact_rows<FIXED, HV>();
  if constexpr (HV > 0) vecs = HV;
  const int s0 = slice_first(p, p.rank);
  const int threads = row_threads<FIXED>(grp);
  // Two-shot with the full residual: r goes to every peer (one-shot: each computes its own;
  // with the copy engines they copy it).
  const bool share_r = !ONESHOT && p.residual_full && !p.oneshot && !p.copy_engines;
  const bool share_out = !ONESHOT && !p.residual_full && !p.copy_engines;
  const bool watch = !ONESHOT && p.copy_engines == CE_WATCH;
  // Where source src's rows of this rank's slice lie (`base`: the row's offset in whole-output
  // arrays; `local`: in the slice's).
  auto source = [&](int src, long long base, long long local) -> const uint4* {
    if (ONESHOT) {
      if (src == p.rank) return p.x + base;
      return (ONESHOT == STORES ? stored_x(p, p.rank, epoch) : half(p, src, epoch)) + local;
    }
    return pull            ? reinterpret_cast<const uint4*>(area(p, src, p.x_offset)) + base
           : src == p.rank ? p.x + base
           : p.oneshot     ? peer_x(p, src, epoch) + local
                           : slot(p, p.rank, src) + local;
  };
  int parity = 0;
  for (int row = first + grp.index; row < last; row += grp.count, parity ^= 1) {
    const long long base = static_cast<long long>(row) * vecs;
    const long long local = static_cast<long long>(row - s0) * vecs;
    uint4* r_row = p.residual_out + (p.residual_full ? base : local);
    const uint4* res_row = p.residual + (p.residual_sliced ? local : base);
    uint4 r[REG_VECS];
    // UNROLL vectors of every array in flight at a time; past the row's end a thread loads its last
    // vector again (and stores nothing): no predicated loads, whose partly defined arrays the
    // compiler keeps in local memory.
#pragma unroll
    for (int k0 = 0; k0 < REG_VECS; k0 += UNROLL) {
      if (!block_live(k0, threads, vecs)) break;
      int at[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int v = grp.t + (k0 + u) * threads;
        at[u] = EXACT ? v : min(v, vecs - 1);
      }
      // s: the AllReduce's result, 16-bit (two ranks: one packed add, both sources' loads in flight
      // at once; more: an fp32 sum in rank order, so every rank would get bit-identical sums).
      uint4 sum[UNROLL], res[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) res[u] = res_row[at[u]];
      if constexpr (TWO) {
        uint4 w[UNROLL];
        if (watch) {
          // This rank's x and the peer's from the watch area (a + b == b + a, bit for bit).
          uint4* seen = const_cast<uint4*>(landed(p)) + local;
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) {
            sum[u] = p.x[base + at[u]];
            w[u] = load_volatile(seen + at[u]);
          }
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) {
            if (grp.t + (k0 + u) * threads >= vecs) continue;  // another thread's vector
            if (unlanded(w[u])) w[u] = await_landed(p, seen + at[u]);
            store_sentinel(seen + at[u]);
          }
        } else {
          const uint4 *a = source(0, base, local), *b = source(1, base, local);
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) {
            sum[u] = a[at[u]];
            w[u] = b[at[u]];
          }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) sum[u] = added(sum[u], w[u]);
      } else {
        float acc[UNROLL][8];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[u][j] = 0.f;
        }
        for (int src = 0; src < p.world; ++src) {
          const uint4* from = source(src, base, local);
          uint4 w[UNROLL];
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) w[u] = from[at[u]];
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) accumulate(acc[u], w[u]);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) sum[u] = packed(acc[u]);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        uint4& t = r[k0 + u];
        t = added(sum[u], res[u]);  // the sum with the residual is rounded again
        const int v = grp.t + (k0 + u) * threads;
        if (!EXACT && v >= vecs) continue;
        r_row[v] = t;
        for (int i = 1; share_r && i < p.world; ++i) {
          const int peer = (p.rank + i) % p.world;
          reinterpret_cast<uint4*>(area(p, peer, p.res_offset))[base + v] = t;
        }
      }
    }
    normalize_regs<FIXED, HV>(r, p.weight, vecs, grp, parity, static_cast<float>(p.hidden), p.eps,
                              [&](int v, uint4, uint4 y) {
                                p.out[base + v] = y;
                                for (int i = 1; share_out && i < p.world; ++i) {
                                  const int peer = (p.rank + i) % p.world;
                                  reinterpret_cast<uint4*>(area(p, peer, p.out_offset))[base + v] = y;
                                }
                              });
  }
}

// Step 2 over rows [first, last) of this rank's slice, with their row groups
// (ONESHOT: fo_arn_oneshot's, reduce_rows). HIDDEN (the one-shot entries
// compiled for the call's hidden size, fo_arn_oneshot[_st]_h): rows of
// FO_HIDDEN values on groups of the fewest warps that hold one, both
// constants, so that no offset or bound is computed at run time. Fewer
// rows than groups leave groups idle, so the host takes these entries only
// where row_group would pick that size anyway (Rust's runs_hidden_entry).
template <int ONESHOT = 0, bool HIDDEN = false>
__device__ __forceinline__ void reduce_range(const Params& p, int first, int last, int vecs, bool pull,
                                             unsigned epoch = 0) {
  if constexpr (HIDDEN) {
    constexpr int HV = FO_HIDDEN / VEC, SIZE = fewest_warps(HV);
    const int warp = threadIdx.x / 32;
    const RowGroup grp{SIZE, warp / SIZE, WARPS / SIZE, (warp % SIZE) * 32 + threadIdx.x % 32, SIZE * 32};
    reduce_rows<SIZE * 32, true, ONESHOT, HV>(p, first, last, HV, false, grp, epoch);
    return;
  }
  const RowGroup grp = row_group(last - first, vecs);
  if constexpr (ONESHOT != 0) {
    if (grp.size == 1) {
      reduce_rows<WARP_ROWS, true, ONESHOT>(p, first, last, vecs, false, grp, epoch);
    } else {
      reduce_rows<ANY_ROWS, true, ONESHOT>(p, first, last, vecs, false, grp, epoch);
    }
  } else if (grp.size == 1) {
    if (p.world == 2) {
      reduce_rows<WARP_ROWS, true>(p, first, last, vecs, pull, grp, epoch);
    } else {
      reduce_rows<WARP_ROWS, false>(p, first, last, vecs, pull, grp, epoch);
    }
  } else if (p.world == 2) {
    reduce_rows<ANY_ROWS, true>(p, first, last, vecs, pull, grp, epoch);
  } else {
    reduce_rows<ANY_ROWS, false>(p, first, last, vecs, pull, grp, epoch);
  }
}

// Step 2 for part `stage` of this rank's slice.
__device__ __forceinline__ void reduce(const Params& p, int stage, int vecs, bool pull, unsigned epoch) {
  int first, last;
  part(p, p.rank, stage, first, last);
  reduce_range(p, first, last, vecs, pull, epoch);
}

// Step 3's rows [first, last) of another owner's r (full residual):
// normalized here as the owner did, with its row groups, bit for bit.
template <int FIXED>
__device__ __forceinline__ void gather_rows(const Params& p, int first, int last, int vecs, const RowGroup& grp) {
  const uint4* staged = reinterpret_cast<const uint4*>(area(p, p.rank, p.res_offset));
  const int threads = row_threads<FIXED>(grp);
  int parity = 0;
  for (int row = first + grp.index; row < last; row += grp.count, parity ^= 1) {
    const long long base = static_cast<long long>(row) * vecs;
    uint4 r[REG_VECS];
#pragma unroll
    for (int k = 0; k < REG_VECS; ++k) {
      if (!block_live(k, threads, vecs)) break;
      r[k] = staged[base + min(grp.t + k * threads, vecs - 1)];
    }
    normalize_regs<FIXED>(r, p.weight, vecs, grp, parity, static_cast<float>(p.hidden), p.eps,
                          [&](int v, uint4 rv, uint4 y) {
                            p.residual_out[base + v] = rv;
                            p.out[base + v] = y;
                          });
  }
}

// Step 3 over rows [first, last) of another owner's r (full residual), with
// their row groups.
__device__ __forceinline__ void gather_range(const Params& p, int first, int last, int vecs) {
  const RowGroup grp = row_group(last - first, vecs);
  // Groups change between owners: no warp may write a slot another still reads.
  if (grp.size > 1) __syncthreads();
  if (grp.size == 1) {
    gather_rows<WARP_ROWS>(p, first, last, vecs, grp);
  } else {
    gather_rows<ANY_ROWS>(p, first, last, vecs, grp);
  }
}

// Step 3 for part `stage` of every other owner's slice: their normalized
// rows, or their r, normalized here as the owner did.
__device__ __forceinline__ void gather(const Params& p, int stage, int vecs) {
  for (int i = 1; i < p.world; ++i) {
    const int owner = (p.rank + i) % p.world;
    int first, last;
    part(p, owner, stage, first, last);
    if (!p.residual_full) {
      const long long at = static_cast<long long>(first) * vecs, count = static_cast<long long>(last - first) * vecs;
      copy(p.out + at, reinterpret_cast<const uint4*>(area(p, p.rank, p.out_offset)) + at, count);
      continue;
    }
    gather_range(p, first, last, vecs);
  }
}
}  // namespace

#if FO_RING
namespace {
// Ring (Hopper; FO_RING): rows move between global memory (local or a
// peer's) and shared memory in 1-D bulk copies. The CTA's rows of a step
// (pushes, reduces, gathers, in that order) are jobs that pass through a
// ring of slots, each slot holding one row of every array a job loads
// (world sources and the residual for a reduce). A producer warp (warp 0,
// its lane 0 issuing) keeps loads for up to `slots` jobs in flight, waits
// for the peers' flags and stores the results; the THREADS compute threads
// behind it work a row once its slot is full (one row at a time: compute
// thread c takes vectors c, c + THREADS, ...). The producer has a warp of
// its own so that no lane of its warp spins on a slot while lane 0 issues.
// Far more bytes are in flight per SM than registers hold, and the SMs
// issue no per-vector global loads or stores. Each step drains the ring
// before it raises its flags.
constexpr unsigned RING_BYTES = FO_RING_BYTES;
constexpr int MAX_SLOTS = 8;
constexpr int PRODUCER = 32;  // threads of the producer warp, ahead of the compute threads
// Named barriers: the compute threads' row sum, and a row's hand-off from them to the producer.
constexpr int BAR_SUM = 1, BAR_HANDOFF = 2;
__device__ __forceinline__ int compute_thread() { return static_cast<int>(threadIdx.x) - PRODUCER; }
// A thread's vectors of a row (hidden <= 16384).
constexpr int ROW_VECS = (2048 + THREADS - 1) / THREADS;
enum Kind { PUSH, REDUCE, GATHER };
struct Job {
  int kind, row, owner, origin;  // origin: the first row of the owner's slice
};
__shared__ __align__(8) unsigned long long full_bars[MAX_SLOTS];
// Whether the compute threads work job j's row (a reduce, or a gather of the
// owner's r); else the producer stores the loaded row as it is.
__device__ __forceinline__ bool computed(const Params& p, const Job& j) {
  return j.kind == REDUCE || (j.kind == GATHER && p.residual_full);
}

// Step t's jobs as runs of rows: pushes of part t + 1 (every other
// owner's rows), the reduces of part t of this rank's slice, the gathers of
// part t - 1 of every other owner's slice. Worked out once per step: a
// part's bounds take 64-bit divisions, far too slow to redo for every row.
struct Run {
  int kind, first, count, owner, origin;
  int stride = 1;  // rows from one job to the next
};
constexpr int MAX_RUNS = 2 * FO_MAX_WORLD - 1;
__device__ __forceinline__ int step_runs(const Params& p, int t, bool pull, Run (&runs)[MAX_RUNS]) {
  const bool pushes = t + 1 < p.stages && !pull, reduces = t >= 0 && t < p.stages, gathers = t >= 1;
  int n = 0, first, last;
  for (int i = 1; pushes && i < p.world; ++i) {
    const int owner = (p.rank + i) % p.world;
    part(p, owner, t + 1, first, last);
    runs[n++] = {PUSH, first, last - first, owner, slice_first(p, owner)};
  }
  if (reduces) {
    part(p, p.rank, t, first, last);
    runs[n++] = {REDUCE, first, last - first, p.rank, slice_first(p, p.rank)};
  }
  for (int i = 1; gathers && i < p.world; ++i) {
    const int owner = (p.rank + i) % p.world;
    part(p, owner, t - 1, first, last);
    runs[n++] = {GATHER, first, last - first, owner, slice_first(p, owner)};
  }
  return n;
}

// A position in the step's jobs and in the ring (its slot and that slot's phase).
struct Cursor {
  int run, offset;
  unsigned slot, phase;
};
// The job at `c`; false past the step's last.
__device__ __forceinline__ bool job_at(const Run (&runs)[MAX_RUNS], int n, Cursor& c, Job& j) {
  while (c.run < n && c.offset >= runs[c.run].count) {
    ++c.run;
    c.offset = 0;
  }
  if (c.run >= n) return false;
  const Run& r = runs[c.run];
  j = {r.kind, r.first + c.offset * r.stride, r.owner, r.origin};
  return true;
}
__device__ __forceinline__ void advance(Cursor& c, unsigned slots) {
  ++c.offset;
  if (++c.slot == slots) {
    c.slot = 0;
    c.phase ^= 1u;
  }
}

__device__ __forceinline__ const char* row_at(const void* base, long long row, unsigned row_bytes) {
  return static_cast<const char*>(base) + row * row_bytes;
}
__device__ __forceinline__ char* row_at(void* base, long long row, unsigned row_bytes) {
  return static_cast<char*>(base) + row * row_bytes;
}

// Thread 0: the loads of job j into slot `at` (shared address), completing on `bar`.
__device__ __forceinline__ void ring_load(const Params& p, const Job& j, unsigned at, unsigned bar, unsigned row_bytes,
                                          bool pull) {
  const int s0 = j.origin;  // a reduce's: this rank's slice
  if (j.kind == PUSH) {
    fo::mbar_arrive_expect_tx(bar, row_bytes);
    fo::bulk_load(at, row_at(p.x, j.row, row_bytes), row_bytes, bar);
  } else if (j.kind == REDUCE) {
    fo::mbar_arrive_expect_tx(bar, (p.world + 1) * row_bytes);
    for (int src = 0; src < p.world; ++src) {
      const void* from = pull ? row_at(area(p, src, p.x_offset), j.row, row_bytes)
                         : src == p.rank ? row_at(p.x, j.row, row_bytes)
                         : p.oneshot     ? row_at(landed(p), j.row - s0, row_bytes)
                                         : row_at(slot(p, p.rank, src), j.row - s0, row_bytes);
      fo::bulk_load(at + src * row_bytes, from, row_bytes, bar);
    }
    const long long res_row = p.residual_sliced ? j.row - s0 : j.row;
    fo::bulk_load(at + p.world * row_bytes, row_at(p.residual, res_row, row_bytes), row_bytes, bar);
  } else {
    // Full residual: the owner's r (res area); sharded: its normalized rows (out area).
    fo::mbar_arrive_expect_tx(bar, row_bytes);
    fo::bulk_load(at, row_at(area(p, p.rank, p.residual_full ? p.res_offset : p.out_offset), j.row, row_bytes),
                  row_bytes, bar);
  }
}

// Thread 0: the stores of job j from slot `at` (array 0: r or the row
// copied; array 1: the normalized row), as one bulk group.
__device__ __forceinline__ void ring_store(const Params& p, const Job& j, unsigned at, unsigned row_bytes) {
  const unsigned out = at + row_bytes;
  if (j.kind == PUSH) {
    fo::bulk_store(row_at(slot(p, j.owner, p.rank), j.row - j.origin, row_bytes), at, row_bytes);
  } else if (j.kind == REDUCE) {
    const long long local = j.row - j.origin;
    fo::bulk_store(row_at(p.residual_out, p.residual_full ? j.row : local, row_bytes), at, row_bytes);
    fo::bulk_store(row_at(p.out, j.row, row_bytes), out, row_bytes);
    if (p.copy_engines == CE_WATCH) {
      fo::bulk_store(row_at(const_cast<uint4*>(landed(p)), local, row_bytes), at + p.world * row_bytes, row_bytes);
    }
    for (int i = 1; !p.copy_engines && i < p.world; ++i) {
      const int peer = (p.rank + i) % p.world;
      if (p.residual_full) {
        fo::bulk_store(row_at(area(p, peer, p.res_offset), j.row, row_bytes), at, row_bytes);
      } else {
        fo::bulk_store(row_at(area(p, peer, p.out_offset), j.row, row_bytes), out, row_bytes);
      }
    }
  } else if (p.residual_full) {
    fo::bulk_store(row_at(p.residual_out, j.row, row_bytes), at, row_bytes);
    fo::bulk_store(row_at(p.out, j.row, row_bytes), out, row_bytes);
  } else {
    fo::bulk_store(row_at(p.out, j.row, row_bytes), at, row_bytes);
  }
  fo::bulk_commit();
}

// The compute threads' sum of each one's `v`, the same in every one: over
// each warp by shuffles, then over the warps in order (`parity` alternates
// between rows so that one barrier per row suffices).
__device__ __forceinline__ float cta_sum(float v, int parity) {
  __shared__ float sums[2][WARPS];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (compute_thread() % 32 == 0) sums[parity][compute_thread() / 32] = v;
  fo::named_barrier(BAR_SUM, THREADS);
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) total += sums[parity][w];
  return total;
}

// A reduce or full-residual gather of the row in slot `slot_ptr`: r into
// array 0 (a reduce sums the sources in rank order and adds the residual;
// a gather finds the owner's r there), r normalized into array 1. The same
// arithmetic in the same order on every rank, so a gathered row is
// bit-identical to its owner's.
template <int FAST = 0>
__device__ __forceinline__ void ring_compute(const Params& p, const Job& j, uint4* slot_ptr, int vecs,
                                             const uint4 (&weight)[ROW_VECS], int parity) {
  // FAST (FO_HIDDEN / VEC; fo_arn_ce_watch's rows of that size: a watched one-shot reduce of 2 ranks):
  // the row's vectors a constant, so every offset is one and the tests of the world, kind, mode and
  // row length fold away. The compute threads' issue rate bounds a row (ncu on one H200: 2.06
  // instructions a cycle an SM, 4713 warp instructions a row of 8192), and this issues ~30% fewer;
  // on 2x H200 the call took 0.95x the time at 1K tokens on 32 CTAs, 0.92x at 2K and on 8 CTAs, a
  // tie at 512 (copy-bound).
  constexpr int KS = FAST ? (FAST + THREADS - 1) / THREADS : ROW_VECS;
  constexpr bool RAGGED = !FAST || FAST % THREADS != 0;  // some threads without a vector of the row
  if constexpr (FAST > 0) vecs = FAST;
  uint4 r[KS];
  float squares = 0.f;
#pragma unroll
  for (int k = 0; k < KS; ++k) {
    const int v = compute_thread() + k * THREADS;
    if (RAGGED && v >= vecs) continue;
    if (FAST || j.kind == REDUCE) {
      // The AllReduce's result is 16-bit (reduce_rows' arithmetic); the sum with the residual is
      // rounded again.
      uint4 s = slot_ptr[v];
      if (FAST || p.world == 2) {
        uint4 o = slot_ptr[vecs + v];
        uint4 sum = added(s, o);
        // Watching: the peer's vector as the bulk copy found it (the sentinel back once it is here).
        // A sum without a NaN shows it landed; with one (the sentinel, or a NaN in either x), the
        // exact test on the peer's vector.
        if ((FAST || p.copy_engines == CE_WATCH) && any_nan(sum) && unlanded(p.rank == 0 ? o : s)) {
          uint4* seen = const_cast<uint4*>(landed(p)) + static_cast<long long>(j.row - j.origin) * vecs + v;
          const uint4 w = await_landed(p, seen);
          if (p.rank == 0) {
            o = w;
          } else {
            s = w;
          }
          sum = added(s, o);
        }
        s = sum;
      } else {
        float acc[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = 0.f;
        for (int src = 0; src < p.world; ++src) accumulate(acc, slot_ptr[src * vecs + v]);
        s = packed(acc);
      }
      r[k] = added(s, slot_ptr[(FAST ? 2 : p.world) * vecs + v]);
      slot_ptr[v] = r[k];
      // Watching: the residual's part of the slot, read, takes the sentinel, which the producer
      // stores over the landed row (one bulk store, no store per vector here).
      if (FAST || p.copy_engines == CE_WATCH) {
        slot_ptr[(FAST ? 2 : p.world) * vecs + v] =
            make_uint4(WATCH_SENTINEL, WATCH_SENTINEL, WATCH_SENTINEL, WATCH_SENTINEL);
      }
    } else {
      r[k] = slot_ptr[v];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) squares = add_squares(squares, word(r[k], i));
  }
  const float scale = rsqrtf(cta_sum(squares, parity) / (FAST ? FAST * VEC : p.hidden) + p.eps);
#pragma unroll
  for (int k = 0; k < KS; ++k) {
    const int v = compute_thread() + k * THREADS;
    if (!RAGGED || v < vecs) slot_ptr[vecs + v] = normalized(r[k], weight[k], scale);
  }
}

// Thread 0: waits until every peer raised flag[at] of the kind at
// base_word to `epoch` (wait_all's rule, one thread); false (the error
// recorded, the call abandoned) on timeout.
__device__ __forceinline__ bool gate_wait(const Params& p, int base_word, int at, unsigned epoch) {
  for (int i = 1; i < p.world; ++i) {
    if (!await_peer(p, base_word, at, (p.rank + i) % p.world, epoch)) return false;
  }
  return true;
}

// Runs step t's jobs through the ring from slot position `at` (moved past
// them). The pushes read only this rank's x; the reduces and gathers read
// what the peers sent in their step t - 1, so the producer waits for the
// peers' flags only before its first load of those, with the pushes already
// in flight. Ends with every store complete and ordered before the flags
// raised next; false if a wait timed out (nothing stored after it).
// `gate`: wait for step t's flags before the first reduce or gather (the
// copy-engine mode's kernels have no flags: the copies came before them).
template <int FAST = 0>
__device__ __forceinline__ bool ring_run(const Params& p, const Run (&runs)[MAX_RUNS], int n, int t, bool gate,
                                         bool pull, int vecs, unsigned slots, unsigned slot_bytes, char* ring,
                                         Cursor& at, const uint4 (&weight)[ROW_VECS], int& parity, unsigned epoch) {
  const unsigned row_bytes = static_cast<unsigned>(vecs) * 16u;
  const unsigned base = fo::smem_addr(ring);
  const bool lead = threadIdx.x == 0;
  at.run = at.offset = 0;
  Job j;
  if (threadIdx.x < PRODUCER) {
    // The producer's loads run `slots` jobs ahead of the job being worked on.
    Cursor ahead = at;
    bool gated = !gate, live = true;
    // Job `next`'s loads into the slot at `ahead` (lane 0). Once abandoned
    // it only completes the slot's phase (no bytes), so no thread waits forever.
    auto fill = [&](const Job& next) {
      const unsigned bar = fo::smem_addr(&full_bars[ahead.slot]);
      if (!gated && next.kind != PUSH) {
        bool ok = live;
        if (lead && ok) {
          ok = (t < 0 || t >= p.stages || gate_wait(p, READY, flag_slot(t), epoch)) &&
               (t < 1 || gate_wait(p, DONE, flag_slot(t - 1), epoch));
          fo::fence_async_global();  // the peers' rows, acquired above, read by TMA next
        }
        live = __shfl_sync(0xffffffffu, ok, 0);
        gated = true;
      }
      if (lead && live) ring_load(p, next, base + ahead.slot * slot_bytes, bar, row_bytes, pull);
      if (lead && !live) fo::mbar_arrive(bar);
      __syncwarp();
      advance(ahead, slots);
    };
    for (unsigned k = 0; k < slots && job_at(runs, n, ahead, j); ++k) fill(j);
    for (bool first = true; job_at(runs, n, at, j); advance(at, slots), first = false) {
      if (computed(p, j)) {
        fo::named_barrier(BAR_HANDOFF, THREADS + PRODUCER);  // the compute threads wrote the row
      } else {
        fo::mbar_wait(fo::smem_addr(&full_bars[at.slot]), at.phase);
      }
      if (lead && live) ring_store(p, j, base + at.slot * slot_bytes, row_bytes);
      // The previous job's slot, once its stores have read it, takes the
      // job `slots` after it.
      Job next;
      if (!first && job_at(runs, n, ahead, next)) {
        if (lead) fo::bulk_wait_read_but_newest();
        __syncwarp();
        fill(next);
      }
    }
    if (lead) {
      fo::bulk_wait_all();
      fo::fence_async_global();  // the stores complete before the flags' release
    }
    __syncwarp();
  } else {
    for (; job_at(runs, n, at, j); advance(at, slots)) {
      // Every compute thread waits for every job, so that none runs a
      // slot's phase ahead: a parity wait two phases early would pass at once.
      fo::mbar_wait(fo::smem_addr(&full_bars[at.slot]), at.phase);
      if (computed(p, j)) {
        ring_compute<FAST>(p, j, reinterpret_cast<uint4*>(ring + at.slot * slot_bytes), vecs, weight, parity);
        parity ^= 1;
        fo::fence_async_shared();  // the rows written above, read by the bulk stores
        fo::named_barrier(BAR_HANDOFF, THREADS + PRODUCER);
      }
    }
  }
  __syncthreads();
  return !abandoned;
}

__device__ __forceinline__ bool ring_step(const Params& p, int t, bool pull, int vecs, unsigned slots,
                                          unsigned slot_bytes, char* ring, Cursor& at,
                                          const uint4 (&weight)[ROW_VECS], int& parity, unsigned epoch) {
  Run runs[MAX_RUNS];
  const int n = step_runs(p, t, pull, runs);
  return ring_run(p, runs, n, t, true, pull, vecs, slots, slot_bytes, ring, at, weight, parity, epoch);
}

// The ring's slots for rows of `vecs` vectors (world sources and the
// residual each), their barriers initialized, and the weight in registers.
__device__ __forceinline__ unsigned ring_setup(const Params& p, int vecs, unsigned& slot_bytes,
                                               uint4 (&weight)[ROW_VECS]) {
  slot_bytes = static_cast<unsigned>(p.world + 1) * static_cast<unsigned>(vecs) * 16u;
  const unsigned slots = min(static_cast<unsigned>(MAX_SLOTS), RING_BYTES / slot_bytes);
  if (threadIdx.x == 0) {
    abandoned = 0;
    for (unsigned s = 0; s < slots; ++s) fo::mbar_init(fo::smem_addr(&full_bars[s]), 1);
    fo::mbar_init_fence();
  }
#pragma unroll
  for (int k = 0; k < ROW_VECS; ++k) {
    const int v = compute_thread() + k * THREADS;
    if (compute_thread() >= 0 && v < vecs) weight[k] = p.weight[v];
  }
  __syncthreads();
  return slots;
}
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS + PRODUCER) fo_allreduce_rmsnorm(Params p) {
  extern __shared__ __align__(128) char ring[];
  const int vecs = p.hidden / VEC;
  unsigned* own = header(p, p.rank);
  const unsigned epoch = *reinterpret_cast<volatile unsigned*>(own + EPOCH) + 1;
  const bool pull = p.x_offset != 0;
  unsigned slot_bytes;
  uint4 weight[ROW_VECS];
  const unsigned slots = ring_setup(p, vecs, slot_bytes, weight);
  Cursor at = {0, 0, 0, 0};
  int parity = 0;
  bool ok = true;
  for (int t = -1; ok && t <= p.stages; ++t) {
    const bool pushes = t + 1 < p.stages, reduces = t >= 0 && t < p.stages;
    ok = ring_step(p, t, pull, vecs, slots, slot_bytes, ring, at, weight, parity, epoch);
    if (ok && (pushes || reduces)) raise(p, pushes ? flag_slot(t + 1) : -1, reduces ? flag_slot(t) : -1, epoch);
  }
  finish(own);
}
#else
extern "C" __global__ void __launch_bounds__(THREADS) fo_allreduce_rmsnorm(Params p) {
  const int vecs = p.hidden / VEC;
  unsigned* own = header(p, p.rank);
  // Every CTA reads the epoch before the last one to finish bumps it.
  const unsigned epoch = *reinterpret_cast<volatile unsigned*>(own + EPOCH) + 1;
  // Pull mode: the partial already lies in this rank's buffer; ready only says so.
  const bool pull = p.x_offset != 0;
  const int stages = p.stages;
  if (threadIdx.x == 0) abandoned = 0;  // read only after the first step's barriers

  // Step t pushes part t + 1, reduces part t, gathers part t - 1.
  bool ok = true;
  for (int t = -1; ok && t <= stages; ++t) {
    const bool pushes = t + 1 < stages, reduces = t >= 0 && t < stages;
    if (pushes && !pull) push(p, t + 1, vecs, epoch);
    // One-shot: the part's rows lie in this rank's own buffer, ready at once
    // (the peer's reduce of part t + 1 then waits for no reduce of part t here).
    if (pushes && p.oneshot) raise(p, flag_slot(t + 1), -1, epoch);
    if (reduces) {
      ok = wait_all(p, READY, flag_slot(t), epoch);
      if (ok) reduce(p, t, vecs, pull, epoch);
    }
    if (ok && t >= 1 && !p.oneshot) {
      ok = wait_all(p, DONE, flag_slot(t - 1), epoch);
      if (ok) gather(p, t - 1, vecs);
    }
    // One-shot raises no done: nothing waits for one.
    const bool dones = reduces && !p.oneshot;
    const bool readies = pushes && !p.oneshot;
    if (ok && (readies || dones)) raise(p, readies ? flag_slot(t + 1) : -1, dones ? flag_slot(t) : -1, epoch);
  }
  finish(own);
}

// One-shot alone (2 ranks, full residual, push; the host launches it for no
// other call): fo_allreduce_rmsnorm's one-shot steps with every other mode's
// code left out, so that a short call, whose every instruction runs about
// once, fetches far less code. STORE (fo_arn_oneshot_st): x goes into the
// peer's store half and its flag follows the part's reduce here (with one
// part: right after the push), so that the stores drain meanwhile.
template <bool STORE, bool HIDDEN = false>
__device__ __forceinline__ void oneshot_steps(const Params& p) {
  const int vecs = p.hidden / VEC;
  unsigned* own = header(p, p.rank);
  if (threadIdx.x == 0) abandoned = 0;  // read only after begin_call's barrier
  const CallEpoch call = begin_call(own);
  const unsigned epoch = call.value;
  bool ok = true;
  for (int t = -1; ok && t < p.stages; ++t) {
    const bool pushes = t + 1 < p.stages;
    if (pushes) push_oneshot<STORE>(p, t + 1, vecs, epoch);
    if (pushes && !STORE) raise(p, flag_slot(t + 1), -1, epoch);
    if (t >= 0) {
      ok = wait_all(p, READY, flag_slot(t), epoch);
      if (!ok) break;
      int first, last;
      part(p, p.rank, t, first, last);
      reduce_range<STORE ? STORES : LOADS, HIDDEN>(p, first, last, vecs, false, epoch);
    }
    if (pushes && STORE) raise(p, flag_slot(t + 1), -1, epoch);
  }
  end_call(own, call);
}
extern "C" __global__ void __launch_bounds__(THREADS) fo_arn_oneshot(Params p) { oneshot_steps<false>(p); }
extern "C" __global__ void __launch_bounds__(THREADS) fo_arn_oneshot_st(Params p) { oneshot_steps<true>(p); }
#if FO_HIDDEN
// The same steps with the reduce compiled for rows of FO_HIDDEN values
// (reduce_range's HIDDEN), entries of their own: beside the general path in
// one kernel the register allocation spilled and the call gained nothing;
// alone, at 128 tokens on 32 CTAs of 2x H200, 0.95x the time.
extern "C" __global__ void __launch_bounds__(THREADS) fo_arn_oneshot_h(Params p) { oneshot_steps<false, true>(p); }
extern "C" __global__ void __launch_bounds__(THREADS) fo_arn_oneshot_st_h(Params p) { oneshot_steps<true, true>(p); }
#endif
#endif  // FO_RING

// Copy-engine mode (2 ranks, csrc's part of rust/ops/norm_copy_engines.rs):
// the copy engines moved the peer's x rows of this rank's slice into its
// slot before this launch (one-shot: all its rows, to the slot area's
// start), and move the rows it writes afterwards, so the kernel only sums
// and normalizes, with no flag and no peer access.
// kind 1: rows [first, last) of this rank's slice: sum, add the residual,
// normalize (a reduce); kind 2: rows of the peer's slice (full residual):
// its r, landed in this rank's residual area, into residual_out,
// normalized into out (a gather). The rows split evenly over the CTAs; the
// owner's reduce and the peer's gather of the same rows split them alike,
// so both normalize each row with the same row groups, bit for bit.
namespace {
constexpr int CE_REDUCE = 1, CE_GATHER = 2;
__device__ __forceinline__ void cta_rows(int first, int last, int& f, int& l) {
  const long long rows = last - first;
  f = first + static_cast<int>(rows * blockIdx.x / gridDim.x);
  l = first + static_cast<int>(rows * (blockIdx.x + 1) / gridDim.x);
}

// One-shot on the copy engines in one launch (fo_arn_ce_chunks; 2 ranks,
// full residual): the peer's copy engines land its x in `count` row ranges
// (every row: one-shot), each followed by x_arrived[c] = 1 in this rank's
// header; every CTA waits for each range's flag in turn and sums, adds the
// residual and normalizes its share of the range's rows. No stream wait or
// launch stands between the ranges (each cost ~8 us on 2x H200). The last
// CTA to finish zeroes the flags, tells the peer that this rank has read
// every row landed here (consumed = 1 in the peer's header) and waits for
// the peer's word: the call ends with both ranks done reading, so a call of
// any mode may write into the peer's buffer next.
constexpr int CE_LAUNCH_CHUNKS = 16;
struct Chunks {
  int count;
  int bounds[CE_LAUNCH_CHUNKS + 1];  // range c: rows [bounds[c], bounds[c + 1])
};

// Every thread: once range c's rows have landed (false: the wait timed out).
__device__ __forceinline__ bool ce_arrived(const Params& p, int c) {
  __syncthreads();
  if (threadIdx.x == 0) {
    await_word(p, header(p, p.rank) + CE_ARRIVED + c, 1u, 1u + CE_ARRIVED + c);
#if FO_RING
    fo::fence_async_global();  // the rows, acquired above, read by TMA next
#endif
  }
  __syncthreads();
  return !abandoned;
}

// The launch's end: the last CTA zeroes the flags and exchanges consumed.
// A watched call with an epoch has neither: the epoch word is never reset,
// and the peer's copies alternate between two watch halves, so its next
// into this call's half follows its end of a call in between, which waited
// for rows this rank sent after this call had ended.
__device__ __forceinline__ void ce_close(const Params& p, int count) {
  __syncthreads();
  if (threadIdx.x != 0 || abandoned || p.watch_epoch) return;
  unsigned* own = header(p, p.rank);
  if (!last_cta(own + CE_FINISHED)) return;
  // Watching, the flag follows the copy's last byte, which the CTAs may have seen before it.
  for (int c = 0; c < count; ++c) {
    if (await_word(p, own + CE_ARRIVED + c, 1u, 1u + CE_ARRIVED + c)) own[CE_ARRIVED + c] = 0;
  }
  store_release_sys(header(p, 1 - p.rank) + CE_CONSUMED, 1u);
  if (await_word(p, own + CE_CONSUMED, 1u, 1u + CE_CONSUMED)) own[CE_CONSUMED] = 0;
}

#if !FO_RING
// Watch mode's rows: blocks of a row per row group, dealt to the CTAs in
// turn, so that every CTA works just behind the copy's front.
__device__ __forceinline__ void watch_rows(const Params& p) {
  const int vecs = p.hidden / VEC;
  int size = 1;
  while (size * 32 * REG_VECS < vecs) size *= 2;
  const int rows = max(WARPS / size, 1);
  for (int f = blockIdx.x * rows; f < p.tokens; f += gridDim.x * rows) {
    // A short last block regroups the warps: none may reach a named barrier
    // of its new group while another is still in one of its old.
    if (f + rows > p.tokens) __syncthreads();
    reduce_range(p, f, min(f + rows, p.tokens), vecs, false);
  }
}
#endif
}  // namespace

// One-shot on the copy engines, watching (2 ranks, full residual): the
// peer's x lands in one copy into the watch area, each vector known landed
// by its value; every CTA sums, adds the residual and normalizes its rows
// as they land, puts the sentinel back, and the last CTA closes the call as
// fo_arn_ce_chunks' does. Through the ring in its build, else plain loads.
#if FO_RING
// The ring: CTA b's jobs are rows b, b + CTAs, ... (the bulk copies may find
// a row partly landed: the compute threads check every vector).
namespace {
// A copy-engine kernel's ring: set up once, then one run of rows at a time
// (jobs of one kind, no flags: the rows were landed by the copy engines).
struct CeRing {
  char* smem;
  int vecs;
  unsigned slot_bytes, slots;
  uint4 weight[ROW_VECS];
  Cursor at;
  int parity;
  __device__ __forceinline__ explicit CeRing(const Params& p, char* ring)
      : smem(ring), vecs(p.hidden / VEC), at{0, 0, 0, 0}, parity(0) {
    slots = ring_setup(p, vecs, slot_bytes, weight);
  }
  // The ring over `run`'s rows (none where its count is 0).
  template <int FAST = 0>
  __device__ __forceinline__ void rows(const Params& p, const Run& run) {
    Run runs[MAX_RUNS];
    runs[0] = run;
    ring_run<FAST>(p, runs, run.count > 0 ? 1 : 0, 0, false, false, vecs, slots, slot_bytes, smem, at, weight, parity,
                   0);
  }
};
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS + PRODUCER) fo_arn_ce_watch(Params p) {
  extern __shared__ __align__(128) char ring[];
  CeRing r(p, ring);
  const int b = blockIdx.x, ctas = gridDim.x;
  const int count = b < p.tokens ? (p.tokens - b + ctas - 1) / ctas : 0;
#if FO_HIDDEN
  if (p.hidden == FO_HIDDEN) {
    r.rows<FO_HIDDEN / VEC>(p, {REDUCE, b, count, p.rank, slice_first(p, p.rank), ctas});
  } else {
    r.rows(p, {REDUCE, b, count, p.rank, slice_first(p, p.rank), ctas});
  }
#else
  r.rows(p, {REDUCE, b, count, p.rank, slice_first(p, p.rank), ctas});
#endif
  ce_close(p, 1);
}
extern "C" __global__ void __launch_bounds__(THREADS + PRODUCER) fo_arn_ce(Params p, int first, int last, int kind) {
  extern __shared__ __align__(128) char ring[];
  CeRing r(p, ring);
  int f, l;
  cta_rows(first, last, f, l);
  const int owner = kind == CE_REDUCE ? p.rank : (p.rank + 1) % p.world;
  r.rows(p, {kind == CE_REDUCE ? REDUCE : GATHER, f, l - f, owner, slice_first(p, owner)});
}
extern "C" __global__ void __launch_bounds__(THREADS + PRODUCER) fo_arn_ce_chunks(Params p, Chunks ch) {
  extern __shared__ __align__(128) char ring[];
  CeRing r(p, ring);
  for (int c = 0; c < ch.count && ce_arrived(p, c); ++c) {
    int f, l;
    cta_rows(ch.bounds[c], ch.bounds[c + 1], f, l);
    r.rows(p, {REDUCE, f, l - f, p.rank, slice_first(p, p.rank)});
  }
  ce_close(p, ch.count);
}
#else
extern "C" __global__ void __launch_bounds__(THREADS) fo_arn_ce(Params p, int first, int last, int kind) {
  int f, l;
  cta_rows(first, last, f, l);
  if (kind == CE_REDUCE) {
    reduce_range(p, f, l, p.hidden / VEC, false);
  } else {
    gather_range(p, f, l, p.hidden / VEC);
  }
}
extern "C" __global__ void __launch_bounds__(THREADS) fo_arn_ce_watch(Params p) {
  if (threadIdx.x == 0) abandoned = 0;
  __syncthreads();
  watch_rows(p);
  ce_close(p, 1);
}
extern "C" __global__ void __launch_bounds__(THREADS) fo_arn_ce_chunks(Params p, Chunks ch) {
  if (threadIdx.x == 0) abandoned = 0;
  for (int c = 0; c < ch.count && ce_arrived(p, c); ++c) {
    int f, l;
    cta_rows(ch.bounds[c], ch.bounds[c + 1], f, l);
    reduce_range(p, f, l, p.hidden / VEC, false);
  }
  ce_close(p, ch.count);
}
#endif
