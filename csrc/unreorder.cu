// Moves staged tiles into the row-major output: the tile at position p of
// the tile order sits in rows p*FO_BM..+FO_BM of a [tiles * FO_BM, FO_BN]
// staging buffer (the GEMM's staged stores); positions first..last-1 go to
// their tiles' places in C[M, N], rows and columns past M and N dropped.
//
// The swizzled schedules need it: their wave groups are runs of positions in
// an order that is not row-band by row-band, so a group's outputs are not
// one contiguous block of C, but are one in the staging buffer, where the
// collective runs. It is a pure copy, 16 bytes per access, on the few SMs the
// GEMM leaves to the communication, so each block keeps 128 KiB of loads in
// flight (1024 threads x 8 vectors): with 16 KiB a block moved ~16 GB/s.
#ifndef FO_BM
#define FO_BM 128
#endif
#ifndef FO_BN
#define FO_BN 128
#endif

namespace {
constexpr int VEC = 8;                            // 16-bit elements per 16-byte access
constexpr int ROW_VECS = FO_BN / VEC;             // accesses per staged tile row
constexpr int TILE_VECS = FO_BM * ROW_VECS;       // accesses per staged tile
constexpr int UNROLL = 8;                         // loads in flight per thread
}  // namespace

extern "C" __global__ void __launch_bounds__(1024)
    fo_unreorder(uint4* __restrict__ C, const uint4* __restrict__ staging, const int* __restrict__ tile_order, int M, int N,
                 int first, int last) {
  const int tiles_n = (N + FO_BN - 1) / FO_BN;
  const long long n_vecs = N / VEC;
  const long long total = (long long)(last - first) * TILE_VECS;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const uint4* src = staging + (long long)first * TILE_VECS;
  for (long long base = (long long)blockIdx.x * blockDim.x + threadIdx.x; base < total; base += stride * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long i = base + u * stride;
      if (i < total) v[u] = __ldg(src + i);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long i = base + u * stride;
      if (i >= total) continue;
      const int pos = first + (int)(i / TILE_VECS);
      const int in_tile = (int)(i % TILE_VECS);
      const int tile = tile_order ? tile_order[pos] : pos;
      const int row = (tile / tiles_n) * FO_BM + in_tile / ROW_VECS;
      const int col_vec = (tile % tiles_n) * ROW_VECS + in_tile % ROW_VECS;
      if (row < M && col_vec < n_vecs) C[row * n_vecs + col_vec] = v[u];
    }
  }
}
