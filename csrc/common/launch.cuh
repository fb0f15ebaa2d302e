// The two places where the kernel sources touch the CUDA toolchain itself:
// kernel launches and inline PTX. Every .cu goes through these macros so that
// the same source also compiles with a host C++ compiler against the CPU
// emulation of tests/cuda_emu (docs/architecture.md, "Testing the CUDA code
// without a GPU"), which defines NCDP_CPU_EMULATION and its own versions.
#pragma once

#if !defined(NCDP_CPU_EMULATION)

// NCDP_LAUNCH(grid, block, shared_bytes, stream, kernel<...>)(args...):
// the kernel comes last because its template arguments may hold commas.
#define NCDP_LAUNCH(grid, block, shared_bytes, stream, ...) \
  __VA_ARGS__<<<(grid), (block), (shared_bytes), (stream)>>>

// Named barrier `id` (1..15; 0 is __syncthreads') over `threads` threads, a
// multiple of 32: sync waits for the barrier's phase to complete, arrive counts
// this thread and goes on (PTX bar.sync / bar.arrive). `id` must be a constant
// expression so that ptxas reserves only the barriers used.
#define NCDP_NAMED_BARRIER_SYNC(id, threads) \
  asm volatile("bar.sync %0, %1;" : : "n"(id), "r"(threads) : "memory")
#define NCDP_NAMED_BARRIER_ARRIVE(id, threads) \
  asm volatile("bar.arrive %0, %1;" : : "n"(id), "r"(threads) : "memory")

// Flags handed between the blocks of one launch (clip/dense_one_pass.cu): a
// load with acquire and a store with release semantics at GPU scope on a
// 32-bit word in global memory. The block's other threads are ordered after
// the loading thread by the __syncthreads that follows it, as CUTLASS's
// semaphores do.
#define NCDP_LOAD_ACQUIRE_GPU(ptr) ::ncdp::detail::load_acquire_gpu(ptr)
#define NCDP_STORE_RELEASE_GPU(ptr, value) ::ncdp::detail::store_release_gpu((ptr), (value))

namespace ncdp {
namespace detail {
__device__ __forceinline__ unsigned int load_acquire_gpu(const unsigned int* ptr) {
  unsigned int value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}
__device__ __forceinline__ void store_release_gpu(unsigned int* ptr, unsigned int value) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" : : "l"(ptr), "r"(value) : "memory");
}
}  // namespace detail
}  // namespace ncdp

#endif
