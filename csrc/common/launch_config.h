// Compile-time launch shapes shared by the kernel families.
#pragma once
#include <algorithm>
#include <cstdint>

namespace ncdp {

// Threads per block of every 1-D kernel: 8 warps, enough for a deterministic
// tree reduction and for 8 resident blocks per SM.
constexpr int kBlockThreads = 256;

// Grids are capped and the kernels grid-stride beyond the cap; 2^16 blocks of
// 256 threads fill any current GPU dozens of times over. The CPU emulation
// (tests/cuda_emu) lowers the cap so that small shapes reach the grid-stride
// loops too.
#if defined(NCDP_EMU_MAX_GRID_BLOCKS)
constexpr std::int64_t kMaxGridBlocks = NCDP_EMU_MAX_GRID_BLOCKS;
#else
constexpr std::int64_t kMaxGridBlocks = std::int64_t{1} << 16;
#endif

// Work is split for the largest target, an H100 SXM (132 SMs, 2048 resident
// threads each); the split only affects speed, never results on a given device.
constexpr std::int64_t kTargetSMs = 132;
constexpr std::int64_t kResidentThreadsPerSM = 2048;

constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Blocks for `work_items` items of which one block covers `per_block`.
inline unsigned int grid_blocks(std::int64_t work_items, std::int64_t per_block) {
  return static_cast<unsigned int>(
      std::max<std::int64_t>(1, std::min(ceil_div(work_items, per_block), kMaxGridBlocks)));
}

// Workspace regions start on 256-byte boundaries (the allocation granule of
// cudaMalloc), so every region is aligned for vector access.
constexpr std::int64_t align_bytes(std::int64_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace ncdp
