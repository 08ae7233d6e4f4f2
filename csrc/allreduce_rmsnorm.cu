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
// One-shot (2 ranks, full residual, push mode: the `o` configs): no owners.
// Every rank's CTA b pushes its part of ALL rows of x into the peer's
// buffer, and then sums, adds its own residual and normalizes its part of
// all rows itself: as many bytes cross NVLink as in the two steps above
// (each direction carries the rows once), one barrier fewer, no gather, and
// every rank computes its rows with its own residual and weight, exactly the
// torch composition. A closing flag exchange (done of the last part) keeps a
// rank's next call from writing into a buffer the peer still reads.
// Pull mode (x_offset != 0: gemm_all_reduce_rmsnorm, one call per wave
// group): the producing GEMM stored each rank's partial straight into its
// own buffer's x area, so step 1 pushes nothing and only raises ready;
// step 2 reads every source's rows there (peer loads). A call then covers
// rows [row0, row0 + tokens) of arrays of the whole output's rows, split
// among the owners like the tokens of a plain call.
// The flags hold the call's epoch (a counter in each rank's buffer, bumped
// by the last CTA to finish), so they never need resetting and CUDA-graph
// replays work. A wait that lasts longer than `timeout_ns` (0: forever)
// records an error in the buffer's header and abandons the call.
// FO_RING (Hopper, two-shot): the same steps, flags and buffers, with the
// rows moved by bulk copies through a shared-memory ring (see "Ring" below).
#include "ptx.cuh"
#ifndef FO_RING
#define FO_RING 0
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
constexpr int EPOCH = 0, FINISHED = 1, ERROR = 2;
// Flags of one kind: a word per (part, source); ready and done fill the
// 64 KiB header after its first 16 words, so CTAs x stages <= FLAG_SLOTS.
constexpr int FLAG_SLOTS = 1023;
constexpr int READY = 16;
constexpr int DONE = READY + FLAG_SLOTS * FO_MAX_WORLD;

using fo::high;
using fo::low;
using fo::pack2;
using fo::word;

__device__ __forceinline__ void store_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
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
  int rank, world, tokens, hidden;
  float eps;
  int residual_full;
  int row0;                                // first row of this call (0 in push mode)
  int stages;                              // parts per chunk, CTAs x stages <= FLAG_SLOTS
  int oneshot;                             // every rank reduces every row (2 ranks, full, push)
  int residual_sliced;                     // sharded: residual holds this rank's slice rows only
  int link_ctas;                           // the ring's CTAs that move rows across NVLink
};

namespace {
__device__ __forceinline__ unsigned* header(const Params& p, int rank) {
  return reinterpret_cast<unsigned*>(p.bases[rank]);
}
__device__ __forceinline__ char* area(const Params& p, int rank, unsigned long long offset) {
  return reinterpret_cast<char*>(p.bases[rank]) + offset;
}
// Slot of `source` in `owner`'s buffer (after the 64 KiB header). One-shot
// slots hold every row, so only the world - 1 peers get one.
__device__ __forceinline__ uint4* slot(const Params& p, int owner, int source) {
  const int index = p.oneshot ? (source - owner - 1 + p.world) % p.world : source;
  return reinterpret_cast<uint4*>(area(p, owner, 65536ull + static_cast<unsigned long long>(index) * p.slot_bytes));
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

// Spins until `peer` raised flag[at][peer] of the kind at base_word in this
// rank's buffer to `epoch` (an acquire), or the call was abandoned; after
// `timeout_ns` records the error and abandons the call. True if the flag came.
__device__ __forceinline__ bool await_peer(const Params& p, int base_word, int at, int peer, unsigned epoch) {
  unsigned* h = header(p, p.rank);
  const unsigned* flag = h + base_word + at * FO_MAX_WORLD + peer;
  const unsigned long long start = p.timeout_ns ? now_ns() : 0;
  // Signed distance: epochs wrap around without harm.
  while (static_cast<int>(load_acquire_sys(flag) - epoch) < 0 && !*static_cast<volatile int*>(&abandoned)) {
    if (p.timeout_ns && now_ns() - start > p.timeout_ns) {
      atomicExch(h + ERROR, 1u + base_word);
      abandoned = 1;
    }
  }
  return !*static_cast<volatile int*>(&abandoned);
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

// The last CTA of the call to finish moves this rank to the next epoch.
__device__ __forceinline__ void finish(unsigned* own) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(own + FINISHED, 1u) == gridDim.x - 1) {
      own[FINISHED] = 0;
      atomicAdd(own + EPOCH, 1u);
    }
  }
}

// The warps that share a row. A part with fewer rows than the CTA has warps
// gives each row `size` warps (a power of two, at most 15 groups: the named
// barriers 1..15), so that a short call is not one warp's chain of loads per
// row. Thread `t` of the group's `threads` takes vectors t, t + threads, ...
struct RowGroup {
  int size, index, count, t, threads;
};

__device__ __forceinline__ RowGroup row_group(int rows) {
  int size = 1;
  for (int c = 2; c <= WARPS && rows * c <= WARPS; c *= 2) {
    if (WARPS / c <= 15) size = c;
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
  if (FIXED || g.size == 1) return v;
  const int first = g.index * g.size;
  if (threadIdx.x % 32 == 0) slots[parity][first + g.t / 32] = v;
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + g.index), "r"(g.threads) : "memory");
  float total = 0.f;
  for (int w = 0; w < g.size; ++w) total += slots[parity][first + w];
  return total;
}

// A thread's share of sum(r^2) over a row of r, in the order in which the
// reduce step accumulates it (its vectors in blocks of UNROLL), then summed
// over the row's group: bit-identical wherever it is computed.
template <int FIXED>
__device__ __forceinline__ float row_scale(const uint4* r_row, int vecs, const RowGroup& g, int parity, float hidden,
                                           float eps) {
  const int threads = row_threads<FIXED>(g);
  float squares = 0.f;
  for (int v0 = g.t; v0 < vecs; v0 += threads * UNROLL) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int v = v0 + threads * u;
      if (v >= vecs) continue;
      const uint4 r = r_row[v];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const unsigned t = word(r, i);
        squares += low(t) * low(t) + high(t) * high(t);
      }
    }
  }
  return rsqrtf(group_sum<FIXED>(squares, g, parity) / hidden + eps);
}

__device__ __forceinline__ uint4 normalized(uint4 r, uint4 g, float scale) {
  uint4 y;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned rw = word(r, i), gw = word(g, i);
    word(y, i) = pack2(low(rw) * scale * low(gw), high(rw) * scale * high(gw));
  }
  return y;
}

// Normalizes a row of r by `scale` (the thread's vectors, UNROLL loads in
// flight), handing store(v, r, y) each vector of r and of the normalized row.
template <int FIXED, typename Store>
__device__ __forceinline__ void normalize_row(const uint4* r_row, const uint4* weight, float scale, int vecs,
                                              const RowGroup& grp, Store store) {
  const int threads = row_threads<FIXED>(grp);
  for (int v0 = grp.t; v0 < vecs; v0 += threads * UNROLL) {
    uint4 r[UNROLL], g[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int v = v0 + threads * u;
      if (v < vecs) {
        r[u] = r_row[v];
        g[u] = weight[v];
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int v = v0 + threads * u;
      if (v < vecs) store(v, r[u], normalized(r[u], g[u], scale));
    }
  }
}
}  // namespace

namespace {
// Step 1 for part `stage`: copies it of every other owner's slice of x into
// that owner's slot for this rank.
// One-shot: its part of every row (the slots then hold every row).
__device__ __forceinline__ void push(const Params& p, int stage, int vecs) {
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
template <int FIXED>
__device__ __forceinline__ void reduce_rows(const Params& p, int first, int last, int vecs, bool pull,
                                            const RowGroup& grp) {
  const int s0 = slice_first(p, p.rank);
  const int threads = row_threads<FIXED>(grp);
  // Two-shot with the full residual: r goes to every peer (one-shot: each computes its own).
  const bool share_r = p.residual_full && !p.oneshot;
  int parity = 0;
  for (int row = first + grp.index; row < last; row += grp.count, parity ^= 1) {
    const long long base = static_cast<long long>(row) * vecs;
    const long long local = static_cast<long long>(row - s0) * vecs;
    uint4* r_row = p.residual_out + (p.residual_full ? base : local);
    float squares = 0.f;
    for (int v0 = grp.t; v0 < vecs; v0 += threads * UNROLL) {
      float acc[UNROLL][8];
      uint4 res[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int v = v0 + threads * u;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = 0.f;
        if (v < vecs) res[u] = p.residual[(p.residual_sliced ? local : base) + v];
      }
      // Rank order, so that every rank would get bit-identical sums.
      for (int src = 0; src < p.world; ++src) {
        const uint4* from = pull ? reinterpret_cast<const uint4*>(area(p, src, p.x_offset)) + base
                            : src == p.rank ? p.x + base : slot(p, p.rank, src) + local;
        uint4 w[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int v = v0 + threads * u;
          if (v < vecs) w[u] = from[v];
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            acc[u][2 * i] += low(word(w[u], i));
            acc[u][2 * i + 1] += high(word(w[u], i));
          }
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int v = v0 + threads * u;
        if (v >= vecs) continue;
        uint4 r;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          // The AllReduce's result is 16-bit; the sum with the residual is rounded again.
          const unsigned s = pack2(acc[u][2 * i], acc[u][2 * i + 1]);
          const unsigned rw = word(res[u], i);
          const unsigned t = pack2(low(s) + low(rw), high(s) + high(rw));
          squares += low(t) * low(t) + high(t) * high(t);
          word(r, i) = t;
        }
        r_row[v] = r;
        for (int i = 1; share_r && i < p.world; ++i) {
          const int peer = (p.rank + i) % p.world;
          reinterpret_cast<uint4*>(area(p, peer, p.res_offset))[base + v] = r;
        }
      }
    }
    const float scale = rsqrtf(group_sum<FIXED>(squares, grp, parity) / p.hidden + p.eps);
    // r_row: this thread's vectors, written by it above.
    normalize_row<FIXED>(r_row, p.weight, scale, vecs, grp, [&](int v, uint4, uint4 y) {
      p.out[base + v] = y;
      for (int i = 1; !p.residual_full && i < p.world; ++i) {
        const int peer = (p.rank + i) % p.world;
        reinterpret_cast<uint4*>(area(p, peer, p.out_offset))[base + v] = y;
      }
    });
  }
}

// Step 2 for part `stage` of this rank's slice.
__device__ __forceinline__ void reduce(const Params& p, int stage, int vecs, bool pull) {
  int first, last;
  part(p, p.rank, stage, first, last);
  const RowGroup grp = row_group(last - first);
  if (grp.size == 1) {
    reduce_rows<WARP_ROWS>(p, first, last, vecs, pull, grp);
  } else {
    reduce_rows<ANY_ROWS>(p, first, last, vecs, pull, grp);
  }
}

// Step 3's rows [first, last) of another owner's r (full residual):
// normalized here as the owner did, with its row groups, bit for bit.
template <int FIXED>
__device__ __forceinline__ void gather_rows(const Params& p, int first, int last, int vecs, const RowGroup& grp) {
  const uint4* staged = reinterpret_cast<const uint4*>(area(p, p.rank, p.res_offset));
  int parity = 0;
  for (int row = first + grp.index; row < last; row += grp.count, parity ^= 1) {
    const long long base = static_cast<long long>(row) * vecs;
    const float scale = row_scale<FIXED>(staged + base, vecs, grp, parity, static_cast<float>(p.hidden), p.eps);
    normalize_row<FIXED>(staged + base, p.weight, scale, vecs, grp, [&](int v, uint4 r, uint4 y) {
      p.residual_out[base + v] = r;
      p.out[base + v] = y;
    });
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
    const RowGroup grp = row_group(last - first);
    // Groups change between owners: no warp may write a slot another still reads.
    if (grp.size > 1) __syncthreads();
    if (grp.size == 1) {
      gather_rows<WARP_ROWS>(p, first, last, vecs, grp);
    } else {
      gather_rows<ANY_ROWS>(p, first, last, vecs, grp);
    }
  }
}
}  // namespace

#if FO_RING
namespace {
// Ring (Hopper; FO_RING; two-shot, push mode): the CTAs take one of two
// roles, so that NVLink streams without a pause while the local work goes on
// beside it.
//  - Link CTAs (the last `link_ctas` of the grid) only move rows across
//    NVLink: one thread bulk-copies local rows into a ring of shared-memory
//    slots and from there into the peers' buffers. First every other
//    owner's slice of x, part by part, raising ready[part][rank] in the
//    owner's buffer after each; then what each part of this rank's slice
//    leaves for the peers (r when every rank keeps the full residual, else
//    the normalized rows), each part once the compute CTAs stored it (they
//    raise ready[part][rank] in this rank's own buffer, a column no peer
//    writes), raising done[part][rank] in every peer's buffer after it.
//  - Compute CTAs: a producer warp (warp 0, lane 0 issuing) keeps the local
//    loads of up to `slots` rows in flight into a ring of slots (a slot
//    holds one row of every array a row loads: world sources and the
//    residual for a reduce), waits for a part's flags before its first
//    load, and stores the results; the THREADS compute threads behind it
//    work one row at a time (compute thread c takes vectors c, c + THREADS,
//    ...). A compute CTA reduces its parts of this rank's slice, then
//    gathers its parts of every other owner's slice as they arrive.
// A slice is cut into `parts` parts (ring_parts); part k's reduce and
// gathers belong to compute CTA k mod computes, its pushes to link CTA
// k mod links. Every wait is for flags raised by work that waits on nothing
// its waiter has still to do, once every CTA of every rank is resident (one
// per SM: the ring takes its shared memory).
constexpr unsigned RING_BYTES = FO_RING_BYTES;
constexpr int MAX_SLOTS = 8;        // a compute CTA's slots
constexpr int PART_ROWS = 16;       // the most rows a part takes while parts fit the flags
constexpr int PRODUCER = 32;  // threads of the producer warp, ahead of the compute threads
// Named barriers: the compute threads' row sum, and a row's hand-off from them to the producer.
constexpr int BAR_SUM = 1, BAR_HANDOFF = 2;
__device__ __forceinline__ int compute_thread() { return static_cast<int>(threadIdx.x) - PRODUCER; }
// A thread's vectors of a row (hidden <= 16384).
constexpr int ROW_VECS = (2048 + THREADS - 1) / THREADS;
enum Kind { REDUCE, GATHER };
__shared__ __align__(8) unsigned long long full_bars[MAX_SLOTS];

// Parts per slice, the same on every rank: about two per compute CTA, of
// 1 to PART_ROWS rows (of the largest slice), at most FLAG_SLOTS.
__device__ __forceinline__ int ring_parts(const Params& p, int computes) {
  const int rows = (p.tokens + p.world - 1) / p.world;
  const int per = min(max((rows + 2 * computes - 1) / (2 * computes), 1), PART_ROWS);
  return max(min((rows + per - 1) / per, FLAG_SLOTS), 1);
}
// Part k of `parts` of owner's slice: rows [first, last), possibly none.
__device__ __forceinline__ void ring_part(const Params& p, int owner, int k, int parts, int& first, int& last) {
  const int s0 = slice_start(p, owner);
  const long long rows = slice_start(p, owner + 1) - s0;
  first = s0 + static_cast<int>(rows * k / parts);
  last = s0 + static_cast<int>(rows * (k + 1) / parts);
}

__device__ __forceinline__ const char* row_at(const void* base, long long row, unsigned row_bytes) {
  return static_cast<const char*>(base) + row * row_bytes;
}
__device__ __forceinline__ char* row_at(void* base, long long row, unsigned row_bytes) {
  return static_cast<char*>(base) + row * row_bytes;
}
__device__ __forceinline__ unsigned* flag_at(const Params& p, int in_rank, int base_word, int part, int from) {
  return header(p, in_rank) + base_word + part * FO_MAX_WORLD + from;
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

// ---- Compute CTAs ----

// A run of rows: one part's reduce or its gather from one owner.
struct Run {
  int kind, part, owner, first, count;
};
struct Job {
  int kind, part, owner, row;
  bool first, last;  // of its run
};
// Run i of compute CTA c of `computes`: its reduces in part order, then its
// gathers part by part, owner by owner; false past the last.
__device__ __forceinline__ bool run_of(const Params& p, int i, int c, int computes, int parts, Run& r) {
  const int mine = c < parts ? (parts - 1 - c) / computes + 1 : 0;
  if (i >= mine * p.world) return false;
  int k, owner;
  if (i < mine) {
    k = c + i * computes;
    owner = p.rank;
  } else {
    const int g = i - mine;
    k = c + (g / (p.world - 1)) * computes;
    owner = (p.rank + 1 + g % (p.world - 1)) % p.world;
  }
  int first, last;
  ring_part(p, owner, k, parts, first, last);
  r = {i < mine ? REDUCE : GATHER, k, owner, first, last - first};
  return true;
}

// A position in the CTA's jobs (its run, cached) and in the ring (its slot and that slot's phase).
struct Cursor {
  int run, offset, cached;
  Run r;
  unsigned slot, phase;
};
// The job at `c`; false at run `end` or past the CTA's last.
__device__ __forceinline__ bool job_at(const Params& p, Cursor& c, int end, int cta, int computes, int parts, Job& j) {
  for (;;) {
    if (c.run >= end) return false;
    if (c.cached != c.run) {
      if (!run_of(p, c.run, cta, computes, parts, c.r)) return false;
      c.cached = c.run;
    }
    if (c.offset < c.r.count) break;
    ++c.run;
    c.offset = 0;
  }
  j = {c.r.kind, c.r.part, c.r.owner, c.r.first + c.offset, c.offset == 0, c.offset == c.r.count - 1};
  return true;
}
__device__ __forceinline__ void advance(Cursor& c, unsigned slots) {
  ++c.offset;
  if (++c.slot == slots) {
    c.slot = 0;
    c.phase ^= 1u;
  }
}

// Thread 0: the loads of job j into slot `at` (shared address), completing on `bar`.
__device__ __forceinline__ void ring_load(const Params& p, const Job& j, unsigned at, unsigned bar, unsigned row_bytes) {
  if (j.kind == REDUCE) {
    const int s0 = slice_start(p, p.rank);
    fo::mbar_arrive_expect_tx(bar, (p.world + 1) * row_bytes);
    for (int src = 0; src < p.world; ++src) {
      const void* from = src == p.rank ? row_at(p.x, j.row, row_bytes) : row_at(slot(p, p.rank, src), j.row - s0, row_bytes);
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
  if (j.kind == REDUCE) {
    const long long local = j.row - slice_start(p, p.rank);
    fo::bulk_store(row_at(p.residual_out, p.residual_full ? j.row : local, row_bytes), at, row_bytes);
    fo::bulk_store(row_at(p.out, j.row, row_bytes), out, row_bytes);
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
__device__ __forceinline__ void ring_compute(const Params& p, const Job& j, uint4* slot_ptr, int vecs,
                                             const uint4 (&weight)[ROW_VECS], int parity) {
  uint4 r[ROW_VECS];
  float squares = 0.f;
#pragma unroll
  for (int k = 0; k < ROW_VECS; ++k) {
    const int v = compute_thread() + k * THREADS;
    if (v >= vecs) continue;
    if (j.kind == REDUCE) {
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.f;
      for (int src = 0; src < p.world; ++src) {
        const uint4 w = slot_ptr[src * vecs + v];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[2 * i] += low(word(w, i));
          acc[2 * i + 1] += high(word(w, i));
        }
      }
      const uint4 res = slot_ptr[p.world * vecs + v];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        // The AllReduce's result is 16-bit; the sum with the residual is rounded again.
        const unsigned s = pack2(acc[2 * i], acc[2 * i + 1]);
        const unsigned rw = word(res, i);
        word(r[k], i) = pack2(low(s) + low(rw), high(s) + high(rw));
      }
      slot_ptr[v] = r[k];
    } else {
      r[k] = slot_ptr[v];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const unsigned t = word(r[k], i);
      squares += low(t) * low(t) + high(t) * high(t);
    }
  }
  const float scale = rsqrtf(cta_sum(squares, parity) / p.hidden + p.eps);
#pragma unroll
  for (int k = 0; k < ROW_VECS; ++k) {
    const int v = compute_thread() + k * THREADS;
    if (v < vecs) slot_ptr[vecs + v] = normalized(r[k], weight[k], scale);
  }
}

// A compute CTA's work (every thread): its reduce runs through the ring,
// then its gather runs. The producer waits for a run's flags before its
// first load (ready from every peer for a reduce, done from the owner for a
// gather) and, once a reduce run's rows are stored, raises ready[part][rank]
// in this rank's buffer for the link CTAs. No gather is waited for before
// every reduce is stored and flagged: the peers' done flags wait for theirs,
// which wait for this rank's pushes only. Once abandoned, the producer only
// completes each slot's phase (no bytes), so no thread waits forever.
__device__ __forceinline__ void compute_work(const Params& p, int cta, int computes, int parts, int vecs, char* ring,
                                             unsigned epoch) {
  const unsigned row_bytes = static_cast<unsigned>(vecs) * 16u;
  const unsigned slot_bytes = static_cast<unsigned>(p.world + 1) * row_bytes;
  const unsigned slots = min(static_cast<unsigned>(MAX_SLOTS), RING_BYTES / slot_bytes);
  const unsigned base = fo::smem_addr(ring);
  const bool lead = threadIdx.x == 0;
  const int reduces = cta < parts ? (parts - 1 - cta) / computes + 1 : 0;
  uint4 weight[ROW_VECS];
#pragma unroll
  for (int k = 0; k < ROW_VECS; ++k) {
    const int v = compute_thread() + k * THREADS;
    if (compute_thread() >= 0 && v < vecs) weight[k] = p.weight[v];
  }
  Cursor at = {0, 0, -1, {}, 0, 0};
  int parity = 0;
  bool live = true;
  for (int end : {reduces, reduces * p.world}) {
    Job j;
    if (threadIdx.x < PRODUCER) {
      Cursor ahead = at;  // the loads run `slots` jobs ahead of the job being stored
      auto fill = [&](const Job& next) {
        const unsigned bar = fo::smem_addr(&full_bars[ahead.slot]);
        if (next.first) {
          bool ok = live;
          if (lead && ok) {
            ok = next.kind == REDUCE ? gate_wait(p, READY, next.part, epoch)
                                     : await_peer(p, DONE, next.part, next.owner, epoch);
            fo::fence_async_global();  // the peers' rows, acquired above, read by TMA next
          }
          live = __shfl_sync(0xffffffffu, ok, 0);
        }
        if (lead && live) ring_load(p, next, base + ahead.slot * slot_bytes, bar, row_bytes);
        if (lead && !live) fo::mbar_arrive(bar);
        __syncwarp();
        advance(ahead, slots);
      };
      for (unsigned k = 0; k < slots && job_at(p, ahead, end, cta, computes, parts, j); ++k) fill(j);
      for (bool first = true; job_at(p, at, end, cta, computes, parts, j); advance(at, slots), first = false) {
        if (j.kind == REDUCE || p.residual_full) {
          fo::named_barrier(BAR_HANDOFF, THREADS + PRODUCER);  // the compute threads wrote the row
        } else {
          fo::mbar_wait(fo::smem_addr(&full_bars[at.slot]), at.phase);
        }
        if (lead && live) {
          ring_store(p, j, base + at.slot * slot_bytes, row_bytes);
          if (j.kind == REDUCE && j.last) {
            // The part's rows complete, then its flag for the link CTAs (the loads ahead stay in flight).
            fo::bulk_wait_all();
            fo::fence_async_global();
            store_release_sys(flag_at(p, p.rank, READY, j.part, p.rank), epoch);
          }
        }
        // The previous job's slot, once its stores have read it, takes the job `slots` after it.
        Job next;
        if (!first && job_at(p, ahead, end, cta, computes, parts, next)) {
          if (lead) fo::bulk_wait_read_but_newest();
          __syncwarp();
          fill(next);
        }
      }
      if (lead) fo::bulk_wait_all();
      __syncwarp();
    } else {
      for (; job_at(p, at, end, cta, computes, parts, j); advance(at, slots)) {
        // Every compute thread waits for every job, so that none runs a
        // slot's phase ahead: a parity wait two phases early would pass at once.
        fo::mbar_wait(fo::smem_addr(&full_bars[at.slot]), at.phase);
        if (j.kind == REDUCE || p.residual_full) {
          ring_compute(p, j, reinterpret_cast<uint4*>(ring + at.slot * slot_bytes), vecs, weight, parity);
          parity ^= 1;
          fo::fence_async_shared();  // the rows written above, read by the bulk stores
          fo::named_barrier(BAR_HANDOFF, THREADS + PRODUCER);
        }
      }
    }
  }
}

// ---- Link CTAs ----

// A row a link CTA moves: phase 0 pushes row `row` of x to owner `q`'s
// slot for this rank; phase 1 sends row `row` of this rank's slice (r or
// the normalized row) to every peer.
struct LinkJob {
  int phase, part, q, row;
  bool first, last;  // of its group (a part, and in phase 0 one owner)
};
struct LinkCursor {
  int phase, n, qi, offset, first, count;
  bool cached;
};
// The next job of link CTA l of `links` in the cursor's phase; false past
// its last. Groups of no rows are skipped: nobody waits for their flags.
__device__ __forceinline__ bool link_next(const Params& p, LinkCursor& c, int l, int links, int parts, LinkJob& j) {
  for (;;) {
    const int k = l + c.n * links;
    if (k >= parts) return false;
    const int q = c.phase == 0 ? (p.rank + 1 + c.qi) % p.world : p.rank;
    if (!c.cached) {
      int first, last;
      ring_part(p, q, k, parts, first, last);
      c.first = first;
      c.count = last - first;
      c.cached = true;
    }
    if (c.offset < c.count) {
      j = {c.phase, k, q, c.first + c.offset, c.offset == 0, c.offset == c.count - 1};
      ++c.offset;
      return true;
    }
    c.offset = 0;
    c.cached = false;
    if (c.phase == 0 && ++c.qi < p.world - 1) continue;
    c.qi = 0;
    ++c.n;
  }
}

// A link CTA's work (every thread): its groups in order, phase 0 and then
// phase 1, in plain 16-byte loads and stores. Two halves of 8 warps take
// alternate groups, so that one streams while the other waits for its
// stores to land before raising its group's flag (a release after the half's
// barrier: cumulative, it orders every thread's stores of the group before
// the flag). Phase 1 waits for the compute CTAs' flag of a part before
// copying it, and starts only once every group of phase 0 of this CTA is
// flagged: the flag it waits for comes after the peers' pushes, which may
// wait for this rank's. The 17th warp only waits. Once a wait timed out
// nothing more is copied.
constexpr int LINK_WARPS = 8, LINK_UNROLL = 8;
__device__ __forceinline__ void link_work(const Params& p, int l, int links, int parts, int vecs, unsigned epoch) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int half = warp / LINK_WARPS, t = static_cast<int>(threadIdx.x) % (LINK_WARPS * 32);
  constexpr int HALF_THREADS = LINK_WARPS * 32;
  for (int phase = 0; phase < 2; ++phase) {
    if (half < 2) {
      LinkCursor cur = {phase, 0, 0, 0, 0, 0, false};
      LinkJob j;
      // Group g of this CTA's phase goes to half g % 2; link_next yields rows, so skip by groups.
      int group = 0;
      bool more = link_next(p, cur, l, links, parts, j);
      while (more) {
        const LinkJob head = j;
        int rows = 1;
        while ((more = link_next(p, cur, l, links, parts, j)) && !j.first) ++rows;
        if (group++ % 2 != half) continue;
        // One verdict per half and group (the other half may abandon at any time).
        __shared__ int stop[2];
        if (t == 0) {
          // Phase 1: this rank's own column, raised by the compute CTAs.
          stop[half] = head.phase == 1 ? !await_peer(p, READY, head.part, p.rank, epoch)
                                       : *static_cast<volatile int*>(&abandoned);
        }
        fo::named_barrier(3 + half, HALF_THREADS);
        if (stop[half]) break;
        const unsigned long long off = p.residual_full ? p.res_offset : p.out_offset;
        const uint4* from = head.phase == 0 ? p.x + static_cast<long long>(head.row) * vecs
                            : p.residual_full ? p.residual_out + static_cast<long long>(head.row) * vecs
                                              : p.out + static_cast<long long>(head.row) * vecs;
        const long long count = static_cast<long long>(rows) * vecs;
        for (int i = 1; i < (head.phase == 0 ? 2 : p.world); ++i) {
          uint4* to = head.phase == 0
                          ? slot(p, head.q, p.rank) + static_cast<long long>(head.row - slice_start(p, head.q)) * vecs
                          : reinterpret_cast<uint4*>(area(p, (p.rank + i) % p.world, off)) +
                                static_cast<long long>(head.row) * vecs;
          for (long long i0 = t; i0 < count; i0 += static_cast<long long>(HALF_THREADS) * LINK_UNROLL) {
            uint4 v[LINK_UNROLL];
#pragma unroll
            for (int u = 0; u < LINK_UNROLL; ++u) {
              const long long at = i0 + static_cast<long long>(u) * HALF_THREADS;
              if (at < count) v[u] = from[at];
            }
#pragma unroll
            for (int u = 0; u < LINK_UNROLL; ++u) {
              const long long at = i0 + static_cast<long long>(u) * HALF_THREADS;
              if (at < count) to[at] = v[u];
            }
          }
        }
        fo::named_barrier(3 + half, HALF_THREADS);
        if (t == 0) {
          if (head.phase == 0) {
            store_release_sys(flag_at(p, head.q, READY, head.part, p.rank), epoch);
          } else {
            for (int i = 1; i < p.world; ++i) {
              store_release_sys(flag_at(p, (p.rank + i) % p.world, DONE, head.part, p.rank), epoch);
            }
          }
        }
      }
    }
    __syncthreads();  // phase 0 of both halves flagged before phase 1
  }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS + PRODUCER) fo_allreduce_rmsnorm(Params p) {
  extern __shared__ __align__(128) char ring[];
  const int vecs = p.hidden / VEC;
  unsigned* own = header(p, p.rank);
  const unsigned epoch = *reinterpret_cast<volatile unsigned*>(own + EPOCH) + 1;
  // The host launches the ring on 2 CTAs or more; at least one of each role.
  const int links = min(max(p.link_ctas, 1), static_cast<int>(gridDim.x) - 1);
  const int computes = static_cast<int>(gridDim.x) - links;
  const int parts = ring_parts(p, computes);
  if (threadIdx.x == 0) {
    abandoned = 0;
    for (int s = 0; s < MAX_SLOTS; ++s) fo::mbar_init(fo::smem_addr(&full_bars[s]), 1);
    fo::mbar_init_fence();
  }
  __syncthreads();
  if (gridDim.x < 2) {
    if (threadIdx.x == 0) atomicExch(own + ERROR, 1u);  // never launched so: recorded, not hung
  } else if (static_cast<int>(blockIdx.x) >= computes) {
    link_work(p, static_cast<int>(blockIdx.x) - computes, links, parts, vecs, epoch);
  } else {
    compute_work(p, static_cast<int>(blockIdx.x), computes, parts, vecs, ring, epoch);
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
    if (pushes && !pull) push(p, t + 1, vecs);
    if (reduces) {
      ok = wait_all(p, READY, flag_slot(t), epoch);
      if (ok) reduce(p, t, vecs, pull);
    }
    if (ok && t >= 1 && !p.oneshot) {
      ok = wait_all(p, DONE, flag_slot(t - 1), epoch);
      if (ok) gather(p, t - 1, vecs);
    }
    // One-shot raises done once, after its last part: nothing else waits for it.
    const bool dones = reduces && (!p.oneshot || t == stages - 1);
    if (ok && (pushes || dones)) raise(p, pushes ? flag_slot(t + 1) : -1, dones ? flag_slot(t) : -1, epoch);
  }
  // One-shot: the peer's CTA b has read every row this CTA pushed once its
  // last done is up, so this rank's next call may write the slots again.
  if (ok && p.oneshot) ok = wait_all(p, DONE, flag_slot(stages - 1), epoch);

  finish(own);
}
#endif  // FO_RING
