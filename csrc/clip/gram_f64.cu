// Float64 Gram matrices of float32 rows, W_i = X_i X_i^T per sample (clip
// family: the per-sample norms' Gram route). The vendor's float64 GEMM needs
// float64 operands, so that route first wrote float64 copies of a and g and
// read them back (by bench/device_model.py 2.6 ms of a 63 ms BERT-base step
// on an H200). Here the float32 rows are read once into shared memory, widened
// there (exactly), and multiplied on the FP64 tensor cores (common/mma_f64.cuh);
// only the upper triangle of 64 x 64 output tiles is formed, each off-diagonal
// tile written to both of its places.
//
// A launch of few (sample, tile) jobs splits each job's d values into k-ranges
// (gram_rows_f64_splits): the H200 profile of 2026-11-30 measured BERT-base's
// launches at 96 jobs (one block on 96 of 132 SMs, 16.8 TFLOP/s) and GPT-2's
// tied head (d = 50257) at 12 jobs a launch, 10.5 ms for 20 GFLOP. Each range
// writes its own partial Grams and a second kernel adds them in range order:
// a fixed order, no atomics, and every entry still a float64 sum of the d
// exact products (within gamma_d in any order).
#include <algorithm>

#include "clip/clip_noise.h"
#include "common/launch.cuh"
#include "common/launch_config.h"
#include "common/mma_f64.cuh"

namespace ncdp {
namespace kernels {
namespace {

constexpr int kGramTile = 64;     // output tile edge (positions)
constexpr int kGramDepth = 16;    // values of a row staged per step
// Row stride of the staged tiles in doubles: lane (g, q) of a fragment load
// reads element (g, q) of an 8 x 4 block, in 4-byte bank 2 (S g + q) mod 32.
// At S = 16 all eight g share a bank (eight passes); at 20 only g and g + 4
// do, and a warp's 256 bytes take two passes anyway.
constexpr int kGramStride = kGramDepth + 4;
constexpr int kGramThreads = kBlockThreads;
// Three blocks an SM (at most 85 registers a thread on sm_90): the warp
// skip below otherwise let ptxas take 128 and two blocks.
constexpr int kGramBlocksPerSm = 3;
// The shortest k-range a split launch gives a block (gram_rows_f64_split),
// and the longest any launch does (its count of values an int).
constexpr std::int64_t kGramMinSplitDepth = 16 * kGramDepth;
constexpr std::int64_t kGramMaxRangeDepth = std::int64_t{1} << 30;
// Each thread stages kGramLoads values of each tile a step.
constexpr int kGramLoads = kGramTile * kGramDepth / kGramThreads;
static_assert(kGramLoads * kGramThreads == kGramTile * kGramDepth, "staging covers the tile");

// Warps of a block: 2 x 4 over the 64 x 64 tile, 32 rows x 16 columns each,
// 4 x 2 fragments of 8 x 8, rows in pairs: a pair's two fragments are one
// m16n8k4 product (common/mma_f64.cuh).
constexpr int kWarpRows = 32;
constexpr int kWarpCols = 16;
constexpr int kFragRows = kWarpRows / 8;
constexpr int kFragCols = kWarpCols / 8;
constexpr int kFragPairs = kFragRows / 2;
static_assert(kFragPairs * 2 == kFragRows, "row fragments pair into m16n8k4 products");

// sm_90's m16n8k4 products keep their accumulators in place only in a loop
// that is not unrolled: unrolled, ptxas renamed them (124 registers, 140
// bytes spilled at the 85 of 3 blocks an SM); the other warps of the SM hide
// the fragment loads' latency instead. The m8n8k4 loop stays unrolled.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(NCDP_CPU_EMULATION)
#define NCDP_GRAM_STEP_UNROLL _Pragma("unroll 1")
#else
#define NCDP_GRAM_STEP_UNROLL _Pragma("unroll")
#endif

// The (ti, tj) tile, ti <= tj, of triangle index t: row ti holds tiles
// ti..nt-1, so rows before ti hold ti nt - ti (ti - 1) / 2 of them.
__device__ __forceinline__ void triangle_tile(std::int64_t t, std::int64_t nt, std::int64_t* ti,
                                              std::int64_t* tj) {
  std::int64_t i = 0;
  while (t >= nt - i) {
    t -= nt - i;
    ++i;
  }
  *ti = i;
  *tj = i + t;
}

// Thread tid stages value tid % kGramDepth of rows tid / kGramDepth + 16 l,
// l < kGramLoads, of a tile: consecutive threads read consecutive values of a
// row. `row` points at the first of them (row r0 + tid / kGramDepth, value tid
// % kGramDepth); rows past T and values past d read as zeros.
static_assert(kGramThreads % kGramDepth == 0, "a thread keeps one value column");
constexpr int kGramRowsPerPass = kGramThreads / kGramDepth;

__device__ __forceinline__ void load_step(const float* __restrict__ row,
                                          std::int64_t row_stride, int rows_left,
                                          bool value_in, float v[kGramLoads]) {
#pragma unroll
  for (int l = 0; l < kGramLoads; ++l) {
    v[l] = (value_in && kGramRowsPerPass * l < rows_left) ? row[kGramRowsPerPass * l * row_stride]
                                                          : 0.0f;
  }
}

__device__ __forceinline__ void store_step(const float v[kGramLoads],
                                           double (*tile)[kGramStride]) {
  const int r = static_cast<int>(threadIdx.x) / kGramDepth;
  const int k = static_cast<int>(threadIdx.x) % kGramDepth;
#pragma unroll
  for (int l = 0; l < kGramLoads; ++l) tile[r + kGramRowsPerPass * l][k] = static_cast<double>(v[l]);
}

// One block per (k-range, sample, upper-triangle tile): the tile's float64
// sums of products over the range's values of each pair of rows, the next
// step's values loaded into registers while this step's are multiplied.
__global__ void __launch_bounds__(kGramThreads, kGramBlocksPerSm) gram_rows_f64_kernel(
    const GramSources src, std::int64_t n, std::int64_t T, std::int64_t d,
    std::int64_t tiles,  // upper-triangle tiles a sample: nt (nt + 1) / 2
    std::int64_t split_depth,  // values a k-range (the last: the rest)
    std::int64_t total,        // jobs: k-ranges x count n x tiles
    double* __restrict__ out) {  // [ranges, count n, T, T]: range r's partial Grams at r count n T T
  __shared__ double rows_i[kGramTile][kGramStride];
  __shared__ double rows_j[kGramTile][kGramStride];
  const std::int64_t nt = (T + kGramTile - 1) / kGramTile;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, q = lane % 4;
  const int wr = (warp / 4) * kWarpRows, wc = (warp % 4) * kWarpCols;
  for (std::int64_t job = blockIdx.x; job < total; job += gridDim.x) {
    // Range r's Gram of sample i of source s is out's r count n + s n + i.
    const std::int64_t gram = job / tiles;
    const std::int64_t grams = static_cast<std::int64_t>(src.count) * n;
    const std::int64_t range = gram / grams;
    const std::int64_t sample = gram - range * grams;  // over all sources: source s holds n
    const int s = static_cast<int>(sample / n);
    std::int64_t ti, tj;
    triangle_tile(job % tiles, nt, &ti, &tj);
    const bool diagonal = ti == tj;
    const std::int64_t k_begin = range * split_depth;
    // At most kGramMaxRangeDepth (gram_rows_f64_split): a 32-bit count keeps
    // the products' loop within the 80 registers of 3 blocks an SM.
    const int depth = static_cast<int>(std::min(split_depth, d - k_begin));
    const float* x = src.x[s] + (sample % n) * src.sample_stride[s] + k_begin;
    const std::int64_t row_stride = src.row_stride[s];
    const std::int64_t ri = ti * kGramTile, rj = tj * kGramTile;
    // acc[p][c]: the 16 x 8 fragment of row pair p, column c (mma_f64_16x8x4's d0..d3).
    double acc[kFragPairs][kFragCols][4];
#pragma unroll
    for (int p = 0; p < kFragPairs; ++p) {
#pragma unroll
      for (int c = 0; c < kFragCols; ++c) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[p][c][e] = 0.0;
      }
    }
    // This thread's staged rows and value column (see load_step).
    const int r_own = static_cast<int>(threadIdx.x) / kGramDepth;
    const int k_own = static_cast<int>(threadIdx.x) % kGramDepth;
    const int left_i = static_cast<int>(std::min<std::int64_t>(T - ri, kGramTile)) - r_own;
    const int left_j = static_cast<int>(std::min<std::int64_t>(T - rj, kGramTile)) - r_own;
    const float* pi = x + (ri + r_own) * row_stride + k_own;
    const float* pj = x + (rj + r_own) * row_stride + k_own;
    float vi[kGramLoads], vj[kGramLoads];
    load_step(pi, row_stride, left_i, k_own < depth, vi);
    if (!diagonal) load_step(pj, row_stride, left_j, k_own < depth, vj);
    // A diagonal tile multiplies its rows by themselves: one staged copy.
    double (*cols)[kGramStride] = diagonal ? rows_i : rows_j;
    // A warp whose rows or columns all lie past T holds only the staged
    // zeros' products, never written: it stages with the block but neither
    // loads fragments nor multiplies (warp-uniform). At small T (a
    // convolution's 9 positions) most of a tile's warps are such.
    const bool live = ri + wr < T && rj + wc < T;
    for (int k0 = 0; k0 < depth; k0 += kGramDepth) {
      __syncthreads();  // the previous step's reads are done
      store_step(vi, rows_i);
      if (!diagonal) store_step(vj, rows_j);
      __syncthreads();
      if (k0 + kGramDepth < depth) {
        const bool in = k0 + kGramDepth + k_own < depth;
        load_step(pi + k0 + kGramDepth, row_stride, left_i, in, vi);
        if (!diagonal) load_step(pj + k0 + kGramDepth, row_stride, left_j, in, vj);
      }
      if (!live) continue;
      NCDP_GRAM_STEP_UNROLL
      for (int kk = 0; kk < kGramDepth; kk += 4) {
        double a[kFragPairs][2], b[kFragCols];
#pragma unroll
        for (int p = 0; p < kFragPairs; ++p) {
          a[p][0] = rows_i[wr + 16 * p + g][kk + q];
          a[p][1] = rows_i[wr + 16 * p + 8 + g][kk + q];
        }
        // B = X_j^T: B[k][col] is row col's value k, held at [col][k].
#pragma unroll
        for (int c = 0; c < kFragCols; ++c) b[c] = cols[wc + 8 * c + g][kk + q];
#pragma unroll
        for (int p = 0; p < kFragPairs; ++p) {
#pragma unroll
          for (int c = 0; c < kFragCols; ++c) {
            mma_f64_16x8x4(acc[p][c][0], acc[p][c][1], acc[p][c][2], acc[p][c][3], a[p][0],
                           a[p][1], b[c]);
          }
        }
      }
    }
    // Formed here, not before the loop: live across it, it took the register
    // that sm_90's loop needs (4 bytes spilled at 80).
    double* w = out + gram * T * T;
#pragma unroll
    for (int m = 0; m < kFragRows; ++m) {
      const std::int64_t r = ri + wr + 8 * m + g;
#pragma unroll
      for (int c = 0; c < kFragCols; ++c) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const std::int64_t col = rj + wc + 8 * c + 2 * q + h;
          const double value = acc[m / 2][c][2 * (m % 2) + h];
          if (r < T && col < T) {
            w[r * T + col] = value;
            if (!diagonal) w[col * T + r] = value;
          }
        }
      }
    }
  }
}

// out[e] = the k-ranges' partial Grams at e added in range order (a fixed
// order: the same bits on every run of a shape).
__global__ void __launch_bounds__(kBlockThreads) sum_gram_ranges_kernel(
    const double* __restrict__ partials,  // [splits, entries]
    std::int64_t splits, std::int64_t entries,
    double* __restrict__ out) {  // [entries]
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       e < entries; e += stride) {
    double sum = partials[e];
    for (std::int64_t r = 1; r < splits; ++r) sum += partials[r * entries + e];
    out[e] = sum;
  }
}

}  // namespace

GramSplit gram_rows_f64_split(std::int64_t jobs, std::int64_t d) {
  // Ranges while the jobs leave resident blocks of the target unused, none
  // shorter than kGramMinSplitDepth values (each range writes its tile and
  // the sum reads it back: 32 KB a tile against 16 staged steps of products).
  std::int64_t want = 1;
  if (jobs > 0) {
    want = std::min(kTargetSMs * kGramBlocksPerSm / jobs, d / kGramMinSplitDepth);
  }
  want = std::max(want, ceil_div(d, kGramMaxRangeDepth));
  if (want <= 1) return GramSplit{1, std::max<std::int64_t>(d, 0)};
  // Whole staging steps a range (the last takes the rest); rounding up may
  // leave fewer ranges than wanted, never an empty one.
  const std::int64_t depth = ceil_div(ceil_div(d, want), kGramDepth) * kGramDepth;
  return GramSplit{ceil_div(d, depth), depth};
}

std::int64_t gram_rows_f64_workspace_bytes(std::int64_t count, std::int64_t n, std::int64_t T,
                                           std::int64_t d) {
  const std::int64_t nt = ceil_div(T, kGramTile);
  const GramSplit split = gram_rows_f64_split(count * n * (nt * (nt + 1) / 2), d);
  return split.splits > 1 ? align_bytes(split.splits * count * n * T * T *
                                        static_cast<std::int64_t>(sizeof(double)))
                          : 0;
}

void launch_gram_rows_f64(const GramSources& src, std::int64_t n, std::int64_t T,
                          std::int64_t d, double* out, void* workspace, cudaStream_t stream) {
  if (src.count <= 0 || n <= 0 || T <= 0) return;
  const std::int64_t nt = ceil_div(T, kGramTile);
  const std::int64_t tiles = nt * (nt + 1) / 2;
  const std::int64_t jobs = static_cast<std::int64_t>(src.count) * n * tiles;
  const GramSplit split = gram_rows_f64_split(jobs, d);
  double* partials = split.splits > 1 ? static_cast<double*>(workspace) : out;
  NCDP_LAUNCH(grid_blocks(split.splits * jobs, 1), kGramThreads, 0, stream,
              gram_rows_f64_kernel)(src, n, T, d, tiles, split.depth, split.splits * jobs,
                                    partials);
  if (split.splits > 1) {
    const std::int64_t entries = static_cast<std::int64_t>(src.count) * n * T * T;
    NCDP_LAUNCH(grid_blocks(entries, kBlockThreads), kBlockThreads, 0, stream,
                sum_gram_ranges_kernel)(partials, split.splits, entries, out);
  }
}

}  // namespace kernels
}  // namespace ncdp
