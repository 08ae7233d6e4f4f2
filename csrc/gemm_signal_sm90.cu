// Persistent Hopper GEMM with a signaling epilogue (sm_90a): TMA loads into a
// ring of shared-memory stages guarded by mbarriers, wgmma on two consumer
// warpgroups, one producer warpgroup, register reallocation between them.
//
//   C[M, N] = A[M, K] * B[N, K]^T   (A = activations, B = weight in nn.Linear
//   layout), 16-bit inputs, fp32 accumulation, 16-bit output.
//
// CTA c walks positions c, c + gridDim.x, ... of the tile order; the load
// thread, the consumers and the store warp walk the same sequence, and the
// stage ring runs on across tiles so that the next tile's loads overlap this
// tile's epilogue.
//
// Epilogue: the consumers convert their accumulators into a shared buffer of
// 128 x 128 outputs (swizzled as TMA expects, so the writes are free of bank
// conflicts) and go straight back to the next tile's MMAs; a store warp in the
// producer warpgroup TMA-stores the buffer, waits until the stores are
// complete in global memory and then adds 1 (release, GPU scope) to the
// counter of the tile's wave group. Writing registers directly to global
// memory stalled the consumers ~20% of a K = 1024 tile; this costs them ~2%.
//
// Staged stores (`staged` != 0): tma_c then maps a [num_tiles * 128, BN]
// staging buffer, and the tile at position p goes to its rows p*128..+128, so
// that any run of positions is one contiguous block that a collective can
// take whatever the tile order; fo_unreorder later moves it into C.
//
// Row table (`row_table` non-null, the ReduceScatter layout): position p
// reads x from row row_table[2p] and stores at row row_table[2p+1] of the
// buffer tma_c maps (columns as usual), so the tile grid and the output
// layout can differ from the row-major output's.
//
// Pushed stores (`push_flags` non-null, the "push" backend): tma_peer maps
// the peer's staging slot, so the tile crosses NVLink while the GEMM goes
// on. Without a row table (AllReduce) every box goes to both maps, at the
// same coordinates; with one (ReduceScatter) a negative store row -r - 1
// sends the tile to row r of the peer's slot instead of the local buffer
// (the tiles of the peer's shard); a negative store row -(r | FO_DUAL_STORE)
// - 1 sends it to row r of the peer's slot and also stores it here, at the
// row it loads (an All-to-All band holding rows for both ranks, where the
// send buffer is x's row order). Once a pushed tile's stores are complete
// the peer's ready flag of its group (word push_flags[group *
// PEER_FLAG_STRIDE]) gets a system-scope release add, which the peer's
// reduction waits for. With push_flags null, tma_peer is never touched.
//
// Combined stores (`ready_flags` non-null, the push ReduceScatter on 2
// ranks): the peer pushes its partial of this rank's shard into this rank's
// slot, which tma_recv maps, laid out like the output tma_c maps. A local
// tile (store row >= 0) then waits until its group's ready flag reaches
// ready_counts[group] (every pushed tile of the group landed), TMA-loads the
// peer's partial of its rows into the epilogue buffer, and the consumers add
// it to their fp32 accumulators before rounding: the tile leaves the SM as
// the finished sum, with no reduction pass after the GEMM. The tile order
// puts each group's pushed tiles well before its local ones (on both ranks),
// so the wait is normally over before it starts; a tile waits only for tiles
// that come earlier in the peer's order, and signals its own pushes before
// any wait of its CTA, so the two GEMMs cannot wait on each other. A wait
// longer than timeout_ns (0: forever) sets *timed_out and goes on.
//
// Gathered sums (`gather_row` >= 0, combined stores only: the AllReduce on
// 2 ranks as a combined ReduceScatter and a gather): every combined tile,
// once summed, is also stored into the peer's slot at row gather_row +
// (its output row), and once there the peer's word gather_flags[group *
// PEER_FLAG_STRIDE] gets a system-scope release add, so the peer copies the
// finished rows into its own output without any reduction of its own.
//
// Compile-time constants: FO_BF16 (1: bf16, 0: fp16), FO_BN (128 or 256: the
// tile's N; BM is 128, 64 rows per consumer warpgroup), FO_STAGES, FO_COMBINE
// (1: the combined stores above are compiled in; 0: ready_flags is ignored,
// and the epilogue is exactly the plain one: the combining branch cost the
// plain kernel 3-10% even untaken).
#ifndef FO_COMBINE
#define FO_COMBINE 0
#endif
// Rows a row table names are below this bit (plan::MAX_TABLE_ROWS).
#define FO_DUAL_STORE (1 << 30)
#include "ptx.cuh"
#include "ptx_sm90.cuh"

#ifndef FO_BN
#define FO_BN 128
#endif
#ifndef FO_STAGES
#define FO_STAGES 5
#endif

namespace {

constexpr int BM = 128, BN = FO_BN, BK = 64;  // BK * 2 bytes = one 128-byte swizzle row
constexpr int STAGES = FO_STAGES;
constexpr int THREADS = 384;                  // producer + 2 consumer warpgroups
constexpr int A_STAGE_BYTES = BM * BK * 2, B_STAGE_BYTES = BN * BK * 2;
constexpr int STAGE_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;
constexpr int ACC = BN / 2;                   // fp32 accumulators per consumer thread
// Epilogue buffer: 128 rows x EPI_COLS, as EPI_COLS / 64 TMA boxes of
// 128 rows x 64 columns (one 128-byte swizzle row per tile row).
constexpr int EPI_COLS = 128, EPI_BOXES = EPI_COLS / 64, BOX_BYTES = BM * 64 * 2;
constexpr int EPI_BYTES = BM * EPI_COLS * 2, CHUNKS = BN / EPI_COLS;
// Named barriers between the 256 consumer threads and the 32 of the store warp.
constexpr unsigned BAR_EPI_FULL = 1, BAR_EPI_FREE = 2, EPI_THREADS = 256 + 32;
// Words between two groups' ready flags in a peer buffer (rust/comm/peer.rs:
// one per possible source rank).
constexpr int PEER_FLAG_STRIDE = 8;
static_assert(BN == 128 || BN == 256, "wgmma wrappers exist for N = 128 and 256");

typedef unsigned short elem_t;

__device__ __forceinline__ void mma_k16(float (&acc)[ACC], unsigned long long da, unsigned long long db, int scale_d) {
#if FO_BN == 128
  fo::wgmma_m64n128k16(acc, da, db, scale_d);
#else
  fo::wgmma_m64n256k16(acc, da, db, scale_d);
#endif
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    fo_gemm_signal_sm90(const __grid_constant__ fo::TensorMap tma_a, const __grid_constant__ fo::TensorMap tma_b,
                        const __grid_constant__ fo::TensorMap tma_c, int M, int N, int K, const int* __restrict__ tile_order,
                        const int* __restrict__ tile_group, unsigned* __restrict__ counters, int num_tiles,
                        int staged, const int* __restrict__ row_table,
                        const __grid_constant__ fo::TensorMap tma_peer, unsigned* __restrict__ push_flags,
                        const __grid_constant__ fo::TensorMap tma_recv, const unsigned* __restrict__ ready_flags,
                        const unsigned* __restrict__ ready_counts, unsigned long long timeout_ns,
                        unsigned* __restrict__ timed_out, int gather_row, unsigned* __restrict__ gather_flags) {
  // Stages first (1024-byte aligned, as 128-byte swizzling requires), the
  // epilogue buffer, then the full/empty barrier pair of every stage.
  extern __shared__ __align__(1024) unsigned char smem[];
  const unsigned base = fo::smem_addr(smem);
  const unsigned epi = base + STAGES * STAGE_BYTES;
  const unsigned bars = epi + EPI_BYTES;
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (STAGES + s); };
  auto a_stage = [&](int s) { return base + s * STAGE_BYTES; };
  auto b_stage = [&](int s) { return base + s * STAGE_BYTES + A_STAGE_BYTES; };
  // Completes when a combined chunk's peer partial is in the epilogue buffer.
  const unsigned recv_bar = bars + 16 * STAGES;
  // Whether position p's tile adds the peer's partial before it is stored.
  auto combined = [&](int p) { return FO_COMBINE && ready_flags != nullptr && row_table[2 * p + 1] >= 0; };

  const int warpgroup = threadIdx.x / 128;
  const int tiles_n = (N + BN - 1) / BN;
  const int ktiles = (K + BK - 1) / BK;

  if (threadIdx.x == 0) {
    fo::prefetch_tensor_map(&tma_a);
    fo::prefetch_tensor_map(&tma_b);
    fo::prefetch_tensor_map(&tma_c);
    if (push_flags != nullptr) fo::prefetch_tensor_map(&tma_peer);
    if (FO_COMBINE && ready_flags != nullptr) fo::prefetch_tensor_map(&tma_recv);
    for (int s = 0; s < STAGES; ++s) {
      fo::mbar_init(full(s), 1);   // the producer's arrive; TMA completes the bytes
      fo::mbar_init(empty(s), 8);  // one arrive per consumer warp
    }
    fo::mbar_init(recv_bar, 1);
    fo::mbar_init_fence();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // Producer: one thread issues every load; the rest of the warpgroup idles
    // with few registers so the consumers can have more.
    fo::setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      int stage = 0;
      unsigned phase = 0;
      for (int pos = blockIdx.x; pos < num_tiles; pos += gridDim.x) {
        const int tile = tile_order ? tile_order[pos] : pos;
        const int m0 = row_table ? row_table[2 * pos] : (tile / tiles_n) * BM, n0 = (tile % tiles_n) * BN;
        for (int kt = 0; kt < ktiles; ++kt) {
          // A fresh barrier counts as having completed the phase before its
          // first, so the first pass over the ring does not wait.
          fo::mbar_wait(empty(stage), phase ^ 1);
          fo::mbar_arrive_expect_tx(full(stage), STAGE_BYTES);
          fo::tma_load_2d(a_stage(stage), &tma_a, full(stage), kt * BK, m0);
          fo::tma_load_2d(b_stage(stage), &tma_b, full(stage), kt * BK, n0);
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    } else if (threadIdx.x / 32 == 1) {
      // Store warp: lane 0 issues the TMA stores of each filled buffer.
      const int lane = threadIdx.x % 32;
      int waited = -1;  // the last group whose ready flag this CTA saw complete
      // Lane 0: loads the peer's partial of chunk ch of the (combined) tile
      // at position p into the emptied epilogue buffer, after its group's
      // pushes have all landed.
      auto fetch = [&](int p, int ch) {
        const int group = tile_group[p];
        if (group != waited) {
          const unsigned* flag = ready_flags + group * PEER_FLAG_STRIDE;
          const unsigned expected = ready_counts[group];
          const unsigned long long start = timeout_ns ? fo::now_ns() : 0;
          while (fo::load_acquire_sys(flag) < expected) {
            if (timeout_ns && fo::now_ns() - start > timeout_ns) {
              atomicExch(timed_out, 1u);
              break;
            }
          }
          // The peer's TMA stores, acquired here, are read by TMA next.
          fo::fence_async_global();
          waited = group;
        }
        const int tile = tile_order ? tile_order[p] : p;
        fo::mbar_arrive_expect_tx(recv_bar, EPI_BYTES);
        for (int box = 0; box < EPI_BOXES; ++box)
          fo::tma_load_2d(epi + box * BOX_BYTES, &tma_recv, recv_bar, (tile % tiles_n) * BN + ch * EPI_COLS + box * 64,
                          row_table[2 * p + 1]);
      };
#if FO_COMBINE
      if (lane == 0 && blockIdx.x < num_tiles && combined(blockIdx.x)) fetch(blockIdx.x, 0);
#endif
      for (int pos = blockIdx.x; pos < num_tiles; pos += gridDim.x) {
        const int tile = tile_order ? tile_order[pos] : pos;
        const int stored = staged ? pos * BM : row_table ? row_table[2 * pos + 1] : (tile / tiles_n) * BM;
        const bool pushed = push_flags != nullptr && (row_table == nullptr || stored < 0);
        const bool dual = stored < 0 && (~stored & FO_DUAL_STORE) != 0;
        const bool local = stored >= 0 || dual;
#if FO_COMBINE
        const bool gathered = gather_row >= 0 && combined(pos);
#else
        constexpr bool gathered = false;
#endif
        // m0: the row the tile goes to (the peer's slot row if pushed, else
        // here); local_row: where it is stored here.
        const int m0 = stored >= 0 ? stored : ~stored & (FO_DUAL_STORE - 1);
        const int local_row = dual ? row_table[2 * pos] : m0;
        const int n0 = staged ? 0 : (tile % tiles_n) * BN;
        for (int ch = 0; ch < CHUNKS; ++ch) {
          fo::named_barrier(BAR_EPI_FULL, EPI_THREADS);
          if (lane == 0) {
            if (local)
              for (int box = 0; box < EPI_BOXES; ++box)
                fo::tma_store_2d(&tma_c, epi + box * BOX_BYTES, n0 + ch * EPI_COLS + box * 64, local_row);
            if (pushed)
              for (int box = 0; box < EPI_BOXES; ++box)
                fo::tma_store_2d(&tma_peer, epi + box * BOX_BYTES, n0 + ch * EPI_COLS + box * 64, m0);
            if (gathered)
              for (int box = 0; box < EPI_BOXES; ++box)
                fo::tma_store_2d(&tma_peer, epi + box * BOX_BYTES, n0 + ch * EPI_COLS + box * 64, gather_row + m0);
            fo::bulk_commit();
            fo::bulk_wait_read();
          }
          __syncwarp();
          // The buffer is free as soon as TMA has read it. The consumers wait
          // for it before every fill but their first, so the last free has no
          // taker and is skipped.
          const bool last = pos + gridDim.x >= num_tiles && ch == CHUNKS - 1;
          if (!last) fo::named_arrive(BAR_EPI_FREE, EPI_THREADS);
          if (lane == 0 && ch == CHUNKS - 1 && (counters != nullptr || pushed || gathered)) {
            // The tile's outputs are in global memory before its signal.
            fo::bulk_wait_all();
            fo::fence_async_global();
            if (counters != nullptr) fo::signal_add(counters + tile_group[pos], 1u);
            if (pushed) fo::signal_add_sys(push_flags + tile_group[pos] * PEER_FLAG_STRIDE, 1u);
            if (gathered) fo::signal_add_sys(gather_flags + tile_group[pos] * PEER_FLAG_STRIDE, 1u);
          }
#if FO_COMBINE
          // The next chunk's peer partial, into the buffer just emptied (its
          // consumers wait for it), only after this tile's signals.
          if (lane == 0 && !last) {
            const int next = ch + 1 < CHUNKS ? pos : pos + gridDim.x;
            if (combined(next)) fetch(next, ch + 1 < CHUNKS ? ch + 1 : 0);
          }
#endif
        }
      }
      if (lane == 0) fo::bulk_wait_all();
    }
  } else {
    fo::setmaxnreg_inc<232>();
    const int consumer = warpgroup - 1;  // rows consumer*64 .. +64 of the tile
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    int stage = 0, fills = 0;
    unsigned phase = 0;
    unsigned recv_phase = 0;
    float acc[ACC];
    // The consumers never need the tile's coordinates: the loads and the
    // stores are addressed by the other warps.
    for (int pos = blockIdx.x; pos < num_tiles; pos += gridDim.x) {
      int previous = -1;
      for (int kt = 0; kt < ktiles; ++kt) {
        fo::mbar_wait(full(stage), phase);
        fo::wgmma_fence();
        const unsigned a = a_stage(stage) + consumer * 64 * (BK * 2);
        const unsigned b = b_stage(stage);
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
          // A k16 step is 32 bytes into each swizzled 128-byte row.
          mma_k16(acc, fo::sw128_desc(a + kk * 32), fo::sw128_desc(b + kk * 32), (kt > 0 || kk > 0) ? 1 : 0);
        }
        fo::wgmma_commit();
        // Keep this k-tile's wgmmas in flight; the previous k-tile's are done,
        // so its stage goes back to the producer.
        fo::wgmma_wait<1>();
        if (previous >= 0) {
          __syncwarp();
          if (lane == 0) fo::mbar_arrive(empty(previous));
        }
        previous = stage;
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
      fo::wgmma_wait<0>();
      __syncwarp();
      if (lane == 0) fo::mbar_arrive(empty(previous));

      // wgmma m64nN accumulator layout: for each 8-column block j, registers
      // 4j, 4j+1 hold (row g, cols 2t, 2t+1) and 4j+2, 4j+3 the same at row g+8,
      // with g = lane / 4, t = lane % 4, rows offset by 16 per warp. In the
      // 128-byte swizzle a row's 16-byte unit u sits at u ^ (row % 8), and
      // row % 8 == g here.
      const int g = lane / 4, t = lane % 4;
      const bool combine = combined(pos);
#pragma unroll
      for (int ch = 0; ch < CHUNKS; ++ch) {
        if (fills++ > 0) fo::named_barrier(BAR_EPI_FREE, EPI_THREADS);
#if FO_COMBINE
        if (combine) {
          // The buffer holds the peer's partial, in the layout written below.
          fo::mbar_wait(recv_bar, recv_phase);
          recv_phase ^= 1;
        }
#endif
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = consumer * 64 + warp * 16 + g + h * 8;
#pragma unroll
          for (int j = 0; j < EPI_COLS / 8; ++j) {
            const int a = ch * (EPI_COLS / 8) + j;
            const unsigned dst = epi + (j / 8) * BOX_BYTES + row * 128 + (((j % 8) ^ g) * 16) + 4 * t;
            float lo = acc[4 * a + 2 * h], hi = acc[4 * a + 2 * h + 1];
#if FO_COMBINE
            if (combine) {
              const unsigned peer = fo::ld_shared_u32(dst);
              lo += fo::low(peer);
              hi += fo::high(peer);
            }
#endif
            fo::st_shared_u32(dst, fo::pack2(lo, hi));
          }
        }
        fo::fence_async_shared();
        fo::named_arrive(BAR_EPI_FULL, EPI_THREADS);
      }
    }
  }
}
