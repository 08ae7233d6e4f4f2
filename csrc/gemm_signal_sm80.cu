// Persistent GEMM with a signaling epilogue, for sm_80 and newer (mma.sync).
//
//   C[M, N] = A[M, K] * B[N, K]^T   (A = activations, B = weight in nn.Linear
//   layout), 16-bit inputs, fp32 accumulation, 16-bit output.
//
// The grid is the number of CTAs the plan gives the GEMM. CTA c walks the
// positions c, c + gridDim.x, ... of `tile_order` (so position p finishes in
// wave p / gridDim.x). After a tile is stored, one thread adds 1 to the
// counter of the tile's wave group; the communication stream waits for that
// counter to reach the group's tile count.
//
// Compile-time constants: FO_BF16 (1: bf16, 0: fp16), FO_BK (32 or 64: the
// K depth of one pipeline stage), FO_STAGES (shared-memory ring depth).
#include "ptx.cuh"

#ifndef FO_BK
#define FO_BK 32
#endif
#ifndef FO_STAGES
#define FO_STAGES 4
#endif

namespace {

constexpr int BM = 128, BN = 128, BK = FO_BK;
constexpr int STAGES = FO_STAGES;
constexpr int THREADS = 256;         // 8 warps: 2 along M x 4 along N
constexpr int WM = 64, WN = 32;      // warp tile
constexpr int MI = WM / 16, NI = WN / 8;
constexpr int CHUNKS_PER_ROW = BK / 8;  // 16-byte chunks in one row of a stage
constexpr int A_STAGE_BYTES = BM * BK * 2, B_STAGE_BYTES = BN * BK * 2;
constexpr int STAGE_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;
static_assert(CHUNKS_PER_ROW == 4 || CHUNKS_PER_ROW == 8, "swizzle below handles 64- and 128-byte rows");

// The 8 rows one ldmatrix reads must land in 8 different 16-byte bank
// groups. 128-byte rows: XOR the chunk with the row's low 3 bits. 64-byte
// rows: two rows share a 128-byte line, so XOR with bits 1..2 instead.
__device__ __forceinline__ int swizzled(int row, int chunk) {
  const int phys = CHUNKS_PER_ROW == 8 ? (chunk ^ (row & 7)) : (chunk ^ ((row >> 1) & 3));
  return row * (BK * 2) + (phys << 4);
}

typedef unsigned short elem_t;  // raw 16-bit storage; the math is in PTX

// One BK slice of a (rows x K) row-major operand into a stage; rows past
// `rows_valid` and columns past K are zero-filled.
template <int ROWS>
__device__ __forceinline__ void load_slice(unsigned stage, const elem_t* base, long long ld, int row0,
                                           int rows_valid, int k0, int K) {
#pragma unroll
  for (int i = 0; i < ROWS * CHUNKS_PER_ROW / THREADS; ++i) {
    const int id = threadIdx.x + i * THREADS;
    const int row = id / CHUNKS_PER_ROW, chunk = id % CHUNKS_PER_ROW;
    const int k = k0 + chunk * 8;
    const bool valid = (row0 + row < rows_valid) && (k < K);
    const elem_t* src = valid ? base + (long long)(row0 + row) * ld + k : base;
    fo::cp_async_16(stage + swizzled(row, chunk), src, valid ? 16 : 0);
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    fo_gemm_signal(const elem_t* __restrict__ A, const elem_t* __restrict__ B, elem_t* __restrict__ C, int M,
                   int N, int K, const int* __restrict__ tile_order, const int* __restrict__ tile_group,
                   unsigned* __restrict__ counters, int num_tiles, int staged, const int* __restrict__ row_table) {
  extern __shared__ __align__(128) unsigned char smem[];
  const unsigned smem_base = fo::smem_addr(smem);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int wm = warp / (BN / WN), wn = warp % (BN / WN);
  const int tiles_n = (N + BN - 1) / BN;
  const int ktiles = (K + BK - 1) / BK;

  for (int pos = blockIdx.x; pos < num_tiles; pos += gridDim.x) {
    const int tile = tile_order ? tile_order[pos] : pos;
    // Row table (see the sm90 kernel): the rows read and the rows written.
    const int m0 = row_table ? row_table[2 * pos] : (tile / tiles_n) * BM, n0 = (tile % tiles_n) * BN;

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    auto load_stage = [&](int kt) {
      const unsigned stage = smem_base + (kt % STAGES) * STAGE_BYTES;
      load_slice<BM>(stage, A, K, m0, M, kt * BK, K);
      load_slice<BN>(stage + A_STAGE_BYTES, B, K, n0, N, kt * BK, K);
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < ktiles) load_stage(s);
      fo::cp_async_commit();
    }

    for (int kt = 0; kt < ktiles; ++kt) {
      fo::cp_async_wait<STAGES - 2>();
      // Also guarantees every warp is done reading the stage refilled below.
      __syncthreads();
      if (kt + STAGES - 1 < ktiles) load_stage(kt + STAGES - 1);
      fo::cp_async_commit();

      const unsigned a_stage = smem_base + (kt % STAGES) * STAGE_BYTES;
      const unsigned b_stage = a_stage + A_STAGE_BYTES;
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        unsigned a[MI][4], b[NI][2];
#pragma unroll
        for (int i = 0; i < MI; ++i)
          fo::ldmatrix_x4(a[i], a_stage + swizzled(wm * WM + i * 16 + lane % 16, kk * 2 + lane / 16));
#pragma unroll
        for (int j = 0; j < NI / 2; ++j) {
          unsigned r[4];
          fo::ldmatrix_x4(r, b_stage + swizzled(wn * WN + j * 16 + lane % 8 + (lane / 16) * 8,
                                                kk * 2 + (lane / 8) % 2));
          b[2 * j][0] = r[0];
          b[2 * j][1] = r[1];
          b[2 * j + 1][0] = r[2];
          b[2 * j + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int j = 0; j < NI; ++j) fo::mma_16816(acc[i][j], a[i], b[j]);
      }
    }
    fo::cp_async_wait<0>();

    // mma.m16n8 accumulator layout: c0,c1 at (g, 2t..2t+1), c2,c3 at (g+8, ...).
    // Staged: the whole tile, tails included, to rows pos*BM.. of a
    // [num_tiles * BM, BN] buffer (see the sm90 kernel).
    const int g = lane / 4, t = lane % 4;
    const int row0 = staged ? pos * BM : row_table ? row_table[2 * pos + 1] : m0, col0 = staged ? 0 : n0;
    const int rows = (staged || row_table) ? 0x7fffffff : M, cols = staged ? BN : N;
    const long long ld = staged ? BN : N;
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + wm * WM + i * 16 + g + h * 8;
        if (row >= rows) continue;
        elem_t* crow = C + (long long)row * ld;
#pragma unroll
        for (int j = 0; j < NI; ++j) {
          const int col = col0 + wn * WN + j * 8 + 2 * t;
          // N is a multiple of 8 and col is even, so col < N covers col + 1.
          if (col < cols) *reinterpret_cast<unsigned*>(crow + col) = fo::pack2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
        }
      }
    }

    // Every store of this tile happens before the signal, and no warp starts
    // refilling shared memory for the next tile while another still reads it.
    __syncthreads();
    if (counters != nullptr && threadIdx.x == 0) fo::signal_add(counters + tile_group[pos], 1u);
  }
}
