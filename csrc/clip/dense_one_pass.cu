// The fused dense op (clip_noise.h, launch_clip_noise_rows) with the gradients
// read from DRAM once (issue 36): the two-pass form reads every row twice,
// once for its norm and once for its weighted sum, and the chunked form paid
// three launches a chunk to keep the second read in L2. Here one launch does
// both passes:
//
// - Norm items (row block k, up to 4 norm segments) are handed out in ticket
//   order from a counter: a row block's R rows, segments of 4096 columns,
//   each segment's squared sums into sq_partials[row, s], the same per-thread
//   order and block tree as row_sq_norms_kernel (so the norms are its own,
//   bit for bit).
//   The block that completes a row block's last item forms its rows' norms
//   and factors (as clip_factors_kernel: segments summed in order) and sets
//   the row block's ready flag.
// - Each block owns a column range of at most 4096 columns and sums
//   f_r g[r, its columns] into float64 registers, row block after row block
//   in row order; before row block k it takes norm tickets until k is ready,
//   so the rows it reads were pulled into the L2 by a norm item a moment
//   before (a row block is at most 1/16 of the L2).
// - The float64 sums go to a [p] buffer that the slab finish (one slab) turns
//   into the output with its noise: the two-pass form's own finish.
//
// No block ever waits on work that no running block holds: a block takes a
// ticket only while it runs and finishes the item before it waits again, and
// a block waiting for row block k takes the next ticket itself while any is
// left. So the launch needs no co-residency (a cooperative launch), and the
// emulator, which runs a launch's blocks one after another, runs it too (its
// first block then does every norm item). The grid is sized to the resident
// blocks only so that the second read of a row block hits the L2.
#include <algorithm>
#include <cmath>

#include "clip/clip_noise.h"
#include "common/block_reduce.cuh"
#include "common/launch.cuh"
#include "common/launch_config.h"
#include "common/vector_io.cuh"
#include "rng/gaussian.h"

namespace ncdp {
namespace kernels {
namespace {

// Column groups of 4 a thread: a block's columns fit 4 float64 registers x 4.
constexpr int kOnePassVectors = 4;
constexpr std::int64_t kOnePassMaxColumns = std::int64_t{kBlockThreads} * 4 * kOnePassVectors;
// A block owns at least a float4 a thread (fewer columns leave threads idle).
constexpr std::int64_t kOnePassMinColumns = std::int64_t{kBlockThreads} * 4;
// Rows of a norm item reduced together (their loads in flight at once).
constexpr int kOnePassRowsAtOnce = 4;
// Segments of a norm item: a ticket's round trip to the L2 (a block waits for
// it) is paid once for up to 4 R x 4096 values.
constexpr std::int64_t kOnePassSegmentsPerItem = 4;
// Polls of a ready flag with no ticket left (each after a 256 ns sleep, so at
// least 17 s) before the launch is failed with a trap: a hand-over that never
// comes (a bug, or a device that stopped a block) is an error, not a hang.
constexpr long long kOnePassMaxPolls = 1ll << 26;
// Rows of a row block: at most this many, and at most 1/kOnePassL2Share of the
// L2 (a row block is read again while the norm items of about two more pass
// through the L2: the grid's items in flight are some two row blocks' worth).
constexpr std::int64_t kOnePassMaxRows = 32;
constexpr std::int64_t kOnePassL2Share = 16;

__global__ void __launch_bounds__(kBlockThreads) zero_words_kernel(
    unsigned int* __restrict__ words,  // [n]
    std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    words[i] = 0u;
  }
}

// The launch's hand-over state in global memory, zeroed before it.
struct OnePassFlags {
  unsigned int* done;               // [row_blocks]: norm items finished
  unsigned int* ready;              // [row_blocks]: 1 once the factors are written
  unsigned long long* next_ticket;  // the next norm item to hand out
};

// Norm item t: rows [k R, k R + R) of segments [4 i, 4 i + 4) (those below
// M), t = k G + i, G = plan.items. Thread 0 writes the partials; the block
// that finishes a row block's last segment writes its norms and factors and
// then its ready flag.
template <typename Real>
__device__ void one_pass_norm_item(const Real* __restrict__ grads, std::int64_t B,
                                   std::int64_t p, const OnePassPlan& plan, const ClipRule& rule,
                                   std::int64_t t, double* __restrict__ sq_partials,
                                   double* __restrict__ factors, double* __restrict__ norms,
                                   const OnePassFlags& flags, double* scratch, int* last) {
  const int tid = static_cast<int>(threadIdx.x);
  const std::int64_t k = t / plan.items;
  const std::int64_t s0 = (t % plan.items) * kOnePassSegmentsPerItem;
  const std::int64_t s1 = std::min(plan.segments, s0 + kOnePassSegmentsPerItem);
  const std::int64_t r0 = k * plan.rows;
  const std::int64_t r1 = std::min(B, r0 + plan.rows);
  const std::int64_t segment = kDenseNormSegment;  // by value: std::min takes references
  for (std::int64_t s = s0; s < s1; ++s) {
    const std::int64_t begin = s * segment;
    const std::int64_t length = std::min(segment, p - begin);
    for (std::int64_t rb = r0; rb < r1; rb += kOnePassRowsAtOnce) {
      double sums[kOnePassRowsAtOnce];
#pragma unroll
      for (int j = 0; j < kOnePassRowsAtOnce; ++j) {
        sums[j] = rb + j < r1 ? thread_sum_of_squares(grads + (rb + j) * p + begin, length, tid,
                                                      kBlockThreads)
                              : 0.0;
      }
      block_sums<kBlockThreads>(sums, scratch);
      if (tid == 0) {
#pragma unroll
        for (int j = 0; j < kOnePassRowsAtOnce; ++j) {
          if (rb + j < r1) sq_partials[(rb + j) * plan.segments + s] = sums[j];
        }
      }
    }
  }
  if (tid == 0) {
    __threadfence();  // the partials before the count that publishes them
    const unsigned int here = static_cast<unsigned int>(s1 - s0);
    *last = atomicAdd(flags.done + k, here) + here == static_cast<unsigned int>(plan.segments);
  }
  __syncthreads();
  if (*last) {
    __threadfence();  // the other blocks' partials, published before their counts
    for (std::int64_t row = r0 + tid; row < r1; row += kBlockThreads) {
      // clip_factors_kernel's operations with scale 1 and no spread.
      double sq = 0.0;
      for (std::int64_t i = 0; i < plan.segments; ++i) {
        sq += __ldcg(sq_partials + row * plan.segments + i);
      }
      norms[row] = sqrt(sq);
      factors[row] = clip_factor(sq, 0.0, rule);
    }
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      NCDP_STORE_RELEASE_GPU(flags.ready + k, 1u);
    }
  }
  // `scratch` and `last` are reused by the next item.
  __syncthreads();
}

// Rows [k R, k R + R) may be read once this returns: until their factors are
// ready, the block works off norm tickets (or, with none left, waits for the
// blocks that hold the last ones).
template <typename Real>
__device__ void one_pass_wait(std::int64_t k, const Real* __restrict__ grads, std::int64_t B,
                              std::int64_t p, const OnePassPlan& plan, const ClipRule& rule,
                              double* __restrict__ sq_partials, double* __restrict__ factors,
                              double* __restrict__ norms, const OnePassFlags& flags,
                              double* scratch, long long* ticket, int* last) {
  const long long total = static_cast<long long>(plan.row_blocks * plan.items);
  long long polls = 0;  // thread 0's
  for (;;) {
    if (threadIdx.x == 0) {
      long long t = -1;  // ready
      if (NCDP_LOAD_ACQUIRE_GPU(flags.ready + k) == 0u) {
        // Polls past the end leave the counter alone, so it cannot wrap.
        t = static_cast<long long>(__ldcg(flags.next_ticket)) < total
                ? static_cast<long long>(atomicAdd(flags.next_ticket, 1ull))
                : total;
        if (t >= total) {
          t = total;  // nothing left to take: another block holds the last items
          if (++polls > kOnePassMaxPolls) __trap();
          __nanosleep(256);
        }
      }
      *ticket = t;
    }
    __syncthreads();
    const long long t = *ticket;
    __syncthreads();  // every thread has read it before thread 0 writes the next
    if (t < 0) return;
    if (t < total) {
      one_pass_norm_item(grads, B, p, plan, rule, t, sq_partials, factors, norms, flags, scratch,
                         last);
    }
  }
}

// out_sums[c] = sum_r factors[r] grads[r, c] in float64, rows in order (rows
// with factor 0 skipped: they may hold NaN), for this block's columns
// [blockIdx.x * columns, +columns); the norm items and factors on the way.
// kAligned: every group of 4 columns starts on a 16-byte boundary.
template <typename Real, bool kAligned>
__global__ void __launch_bounds__(kBlockThreads) clip_noise_rows_one_pass_kernel(
    const Real* __restrict__ grads,  // [B, p]
    std::int64_t B, std::int64_t p, OnePassPlan plan, ClipRule rule,
    double* __restrict__ sq_partials,  // [B, plan.segments]
    double* __restrict__ factors,      // [B]
    double* __restrict__ norms,        // [B]
    OnePassFlags flags,
    double* __restrict__ out_sums) {  // [p]
  __shared__ double scratch[kBlockThreads / 32 * kOnePassRowsAtOnce];
  __shared__ long long ticket;
  __shared__ int last;
  const int tid = static_cast<int>(threadIdx.x);
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * plan.columns;
  const std::int64_t end = std::min(p, first + plan.columns);
  double acc[kOnePassVectors][4];
#pragma unroll
  for (int v = 0; v < kOnePassVectors; ++v) {
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[v][q] = 0.0;
  }
  for (std::int64_t k = 0; k < plan.row_blocks; ++k) {
    one_pass_wait(k, grads, B, p, plan, rule, sq_partials, factors, norms, flags, scratch,
                  &ticket, &last);
    const std::int64_t r1 = std::min(B, (k + 1) * plan.rows);
#pragma unroll 2
    for (std::int64_t r = k * plan.rows; r < r1; ++r) {
      // Written by another block in this launch: read past the (incoherent) L1.
      const double factor = __ldcg(factors + r);
      const bool keep = factor != 0.0;
      const Real* row = grads + r * p;
#pragma unroll
      for (int v = 0; v < kOnePassVectors; ++v) {
        const std::int64_t column = first + (tid + std::int64_t{kBlockThreads} * v) * 4;
        if (column < end) {
          const std::int64_t remaining = end - column;
          Real x[4];
          if (kAligned && remaining >= 4) {
            load4_aligned(row + column, x);
          } else {
#pragma unroll
            for (int q = 0; q < 4; ++q) x[q] = q < remaining ? row[column + q] : Real(0);
          }
          // weighted_row_sum_partials_kernel's operation.
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[v][q] += keep ? factor * static_cast<double>(x[q]) : 0.0;
        }
      }
    }
  }
#pragma unroll
  for (int v = 0; v < kOnePassVectors; ++v) {
    const std::int64_t column = first + (tid + std::int64_t{kBlockThreads} * v) * 4;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      if (column + q < end) out_sums[column + q] = acc[v][q];
    }
  }
}

}  // namespace
}  // namespace kernels

// Host-side caches live outside ncdp::kernels: the emulator takes every
// function-local static there for a __shared__ variable and poisons it before
// each block (tests/cuda_emu/cuda_emu.h, is_shared_symbol).
namespace launch_cache {

// Blocks of the one-pass kernel the device holds at once (0 when unknown),
// asked once, of the first device that launches it.
template <typename Real>
std::int64_t one_pass_resident_blocks() {
  static const std::int64_t resident = [] {
    int device = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &per_sm, kernels::clip_noise_rows_one_pass_kernel<Real, true>, kBlockThreads, 0) !=
            cudaSuccess) {
      (void)cudaGetLastError();
      return std::int64_t{0};
    }
    return static_cast<std::int64_t>(sms) * per_sm;
  }();
  return resident;
}

}  // namespace launch_cache

namespace kernels {

OnePassPlan plan_clip_noise_rows_one_pass(std::int64_t B, std::int64_t p,
                                          std::int64_t element_bytes, std::int64_t l2_bytes,
                                          std::int64_t blocks) {
  OnePassPlan plan{};
  if (B <= 0 || p <= 0 || blocks <= 0) return plan;
  const std::int64_t wanted = blocks;
  blocks = std::min(blocks, ceil_div(p, kOnePassMinColumns));
  // Each block sums its columns of every row: with fewer blocks than half the
  // grid asked for, most SMs would sit out the sums (two passes instead).
  if (2 * blocks < wanted) return plan;
  // Multiples of 4 columns: with p a multiple of the vector width, every
  // block's groups start on 16-byte boundaries.
  const std::int64_t columns = ceil_div(ceil_div(p, blocks), 4) * 4;
  if (columns > kOnePassMaxColumns) return plan;  // too wide for the grid: two passes
  plan.columns = columns;
  plan.blocks = ceil_div(p, columns);
  const std::int64_t row_bytes = p * element_bytes;
  plan.rows = std::max<std::int64_t>(
      1, std::min({kOnePassMaxRows, B, l2_bytes / (kOnePassL2Share * row_bytes)}));
  plan.row_blocks = ceil_div(B, plan.rows);
  plan.segments = ceil_div(p, kDenseNormSegment);
  plan.items = ceil_div(plan.segments, kOnePassSegmentsPerItem);
  return plan;
}

template <typename Real>
OnePassPlan resolve_clip_noise_rows_one_pass(std::int64_t B, std::int64_t p,
                                             std::int64_t l2_bytes, std::int64_t blocks) {
  if (blocks < 0) blocks = launch_cache::one_pass_resident_blocks<Real>();
  return plan_clip_noise_rows_one_pass(B, p, static_cast<std::int64_t>(sizeof(Real)), l2_bytes,
                                       blocks);
}
template OnePassPlan resolve_clip_noise_rows_one_pass<float>(std::int64_t, std::int64_t,
                                                             std::int64_t, std::int64_t);
template OnePassPlan resolve_clip_noise_rows_one_pass<double>(std::int64_t, std::int64_t,
                                                              std::int64_t, std::int64_t);

std::int64_t one_pass_flag_words(std::int64_t B) {
  // done and ready for at most B row blocks, then the 64-bit ticket counter
  // (2 B words: on an 8-byte boundary).
  return 2 * B + 2;
}

template <typename Real>
bool launch_clip_noise_rows_one_pass(const Real* grads, std::int64_t B, std::int64_t p,
                                     const ClipRule& rule, double noise_std, double inv_denom,
                                     std::uint64_t seed, std::uint64_t offset, Real* out,
                                     double* norms, const ClipNoiseRowsLayout& layout,
                                     void* workspace, std::int64_t l2_bytes,
                                     std::int64_t blocks, cudaStream_t stream) {
  const OnePassPlan plan = resolve_clip_noise_rows_one_pass<Real>(B, p, l2_bytes, blocks);
  if (plan.blocks == 0 || layout.slabs < 1) return false;
  char* base = static_cast<char*>(workspace);
  double* factors = reinterpret_cast<double*>(base + layout.factors_offset);
  double* sq_partials = reinterpret_cast<double*>(base + layout.sq_partials_offset);
  // The first slab row of the two-pass form holds the sums.
  double* sums = reinterpret_cast<double*>(base + layout.partials_offset);
  unsigned int* words = reinterpret_cast<unsigned int*>(base + layout.flags_offset);
  const std::int64_t n_words = one_pass_flag_words(B);
  const OnePassFlags flags{words, words + B,
                           reinterpret_cast<unsigned long long*>(words + n_words - 2)};
  NCDP_LAUNCH(grid_blocks(n_words, kBlockThreads), kBlockThreads, 0, stream, zero_words_kernel)(
      words, n_words);
  const unsigned int grid = static_cast<unsigned int>(plan.blocks);
  const bool aligned = is_aligned16(grads) && p % Vec16<Real>::kWidth == 0;
  if (aligned) {
    NCDP_LAUNCH(grid, kBlockThreads, 0, stream, clip_noise_rows_one_pass_kernel<Real, true>)(
        grads, B, p, plan, rule, sq_partials, factors, norms, flags, sums);
  } else {
    NCDP_LAUNCH(grid, kBlockThreads, 0, stream, clip_noise_rows_one_pass_kernel<Real, false>)(
        grads, B, p, plan, rule, sq_partials, factors, norms, flags, sums);
  }
  launch_slab_sum_plus_gaussian<double, Real>(sums, 1, p, noise_std, inv_denom, seed, offset,
                                              out, stream);
  return true;
}

#define NCDP_INSTANTIATE_ONE_PASS(Real)                                                        \
  template bool launch_clip_noise_rows_one_pass<Real>(                                       \
      const Real*, std::int64_t, std::int64_t, const ClipRule&, double, double, std::uint64_t, \
      std::uint64_t, Real*, double*, const ClipNoiseRowsLayout&, void*, std::int64_t,         \
      std::int64_t, cudaStream_t);
NCDP_INSTANTIATE_ONE_PASS(float)
NCDP_INSTANTIATE_ONE_PASS(double)
#undef NCDP_INSTANTIATE_ONE_PASS

}  // namespace kernels
}  // namespace ncdp
