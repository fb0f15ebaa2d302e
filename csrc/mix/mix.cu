#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/block_reduce.cuh"
#include "common/launch.cuh"
#include "common/launch_config.h"
#include "common/philox.cuh"
#include "clip/clip_rule.cuh"
#include "common/vector_io.cuh"
#include "mix/mix.h"

namespace ncdp {
namespace kernels {
namespace {

// ---------------------------------------------------------------------------
// Sizing constants.

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = kBlockThreads / kWarpSize;

// Mix blocks: kBlockThreads gather threads (8 warps) plus one sampling warp
// that fills double-buffered chunks of up to kChunk member ids in shared
// memory, one chunk ahead of the gatherers (named barriers, see mix_rows_kernel).
constexpr int kChunk = 512;
constexpr int kGatherWarps = kWarpsPerBlock;
constexpr int kMixThreads = kBlockThreads + kWarpSize;
// Named barrier ids (0 is __syncthreads'): among the gather threads; chunk b
// full (sampler -> gatherers); chunk b consumed (gatherers -> sampler).
constexpr int kGatherBarrier = 1;
constexpr int kFullBarrier = 2;   // + b, b in {0, 1}
constexpr int kEmptyBarrier = 4;  // + b

// A walk step (gap + 1) is capped here: any gap of 2^53 or more (or an
// infinite / NaN one) passes the end of every group (groups hold fewer than
// 2^53 members), and 32 capped steps still sum without overflow.
constexpr double kGapLimit = 9007199254740992.0;  // 2^53
constexpr std::int64_t kStepCap = (std::int64_t{1} << 53) + 1;
constexpr std::int64_t kUnbounded = std::numeric_limits<std::int64_t>::max();

// Gather layout of the mix kernel: each thread owns slots of 4 consecutive
// columns (one 16-byte load for float, two for double), slot s of a tile at
// columns 4 (threadIdx.x + 256 s); kVectors slots per thread make a tile of
// 1024 kVectors columns. Rows of up to max_fused_vectors() slots per thread
// (8192 float / 4096 double columns) fit one tile and are clipped from
// registers; wider rows go tile by tile (kTiledVectors slots) with a separate
// norm pass per member.
constexpr int kSlotWidth = 4;
constexpr std::int64_t kSlotColumns = static_cast<std::int64_t>(kBlockThreads) * kSlotWidth;
template <typename Real>
constexpr int max_fused_vectors() {
  return sizeof(Real) == sizeof(float) ? 8 : 4;
}
constexpr int kTiledVectors = 2;

// Members loaded before one joint norm reduction: about 32 values of 4 bytes
// in flight per thread.
template <typename Real, int kVectors>
constexpr int members_per_step() {
  return std::max<int>(1, 32 / (kVectors * kSlotWidth * static_cast<int>(sizeof(Real)) / 4));
}

// ---------------------------------------------------------------------------
// The sampler.

// Inclusive prefix sum over the lanes of a warp (all lanes call it).
__device__ __forceinline__ std::int64_t warp_inclusive_scan(std::int64_t value, int lane) {
#pragma unroll
  for (int delta = 1; delta < kWarpSize; delta <<= 1) {
    const std::int64_t other = __shfl_up_sync(kFullMask, value, delta);
    if (lane >= delta) value += other;
  }
  return value;
}

// Positions advanced by one uniform of a walk with log1mq = log1p(-q): the
// gap floor(log(u) / log1mq) plus the selected member, capped (see kStepCap).
// log and log1p are philox::sampler_log / sampler_log1p, never the device's
// libm, so the gaps (a correctly rounded quotient) are the CPU's bit for bit.
// q == 0 (log1mq == 0) never selects, as reference.py's infinite gap.
__device__ __forceinline__ std::int64_t walk_step(double log_u, double log1mq) {
  if (log1mq == 0.0) return kStepCap;
  const double gap = floor(log_u / log1mq);
  // gap is -0.0 when u == 1 or q == 1; a negative or NaN gap (a rate outside
  // (0, 1]) ends the walk instead of stepping backwards.
  return (gap >= 0.0 && gap < kGapLimit) ? static_cast<std::int64_t>(gap) + 1 : kStepCap;
}

// The sampler of one output row, run by one whole warp with warp-uniform
// state: 32 uniforms are turned into steps at once and a warp scan of the steps
// gives 32 consecutive walk positions, so a row costs O(selected / 32 +
// groups / 32) warp steps. Group selection evaluates the selection uniforms
// (counter-based, addressable in any order) 32 groups at a time. The output is
// exactly reference.sample_groups' sequential process; `produce` can stop at
// any point and resume with the next call.
class WarpSampler {
 public:
  __device__ void begin(const GroupSampling& s, std::uint64_t seed, std::uint64_t sid) {
    seed_ = seed;
    sid_ = sid;
    next_uniform_ = s.select_rate != nullptr ? static_cast<std::uint64_t>(s.G) : 0u;
    group_ = -1;
    begin_ = 0;
    size_ = 0;
    pos_ = -1;
    log1mq_ = 0.0;
    in_group_ = false;
    done_ = false;
  }

  // Whether every member of the row has been produced.
  __device__ bool done() const { return done_; }

  // Produces the next at most `capacity` (> 0) ids of the row: sink(k, id) is
  // called for k = 0, 1, ... by the lane that found the id. Returns how many;
  // fewer than capacity only when the row is done. All 32 lanes must call it.
  template <typename Sink>
  __device__ std::int64_t produce(const GroupSampling& s, std::int64_t capacity,
                                  const Sink& sink) {
    const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
    std::int64_t count = 0;
    while (!done_ && count < capacity) {
      // Uniforms next_ .. next_ + 31 of the walk, one per lane.
      const double log_u = philox::sampler_log(philox::substream_uniform(
          seed_, sid_, next_uniform_ + static_cast<std::uint64_t>(lane)));
      int start = 0;  // lanes below `start` are consumed
      while (start < kWarpSize) {
        if (!in_group_ && !enter_next_group(s, lane)) {
          done_ = true;
          return count;
        }
        const std::int64_t step = lane >= start ? walk_step(log_u, log1mq_) : 0;
        const std::int64_t position = pos_ + warp_inclusive_scan(step, lane);
        // reference.py: the walk ends at the first uniform with pos + 1 + gap >= size.
        const unsigned ends = __ballot_sync(kFullMask, lane >= start && position >= size_);
        const int end = ends != 0u ? __ffs(static_cast<int>(ends)) - 1 : kWarpSize;
        const std::int64_t available = end - start;  // lanes start .. end-1 select
        const std::int64_t take = std::min(available, capacity - count);
        if (lane >= start && lane < start + take) {
          sink(count + (lane - start), s.members != nullptr ? s.members[begin_ + position]
                                                            : begin_ + position);
        }
        count += take;
        if (take < available) {
          // Full: the next call starts at the first uniform not yet used.
          if (take > 0) {
            pos_ = __shfl_sync(kFullMask, position, start + static_cast<int>(take) - 1);
          }
          next_uniform_ += static_cast<std::uint64_t>(start + take);
          return count;
        }
        if (end < kWarpSize) {
          // Lane `end`'s uniform ended the group; the next group continues after it.
          in_group_ = false;
          start = end + 1;
        } else {
          pos_ = __shfl_sync(kFullMask, position, kWarpSize - 1);
          start = kWarpSize;
        }
      }
      next_uniform_ += kWarpSize;
    }
    return count;
  }

 private:
  // Moves to the next selected group after group_; false when there is none.
  __device__ bool enter_next_group(const GroupSampling& s, int lane) {
    std::int64_t g = group_ + 1;
    if (s.select_rate != nullptr) {
      for (;; g += kWarpSize) {
        if (g >= s.G) {
          group_ = s.G;
          return false;
        }
        const std::int64_t mine = g + lane;
        const bool selected =
            mine < s.G && philox::substream_uniform(seed_, sid_, static_cast<std::uint64_t>(
                                                                     mine)) < s.select_rate[mine];
        const unsigned hits = __ballot_sync(kFullMask, selected);
        if (hits != 0u) {
          g += __ffs(static_cast<int>(hits)) - 1;
          break;
        }
      }
    } else if (g >= s.G) {
      group_ = s.G;
      return false;
    }
    group_ = g;
    begin_ = s.group_ptr[g];
    size_ = s.group_ptr[g + 1] - begin_;
    pos_ = -1;
    log1mq_ = philox::sampler_log1p(-s.walk_rate[g]);
    in_group_ = true;
    return true;
  }

  std::uint64_t seed_;
  std::uint64_t sid_;
  std::uint64_t next_uniform_;  // index of the next walk uniform
  std::int64_t group_;          // current group (or the last one looked at)
  std::int64_t begin_;          // its first entry in members / its first id
  std::int64_t size_;           // its member count
  std::int64_t pos_;            // last selected position in it, -1 at its start
  double log1mq_;               // sampler_log1p(-walk_rate[group_])
  bool in_group_;
  bool done_;
};

struct CountOnly {
  __device__ void operator()(std::int64_t, std::int64_t) const {}
};

struct WriteIds {
  std::int64_t* dst;
  __device__ void operator()(std::int64_t k, std::int64_t id) const { dst[k] = id; }
};

// The mix kernel's chunk buffer: ids and, for hard labels, their labels.
struct ChunkSink {
  std::int64_t* ids;
  std::int64_t* chunk_labels;
  const std::int64_t* labels;  // nullptr: soft labels or K == 0
  __device__ void operator()(std::int64_t k, std::int64_t id) const {
    ids[k] = id;
    if (labels != nullptr) chunk_labels[k] = labels[id];
  }
};

// ---------------------------------------------------------------------------
// Sampling kernels: one warp per row.

__global__ void __launch_bounds__(kBlockThreads) sample_counts_kernel(
    const GroupSampling s, std::int64_t rows, std::uint64_t row_stride, std::uint64_t seed,
    std::uint64_t offset,
    std::int64_t* __restrict__ counts) {  // [rows]
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock +
                        static_cast<int>(threadIdx.x) / kWarpSize;
       r < rows; r += warps) {
    WarpSampler sampler;
    sampler.begin(s, seed, 1u + offset + static_cast<std::uint64_t>(r) * row_stride);
    const std::int64_t count = sampler.produce(s, kUnbounded, CountOnly{});
    if (lane == 0) counts[r] = count;
  }
}

__global__ void __launch_bounds__(kBlockThreads) sample_fill_kernel(
    const GroupSampling s, std::int64_t rows, std::uint64_t row_stride, std::uint64_t seed,
    std::uint64_t offset,
    const std::int64_t* __restrict__ indptr,  // [rows + 1]
    std::int64_t* __restrict__ indices) {     // [indptr[rows]]
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock +
                        static_cast<int>(threadIdx.x) / kWarpSize;
       r < rows; r += warps) {
    const std::int64_t first = indptr[r];
    const std::int64_t capacity = indptr[r + 1] - first;
    if (capacity <= 0 || indices == nullptr) continue;
    WarpSampler sampler;
    sampler.begin(s, seed, 1u + offset + static_cast<std::uint64_t>(r) * row_stride);
    sampler.produce(s, capacity, WriteIds{indices + first});
  }
}

// ---------------------------------------------------------------------------
// The mix kernel.

template <typename Real>
struct MixArgs {
  const Real* features;  // [n, d]
  std::int64_t n;
  std::int64_t d;
  const std::int64_t* labels;  // [n] or nullptr
  const Real* soft_labels;     // [n, K] or nullptr
  std::int64_t K;
  GroupSampling sampling;
  std::int64_t rows;
  std::uint64_t seed;
  std::uint64_t offset;
  double inv_m;
  double clip_x;
  double noise_std_x;
  double noise_std_y;
  Real* out_x;  // [rows, d]
  Real* out_y;  // [rows, K]
  std::int64_t* counts;  // [rows]
};

// One chunk of a row's members, written by the sampling warp.
struct MixChunk {
  std::int64_t ids[kChunk];
  std::int64_t labels[kChunk];  // labels[ids] (hard labels only)
  std::int64_t row;             // -1: no more rows for this block
  int count;
  int last;  // the row's final chunk
};

template <int kMembers>
struct MixShared {
  MixChunk chunks[2];
  double factors[kChunk];  // clip factors (tiled path)
  // Per-warp partial squared norms, double-buffered so that one barrier per
  // step suffices (fused path).
  double norm_partials[2][kMembers][kGatherWarps];
};

// Named barriers (PTX bar.sync / bar.arrive, common/launch.cuh): `threads`
// threads (whole warps) take part; an arrive does not wait, and it
// synchronizes with the syncs of the same barrier phase (shared-memory writes
// before it are visible after them).
// The id is an immediate so that ptxas reserves only the barriers used.
template <int kId>
__device__ __forceinline__ void barrier_sync(int threads) {
  NCDP_NAMED_BARRIER_SYNC(kId, threads);
}
template <int kId>
__device__ __forceinline__ void barrier_arrive(int threads) {
  NCDP_NAMED_BARRIER_ARRIVE(kId, threads);
}
// Barrier kId + b of a double buffer, b in {0, 1}.
template <int kId>
__device__ __forceinline__ void barrier_sync_of(int b, int threads) {
  if (b == 0) {
    barrier_sync<kId>(threads);
  } else {
    barrier_sync<kId + 1>(threads);
  }
}
template <int kId>
__device__ __forceinline__ void barrier_arrive_of(int b, int threads) {
  if (b == 0) {
    barrier_arrive<kId>(threads);
  } else {
    barrier_arrive<kId + 1>(threads);
  }
}

// The clip factor of a member with squared norm sq (clip/clip_rule.cuh with
// terms = d): applied in float64, the product rounded once to Real.
template <typename Real>
__device__ __forceinline__ double mix_clip_factor(double sq, double clip_x, std::int64_t d) {
  return clip_factor(sq, 0.0, ClipRule{clip_x, d, 1, unit_roundoff<Real>()});
}

// Slot of 4 columns starting at c0 of `row` (zero past d). kAligned: every row
// starts on a 16-byte boundary (so does every slot).
template <typename Real, bool kAligned>
__device__ __forceinline__ void load_slot(const Real* __restrict__ row, std::int64_t c0,
                                          std::int64_t d, Real v[kSlotWidth]) {
  if (kAligned && c0 + kSlotWidth <= d) {
    load4_aligned(row + c0, v);
  } else {
#pragma unroll
    for (int q = 0; q < kSlotWidth; ++q) v[q] = c0 + q < d ? row[c0 + q] : Real(0);
  }
}

// Normals first .. first+3 of the main stream, one Box-Muller pair (one
// logarithm) per pair index and one main and companion block per main block
// index, each value as philox::normal_at gives it.
__device__ __forceinline__ void normals_of_slot(std::uint64_t seed, std::uint64_t first,
                                                double z[kSlotWidth]) {
  double radius = 0.0;
  double cosine = 0.0;
  double sine = 0.0;
  std::uint64_t pair = ~std::uint64_t{0};
  std::uint64_t block = ~std::uint64_t{0};
  philox::PairBlocks blocks{};
#pragma unroll
  for (int q = 0; q < kSlotWidth; ++q) {
    const std::uint64_t index = first + static_cast<std::uint64_t>(q);
    if ((index >> 1) != pair) {
      pair = index >> 1;
      if ((index >> 2) != block) {
        block = index >> 2;
        blocks = philox::pair_blocks(seed, block);
      }
      philox::box_muller_pair(seed, pair, blocks, &radius, &cosine, &sine);
    }
    z[q] = philox::detail::mul(radius, (index & 1) ? sine : cosine);
  }
}

// out_row[c] = inv_m * acc + noise_std * normal(noise_base + c) for the 4
// columns of the slot at c0 (those below d), computed in double, rounded once.
template <typename Real>
__device__ __forceinline__ void finish_slot(const Real acc[kSlotWidth], std::int64_t c0,
                                            std::int64_t d, double inv_m, double noise_std,
                                            std::uint64_t seed, std::uint64_t noise_base,
                                            Real* __restrict__ out_row) {
  double z[kSlotWidth] = {0.0, 0.0, 0.0, 0.0};
  if (noise_std != 0.0) normals_of_slot(seed, noise_base + static_cast<std::uint64_t>(c0), z);
#pragma unroll
  for (int q = 0; q < kSlotWidth; ++q) {
    if (c0 + q < d) {
      out_row[c0 + q] =
          static_cast<Real>(inv_m * static_cast<double>(acc[q]) + noise_std * z[q]);
    }
  }
}

// Fused path: one tile covers the row. Members go kMembers at a time: their
// slots are loaded into registers, their squared norms reduced jointly across
// the block (fixed order: lanes by a shuffle tree, warps in order), and the
// clipped values added to `acc` in member order.
template <typename Real, int kVectors, int kMembers, bool kAligned>
__device__ __forceinline__ void fused_accumulate(const MixArgs<Real>& a, MixShared<kMembers>& sh,
                                                 const MixChunk& chunk, bool clip, int& parity,
                                                 Real acc[kVectors][kSlotWidth]) {
  const int count = chunk.count;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  for (int i0 = 0; i0 < count; i0 += kMembers) {
    const int here = std::min(kMembers, count - i0);
    Real v[kMembers][kVectors][kSlotWidth];
#pragma unroll
    for (int m = 0; m < kMembers; ++m) {
      if (m < here) {
        const Real* row = a.features + chunk.ids[i0 + m] * a.d;
#pragma unroll
        for (int s = 0; s < kVectors; ++s) {
          load_slot<Real, kAligned>(row, (tid + kBlockThreads * s) * std::int64_t{kSlotWidth},
                                    a.d, v[m][s]);
        }
      } else {
#pragma unroll
        for (int s = 0; s < kVectors; ++s) {
#pragma unroll
          for (int q = 0; q < kSlotWidth; ++q) v[m][s][q] = Real(0);
        }
      }
    }
    double factor[kMembers];
#pragma unroll
    for (int m = 0; m < kMembers; ++m) factor[m] = 1.0;
    if (clip) {
#pragma unroll
      for (int m = 0; m < kMembers; ++m) {
        double sq = 0.0;
#pragma unroll
        for (int s = 0; s < kVectors; ++s) {
#pragma unroll
          for (int q = 0; q < kSlotWidth; ++q) {
            const double x = static_cast<double>(v[m][s][q]);
            sq += x * x;
          }
        }
        sq = warp_sum(sq);
        if (lane == 0) sh.norm_partials[parity][m][warp] = sq;
      }
      barrier_sync<kGatherBarrier>(kBlockThreads);
      // Lane m of every warp forms member m's factor (the same sum, in warp
      // order, and the same rule as every thread forming all of them: the
      // same bits), and the warp shares it: a thread evaluates the rule once
      // a step instead of kMembers times.
      double mine = 1.0;
      if (lane < kMembers) {
        double sq = 0.0;
#pragma unroll
        for (int w = 0; w < kGatherWarps; ++w) sq += sh.norm_partials[parity][lane][w];
        mine = mix_clip_factor<Real>(sq, a.clip_x, a.d);
      }
#pragma unroll
      for (int m = 0; m < kMembers; ++m) factor[m] = __shfl_sync(kFullMask, mine, m);
      // The other buffer is next; this one is rewritten only after the next
      // step's barrier, which every thread reaches after reading it.
      parity ^= 1;
    }
#pragma unroll
    for (int m = 0; m < kMembers; ++m) {
      if (m < here) {
#pragma unroll
        for (int s = 0; s < kVectors; ++s) {
#pragma unroll
          for (int q = 0; q < kSlotWidth; ++q) {
            acc[s][q] += clip ? static_cast<Real>(factor[m] * static_cast<double>(v[m][s][q]))
                              : v[m][s][q];
          }
        }
      }
    }
  }
}

// Tiled path (rows wider than one tile): clip factors of the chunk first (one
// warp per member, the whole row), then tile by tile: partial sums of earlier
// chunks are kept in out_x itself (this row belongs to this block, and each
// column to one thread), the last chunk writes the finished values.
template <typename Real, bool kAligned>
__device__ __forceinline__ void tiled_accumulate(const MixArgs<Real>& a, MixShared<1>& sh,
                                                 const MixChunk& chunk, bool clip, bool first,
                                                 std::uint64_t noise_base, Real* out_row) {
  const int count = chunk.count;
  const bool last = chunk.last != 0;
  constexpr int kVectors = kTiledVectors;
  constexpr std::int64_t kTileColumns = kSlotColumns * kVectors;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  if (clip) {
    for (int i = warp; i < count; i += kGatherWarps) {
      double sq = thread_sum_of_squares(a.features + chunk.ids[i] * a.d, a.d, lane, kWarpSize);
      sq = warp_sum(sq);
      if (lane == 0) sh.factors[i] = mix_clip_factor<Real>(sq, a.clip_x, a.d);
    }
    barrier_sync<kGatherBarrier>(kBlockThreads);
  }
  for (std::int64_t tile = 0; tile * kTileColumns < a.d; ++tile) {
    Real acc[kVectors][kSlotWidth];
#pragma unroll
    for (int s = 0; s < kVectors; ++s) {
      const std::int64_t c0 = tile * kTileColumns + (tid + kBlockThreads * s) * std::int64_t{kSlotWidth};
#pragma unroll
      for (int q = 0; q < kSlotWidth; ++q) {
        acc[s][q] = (!first && c0 + q < a.d) ? out_row[c0 + q] : Real(0);
      }
    }
#pragma unroll 2
    for (int i = 0; i < count; ++i) {
      const Real* row = a.features + chunk.ids[i] * a.d;
      const double factor = clip ? sh.factors[i] : 1.0;
#pragma unroll
      for (int s = 0; s < kVectors; ++s) {
        Real v[kSlotWidth];
        load_slot<Real, kAligned>(
            row, tile * kTileColumns + (tid + kBlockThreads * s) * std::int64_t{kSlotWidth}, a.d,
            v);
#pragma unroll
        for (int q = 0; q < kSlotWidth; ++q) {
          acc[s][q] += clip ? static_cast<Real>(factor * static_cast<double>(v[q])) : v[q];
        }
      }
    }
#pragma unroll
    for (int s = 0; s < kVectors; ++s) {
      const std::int64_t c0 = tile * kTileColumns + (tid + kBlockThreads * s) * std::int64_t{kSlotWidth};
      if (last) {
        finish_slot(acc[s], c0, a.d, a.inv_m, a.noise_std_x, a.seed, noise_base, out_row);
      } else {
#pragma unroll
        for (int q = 0; q < kSlotWidth; ++q) {
          if (c0 + q < a.d) out_row[c0 + q] = acc[s][q];
        }
      }
    }
  }
}

// Labels of the chunk into y: thread k (of each 256) owns class k; partial
// sums of earlier chunks live in out_y's row, the last chunk finishes it.
template <typename Real>
__device__ __forceinline__ void accumulate_labels(const MixArgs<Real>& a, const MixChunk& chunk,
                                                  bool first, std::uint64_t noise_base,
                                                  Real* out_row) {
  const int count = chunk.count;
  const bool last = chunk.last != 0;
  for (std::int64_t k = threadIdx.x; k < a.K; k += kBlockThreads) {
    Real acc = first ? Real(0) : out_row[k];
    if (a.soft_labels == nullptr) {
      std::int64_t hits = 0;
      for (int i = 0; i < count; ++i) hits += chunk.labels[i] == k ? 1 : 0;
      acc += static_cast<Real>(hits);
    } else {
      for (int i = 0; i < count; ++i) acc += a.soft_labels[chunk.ids[i] * a.K + k];
    }
    if (last) {
      const double noise =
          a.noise_std_y != 0.0
              ? a.noise_std_y *
                    philox::normal_at(a.seed, noise_base + static_cast<std::uint64_t>(a.d + k))
              : 0.0;
      out_row[k] = static_cast<Real>(a.inv_m * static_cast<double>(acc) + noise);
    } else {
      out_row[k] = acc;
    }
  }
}

// Output rows grid-strided over the blocks (mix_grid), as a two-stage pipeline: the
// sampling warp (warp kGatherWarps) runs the sampler of the block's rows and
// writes their members, up to kChunk ids at a time, into two alternating
// chunk buffers; the kBlockThreads gather threads gather-accumulate each chunk
// (threads across d) while the next one is being sampled. Chunk c lives in
// buffer c % 2; the sampler waits for "buffer consumed" (from chunk c - 2)
// before writing it and signals "buffer full" after; the gatherers wait for
// "full" and signal "consumed". After the block's last row the sampler sends a
// chunk with row -1. No atomics: every sum has a fixed order.
template <typename Real, int kVectors, bool kAligned, bool kFused>
__global__ void __launch_bounds__(kMixThreads) mix_rows_kernel(const MixArgs<Real> a) {
  constexpr int kMembers = kFused ? members_per_step<Real, kVectors>() : 1;
  __shared__ MixShared<kMembers> sh;
  const int tid = static_cast<int>(threadIdx.x);
  const std::uint64_t row_stride = static_cast<std::uint64_t>(a.d + a.K);

  if (tid >= kBlockThreads) {
    // ---- Sampling warp.
    const std::int64_t* labels = a.soft_labels == nullptr && a.K > 0 ? a.labels : nullptr;
    const int lane = tid % kWarpSize;
    std::int64_t chunks = 0;
    WarpSampler sampler;
    for (std::int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
      // The sub-stream of row r is 1 + its noise base.
      sampler.begin(a.sampling, a.seed, 1u + a.offset + static_cast<std::uint64_t>(row) * row_stride);
      do {
        const int b = static_cast<int>(chunks & 1);
        if (chunks >= 2) barrier_sync_of<kEmptyBarrier>(b, kMixThreads);
        MixChunk& chunk = sh.chunks[b];
        const std::int64_t produced =
            sampler.produce(a.sampling, kChunk, ChunkSink{chunk.ids, chunk.labels, labels});
        if (lane == 0) {
          chunk.row = row;
          chunk.count = static_cast<int>(produced);
          chunk.last = sampler.done() ? 1 : 0;
        }
        __threadfence_block();
        barrier_arrive_of<kFullBarrier>(b, kMixThreads);
        ++chunks;
      } while (!sampler.done());
    }
    const int b = static_cast<int>(chunks & 1);
    if (chunks >= 2) barrier_sync_of<kEmptyBarrier>(b, kMixThreads);
    if (lane == 0) sh.chunks[b].row = -1;
    __threadfence_block();
    barrier_arrive_of<kFullBarrier>(b, kMixThreads);
    // Match the gatherers' "consumed" of the last real chunk, so that every
    // barrier phase this block opened completes.
    if (chunks >= 1) barrier_sync_of<kEmptyBarrier>(static_cast<int>((chunks + 1) & 1), kMixThreads);
    return;
  }

  // ---- Gather threads.
  const bool clip = a.clip_x > 0.0;
  int parity = 0;
  bool first = true;  // the next chunk starts a row
  std::int64_t total = 0;
  Real acc[kVectors][kSlotWidth];
  for (std::int64_t c = 0;; ++c) {
    const int b = static_cast<int>(c & 1);
    barrier_sync_of<kFullBarrier>(b, kMixThreads);
    const MixChunk& chunk = sh.chunks[b];
    const std::int64_t row = chunk.row;
    if (row < 0) break;
    // Noise of x[row, j] is normal(seed, noise_base + j); y follows at + d.
    const std::uint64_t noise_base = a.offset + static_cast<std::uint64_t>(row) * row_stride;
    Real* out_x_row = a.out_x + row * a.d;
    Real* out_y_row = a.out_y + row * a.K;
    if (first) {
      total = 0;
#pragma unroll
      for (int s = 0; s < kVectors; ++s) {
#pragma unroll
        for (int q = 0; q < kSlotWidth; ++q) acc[s][q] = Real(0);
      }
    }
    if constexpr (kFused) {
      fused_accumulate<Real, kVectors, kMembers, kAligned>(a, sh, chunk, clip, parity, acc);
    } else {
      tiled_accumulate<Real, kAligned>(a, sh, chunk, clip, first, noise_base, out_x_row);
    }
    accumulate_labels(a, chunk, first, noise_base, out_y_row);
    total += chunk.count;
    const bool last = chunk.last != 0;
    if (last) {
      if constexpr (kFused) {
#pragma unroll
        for (int s = 0; s < kVectors; ++s) {
          const std::int64_t c0 = (tid + kBlockThreads * s) * std::int64_t{kSlotWidth};
          if (c0 < a.d) {
            finish_slot(acc[s], c0, a.d, a.inv_m, a.noise_std_x, a.seed, noise_base, out_x_row);
          }
        }
      }
      if (tid == 0) a.counts[row] = total;
    }
    first = last;
    // Every read of this buffer is done: the sampler may refill it.
    barrier_arrive_of<kEmptyBarrier>(b, kMixThreads);
  }
}

// Grid of a mix launch: at most kMixWaves times the blocks of `kKernel` the
// device holds at once, so that a block runs several rows and its sampling
// warp samples the next row while its gather threads gather this one. A
// block a row (the grid as large as the rows, up to 2^16) left every row's
// sampling -- a warp's serial walk, no loads in flight -- before its gather,
// and each block's start and end, on the SM's time. Several waves, not one,
// so that blocks that start late (other work on the device) leave a short
// tail. Residency is asked once per kernel, of the first device that
// launches it: the split only changes speed, never a result.
constexpr std::int64_t kMixWaves = 4;

template <auto kKernel>
unsigned int mix_grid(std::int64_t rows) {
  static const std::int64_t resident = [] {
    int device = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kMixThreads, 0) !=
            cudaSuccess) {
      (void)cudaGetLastError();  // unknown: the grid stays a block a row
      return std::int64_t{0};
    }
    return static_cast<std::int64_t>(sms) * per_sm;
  }();
  return grid_blocks(resident > 0 ? std::min<std::int64_t>(rows, kMixWaves * resident) : rows, 1);
}

template <typename Real, int kVectors, bool kAligned, bool kFused>
void launch_mix_kernel(const MixArgs<Real>& args, cudaStream_t stream) {
  const unsigned int blocks = mix_grid<mix_rows_kernel<Real, kVectors, kAligned, kFused>>(args.rows);
  NCDP_LAUNCH(blocks, kMixThreads, 0, stream, mix_rows_kernel<Real, kVectors, kAligned, kFused>)(
      args);
}

template <typename Real, int kVectors>
void launch_fused(const MixArgs<Real>& args, bool aligned, cudaStream_t stream) {
  if (aligned) {
    launch_mix_kernel<Real, kVectors, true, true>(args, stream);
  } else {
    launch_mix_kernel<Real, kVectors, false, true>(args, stream);
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Launchers.

void launch_sample_counts(const GroupSampling& sampling, std::int64_t rows,
                          std::uint64_t row_stride, std::uint64_t seed, std::uint64_t offset,
                          std::int64_t* counts, cudaStream_t stream) {
  if (rows <= 0) return;
  NCDP_LAUNCH(grid_blocks(rows, kWarpsPerBlock), kBlockThreads, 0, stream, sample_counts_kernel)(
      sampling, rows, row_stride, seed, offset, counts);
}

void launch_sample_fill(const GroupSampling& sampling, std::int64_t rows,
                        std::uint64_t row_stride, std::uint64_t seed, std::uint64_t offset,
                        const std::int64_t* indptr, std::int64_t* indices, cudaStream_t stream) {
  if (rows <= 0) return;
  NCDP_LAUNCH(grid_blocks(rows, kWarpsPerBlock), kBlockThreads, 0, stream, sample_fill_kernel)(
      sampling, rows, row_stride, seed, offset, indptr, indices);
}

template <typename Real>
void launch_mix_rows(const Real* features, std::int64_t n, std::int64_t d,
                     const std::int64_t* labels, const Real* soft_labels, std::int64_t K,
                     const GroupSampling& sampling, std::int64_t rows, std::uint64_t seed,
                     std::uint64_t offset, double inv_m, double clip_x, double noise_std_x,
                     double noise_std_y, Real* out_x, Real* out_y, std::int64_t* counts,
                     cudaStream_t stream) {
  if (rows <= 0) return;
  const MixArgs<Real> args{features, n,     d,      labels,      soft_labels, K,
                           sampling, rows,  seed,   offset,      inv_m,       clip_x,
                           noise_std_x, noise_std_y, out_x, out_y, counts};
  // Every row (hence every slot) starts on a 16-byte boundary.
  const bool aligned = (reinterpret_cast<std::uintptr_t>(features) & 15u) == 0 &&
                       d % Vec16<Real>::kWidth == 0;
  const std::int64_t slots = ceil_div(d, kSlotColumns);
  if (slots <= 1) {
    launch_fused<Real, 1>(args, aligned, stream);
  } else if (slots <= 2) {
    launch_fused<Real, 2>(args, aligned, stream);
  } else if (slots <= 4) {
    launch_fused<Real, 4>(args, aligned, stream);
  } else if (max_fused_vectors<Real>() >= 8 && slots <= 8) {
    launch_fused<Real, (max_fused_vectors<Real>() >= 8 ? 8 : 4)>(args, aligned, stream);
  } else if (aligned) {
    launch_mix_kernel<Real, kTiledVectors, true, false>(args, stream);
  } else {
    launch_mix_kernel<Real, kTiledVectors, false, false>(args, stream);
  }
}

template void launch_mix_rows<float>(const float*, std::int64_t, std::int64_t,
                                     const std::int64_t*, const float*, std::int64_t,
                                     const GroupSampling&, std::int64_t, std::uint64_t,
                                     std::uint64_t, double, double, double, double, float*,
                                     float*, std::int64_t*, cudaStream_t);
template void launch_mix_rows<double>(const double*, std::int64_t, std::int64_t,
                                      const std::int64_t*, const double*, std::int64_t,
                                      const GroupSampling&, std::int64_t, std::uint64_t,
                                      std::uint64_t, double, double, double, double, double*,
                                      double*, std::int64_t*, cudaStream_t);

}  // namespace kernels
}  // namespace ncdp
