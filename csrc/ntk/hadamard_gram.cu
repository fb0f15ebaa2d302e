#include <algorithm>
#include <type_traits>

#include "common/launch.cuh"
#include "common/launch_config.h"
#include "common/vector_io.cuh"
#include "ntk/hadamard_gram.h"

namespace ncdp {
namespace kernels {
namespace {

// ---------------------------------------------------------------------------
// Sizing constants.

// A block is 16 x 16 threads over a square output tile; each thread owns a
// micro-tile of kMicro x kMicro outputs made of runs of 4 consecutive rows
// (columns) spaced 64 apart, so a run is one 16-byte shared-memory read, the
// column runs of a warp's 16 threads are contiguous (conflict-free) and its row
// runs are broadcasts.
constexpr int kGramSide = 16;
constexpr int kGramRun = 4;
constexpr int kGramHalf = kGramSide * kGramRun;
static_assert(kGramSide * kGramSide == kBlockThreads, "16 x 16 threads");

// The contraction is staged through shared memory 8 columns at a time, double
// buffered: the next slice's global loads are in flight while the current one
// is multiplied, and one barrier per slice suffices.
constexpr int kGramDepth = 8;
// Rows of a slice that one pass of the block loads (thread t: column t % 8 of
// row t / 8, so a warp reads 8 contiguous elements of each of 4 rows).
constexpr int kGramRowsPerPass = kBlockThreads / kGramDepth;
// Slices are stored k-major (transposed). The pad keeps rows 16-byte aligned and
// shifts successive k rows by 4 elements, which spreads the transposing stores
// of a warp (8 k x 4 rows) over all 32 banks (conflict-free for float, the
// unavoidable two wavefronts for double).
constexpr int kGramPad = 4;

// Tiles are numbered in groups of 8 tile rows walked column by column: the
// blocks resident at one time then share a few row and column panels of the
// factors through L2 instead of each streaming its own from DRAM.
constexpr std::int64_t kGramGroupRows = 8;

template <typename Acc>
struct GramShape {
  static constexpr bool kDouble = std::is_same<Acc, double>::value;
  static constexpr int kTile = static_cast<int>(hadamard_gram_tile(kDouble));
  static constexpr int kMicro = kTile / kGramSide;
  static constexpr int kLoads = kTile / kGramRowsPerPass;
  static_assert(kMicro % kGramRun == 0 && kMicro / kGramRun * kGramHalf == kTile,
                "runs of 4 spaced 64 apart cover the tile");
};

template <typename Real, int kTile>
struct GramSlices {
  alignas(16) Real x[2][kGramDepth][kTile + kGramPad];  // rows of the i side
  alignas(16) Real y[2][kGramDepth][kTile + kGramPad];  // rows of the j side
};

template <typename Real>
struct GramTermList {
  GramTerm<Real> term[kMaxGramTermsPerLaunch];
  int count;
};

// Offset in the tile of entry m of a thread's micro-tile side, for thread
// coordinate t (ty for rows, tx for columns).
__device__ __forceinline__ int micro_offset(int m, int t) {
  return (m / kGramRun) * kGramHalf + t * kGramRun + m % kGramRun;
}

// Four consecutive staged values, widened to the accumulator type.
template <typename Acc, typename Real>
__device__ __forceinline__ void load_run(const Real* __restrict__ src, Acc* __restrict__ dst) {
  Real v[kGramRun];
  load4_aligned(src, v);
#pragma unroll
  for (int e = 0; e < kGramRun; ++e) dst[e] = static_cast<Acc>(v[e]);
}

// This thread's share of slice [k, k + 8) of rows row0 .. of src: column k (the
// caller adds its own column), rows row, row + 32, ...; zero past the matrix.
template <typename Real, int kLoads>
__device__ __forceinline__ void load_slice(const Real* __restrict__ src,  // [rows, width]
                                           std::int64_t rows, std::int64_t width,
                                           std::int64_t row, std::int64_t k,
                                           Real (&stage)[kLoads]) {
#pragma unroll
  for (int e = 0; e < kLoads; ++e) {
    const std::int64_t r = row + static_cast<std::int64_t>(e) * kGramRowsPerPass;
    stage[e] = (r < rows && k < width) ? src[r * width + k] : Real(0);
  }
}

// prod[m][c] = sum_{k < width} x[i0 + row m, k] * y[j0 + column c, k] for this
// thread's micro-tile, in Acc, k in increasing slices. Every thread of the
// block must call it with the same arguments (it synchronizes the block), and
// it leaves the slices free for the next call.
template <typename Real, typename Acc>
__device__ __forceinline__ void tile_product(
    const Real* __restrict__ x,  // [rows_x, width]
    const Real* __restrict__ y,  // [rows_y, width]
    std::int64_t rows_x, std::int64_t rows_y, std::int64_t width, std::int64_t i0,
    std::int64_t j0, GramSlices<Real, GramShape<Acc>::kTile>& slices,
    Acc (&prod)[GramShape<Acc>::kMicro][GramShape<Acc>::kMicro]) {
  constexpr int kMicro = GramShape<Acc>::kMicro;
  constexpr int kLoads = GramShape<Acc>::kLoads;
#pragma unroll
  for (int m = 0; m < kMicro; ++m) {
#pragma unroll
    for (int c = 0; c < kMicro; ++c) prod[m][c] = Acc(0);
  }
  if (width <= 0) return;

  const int tx = static_cast<int>(threadIdx.x) % kGramSide;
  const int ty = static_cast<int>(threadIdx.x) / kGramSide;
  const int load_k = static_cast<int>(threadIdx.x) % kGramDepth;
  const int load_row = static_cast<int>(threadIdx.x) / kGramDepth;

  Real stage_x[kLoads];
  Real stage_y[kLoads];
  load_slice(x, rows_x, width, i0 + load_row, load_k, stage_x);
  load_slice(y, rows_y, width, j0 + load_row, load_k, stage_y);
#pragma unroll
  for (int e = 0; e < kLoads; ++e) {
    slices.x[0][load_k][load_row + e * kGramRowsPerPass] = stage_x[e];
    slices.y[0][load_k][load_row + e * kGramRowsPerPass] = stage_y[e];
  }
  __syncthreads();

  int buf = 0;
  for (std::int64_t k0 = 0; k0 < width; k0 += kGramDepth) {
    const bool more = k0 + kGramDepth < width;
    if (more) {
      load_slice(x, rows_x, width, i0 + load_row, k0 + kGramDepth + load_k, stage_x);
      load_slice(y, rows_y, width, j0 + load_row, k0 + kGramDepth + load_k, stage_y);
    }
#pragma unroll
    for (int kk = 0; kk < kGramDepth; ++kk) {
      Acc xv[kMicro];
      Acc yv[kMicro];
#pragma unroll
      for (int g = 0; g < kMicro / kGramRun; ++g) {
        load_run(&slices.x[buf][kk][g * kGramHalf + ty * kGramRun], xv + g * kGramRun);
        load_run(&slices.y[buf][kk][g * kGramHalf + tx * kGramRun], yv + g * kGramRun);
      }
#pragma unroll
      for (int m = 0; m < kMicro; ++m) {
#pragma unroll
        for (int c = 0; c < kMicro; ++c) prod[m][c] += xv[m] * yv[c];
      }
    }
    // The other buffer was last read before the previous barrier.
    if (more) {
#pragma unroll
      for (int e = 0; e < kLoads; ++e) {
        slices.x[buf ^ 1][load_k][load_row + e * kGramRowsPerPass] = stage_x[e];
        slices.y[buf ^ 1][load_k][load_row + e * kGramRowsPerPass] = stage_y[e];
      }
    }
    __syncthreads();
    buf ^= 1;
  }
}

struct GramTileCoord {
  std::int64_t ti;
  std::int64_t tj;
};

// Tiles of the upper triangle of a t x t tile grid in tile rows 0 .. r - 1.
__device__ __forceinline__ std::int64_t upper_tiles_before_row(std::int64_t r, std::int64_t t) {
  return r * t - r * (r - 1) / 2;
}

// Tile (ti, tj) of block `block`: groups of kGramGroupRows tile rows, each
// walked column by column (in a group, column tj holds its rows ti <= tj when
// symmetric, all of them otherwise).
__device__ __forceinline__ GramTileCoord gram_tile_coord(std::int64_t block, std::int64_t tiles_i,
                                                         std::int64_t tiles_j, bool symmetric) {
  constexpr std::int64_t kG = kGramGroupRows;
  if (!symmetric) {
    const std::int64_t r0 = block / (kG * tiles_j) * kG;
    const std::int64_t h = std::min(kG, tiles_i - r0);
    const std::int64_t q = block - r0 * tiles_j;
    return GramTileCoord{r0 + q % h, q / h};
  }
  const std::int64_t t = tiles_i;
  // The last group that starts at or before `block` (binary search: the group
  // count can reach the thousands).
  std::int64_t lo = 0;
  std::int64_t hi = (t - 1) / kG;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi + 1) / 2;
    if (upper_tiles_before_row(mid * kG, t) <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const std::int64_t r0 = lo * kG;
  const std::int64_t h = std::min(kG, t - r0);
  std::int64_t q = block - upper_tiles_before_row(r0, t);
  // The group's first h columns hold a triangle (column r0 + c: c + 1 tiles),
  // every later column h tiles.
  const std::int64_t triangle = h * (h + 1) / 2;
  if (q < triangle) {
    std::int64_t c = 0;
    while ((c + 1) * (c + 2) / 2 <= q) ++c;
    return GramTileCoord{r0 + q - c * (c + 1) / 2, r0 + c};
  }
  q -= triangle;
  return GramTileCoord{r0 + q % h, r0 + h + q / h};
}

// One block per output tile: for each term, the B-tile product Q and (unless
// the term's F is the constant 1) the F-tile product P are formed in registers
// and acc += P o Q; acc is written once at the end. With `symmetric` only tiles
// ti <= tj exist and every entry is also written to its mirror; the diagonal
// tile writes its entries i <= j only and mirrors them, so K's symmetry never
// rests on two threads' sums rounding alike. With `accumulate` acc starts from
// out.
//
// Three micro-tiles (the sum and a term's two factors) are live at once: 192
// registers with float's 8 x 8, 96 with double's 4 x 4. The bounds allow one
// block per SM so the compiler may use up to 255 registers; capped at 128 (two
// blocks per SM) ptxas spills inside the contraction loop.
template <typename Real, typename Acc, typename Out>
__global__ void __launch_bounds__(kBlockThreads, 1)
    hadamard_gram_tile_kernel(const __grid_constant__ GramTermList<Real> terms, std::int64_t n,
                              std::int64_t n2, std::int64_t tiles_i, std::int64_t tiles_j,
                              bool symmetric, bool accumulate,
                              Out* __restrict__ out) {  // [n, n2]
  constexpr int kTile = GramShape<Acc>::kTile;
  constexpr int kMicro = GramShape<Acc>::kMicro;
  __shared__ GramSlices<Real, kTile> slices;

  const GramTileCoord tile = gram_tile_coord(blockIdx.x, tiles_i, tiles_j, symmetric);
  const std::int64_t i0 = tile.ti * kTile;
  const std::int64_t j0 = tile.tj * kTile;
  const bool diagonal = symmetric && tile.ti == tile.tj;
  const int tx = static_cast<int>(threadIdx.x) % kGramSide;
  const int ty = static_cast<int>(threadIdx.x) / kGramSide;

  Acc acc[kMicro][kMicro];
#pragma unroll
  for (int m = 0; m < kMicro; ++m) {
    const std::int64_t i = i0 + micro_offset(m, ty);
#pragma unroll
    for (int c = 0; c < kMicro; ++c) {
      const std::int64_t j = j0 + micro_offset(c, tx);
      const bool owned = i < n && j < n2 && !(diagonal && j < i);
      acc[m][c] = (accumulate && owned) ? static_cast<Acc>(out[i * n2 + j]) : Acc(0);
    }
  }

  for (int l = 0; l < terms.count; ++l) {
    const GramTerm<Real>& term = terms.term[l];
    Acc q[kMicro][kMicro];
    tile_product<Real, Acc>(term.b, term.b2, n, n2, term.b_width, i0, j0, slices, q);
    if (term.f == nullptr) {
#pragma unroll
      for (int m = 0; m < kMicro; ++m) {
#pragma unroll
        for (int c = 0; c < kMicro; ++c) acc[m][c] += q[m][c];
      }
      continue;
    }
    Acc p[kMicro][kMicro];
    tile_product<Real, Acc>(term.f, term.f2, n, n2, term.a, i0, j0, slices, p);
#pragma unroll
    for (int m = 0; m < kMicro; ++m) {
#pragma unroll
      for (int c = 0; c < kMicro; ++c) acc[m][c] += p[m][c] * q[m][c];
    }
  }

#pragma unroll
  for (int m = 0; m < kMicro; ++m) {
    const std::int64_t i = i0 + micro_offset(m, ty);
    if (i >= n) continue;
#pragma unroll
    for (int c = 0; c < kMicro; ++c) {
      const std::int64_t j = j0 + micro_offset(c, tx);
      if (j >= n2 || (diagonal && j < i)) continue;
      const Out value = static_cast<Out>(acc[m][c]);
      out[i * n2 + j] = value;
      if (symmetric && j != i) out[j * n2 + i] = value;
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Launcher.

template <typename Real, typename Acc, typename Out>
void launch_hadamard_gram(const GramTerm<Real>* terms, std::int64_t count, std::int64_t n,
                          std::int64_t n2, bool symmetric, Out* out, cudaStream_t stream) {
  if (n <= 0 || n2 <= 0) return;
  constexpr int kTile = GramShape<Acc>::kTile;
  const std::int64_t tiles_i = ceil_div(n, kTile);
  const std::int64_t tiles_j = ceil_div(n2, kTile);
  const std::int64_t blocks = symmetric ? tiles_i * (tiles_i + 1) / 2 : tiles_i * tiles_j;
  // One launch even without terms: it writes the zeros of an empty sum.
  std::int64_t begin = 0;
  do {
    GramTermList<Real> list{};
    list.count = static_cast<int>(std::min(count - begin, kMaxGramTermsPerLaunch));
    std::copy(terms + begin, terms + begin + list.count, list.term);
    NCDP_LAUNCH(static_cast<unsigned int>(blocks), kBlockThreads, 0, stream,
        hadamard_gram_tile_kernel<Real, Acc, Out>)(
            list, n, n2, tiles_i, tiles_j, symmetric, /*accumulate=*/begin > 0, out);
    begin += list.count;
  } while (begin < count);
}

// ---------------------------------------------------------------------------
// Instantiations: float inputs accumulate in float or double, double inputs in
// double; either may be written as float or double.

#define NCDP_INSTANTIATE_GRAM(Real, Acc, Out)                                                  \
  template void launch_hadamard_gram<Real, Acc, Out>(const GramTerm<Real>*, std::int64_t,      \
                                                     std::int64_t, std::int64_t, bool, Out*,   \
                                                     cudaStream_t);

NCDP_INSTANTIATE_GRAM(float, float, float)
NCDP_INSTANTIATE_GRAM(float, float, double)
NCDP_INSTANTIATE_GRAM(float, double, float)
NCDP_INSTANTIATE_GRAM(float, double, double)
NCDP_INSTANTIATE_GRAM(double, double, float)
NCDP_INSTANTIATE_GRAM(double, double, double)
#undef NCDP_INSTANTIATE_GRAM

}  // namespace kernels
}  // namespace ncdp
