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

// The launch's dynamic shared memory (its third launch argument, in bytes) as
// an array of `type`, 16-byte aligned. Past 48 KiB a launch needs its kernel's
// limit raised first: cudaFuncSetAttribute(kernel,
// cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), up to 227 KiB on sm_90.
#define NCDP_DYNAMIC_SHARED(type, name)                                    \
  extern __shared__ __align__(16) unsigned char ncdp_dynamic_shared_bytes[]; \
  type* const name = reinterpret_cast<type*>(ncdp_dynamic_shared_bytes)

// 16 bytes from global to shared memory without passing through registers
// (cp.async.cg: cached in the L2 only), both addresses 16-byte aligned. The
// copies a thread issues since its last NCDP_CP_ASYNC_COMMIT form a group;
// NCDP_CP_ASYNC_WAIT(n) (n a constant) returns once at most n of its
// committed groups are pending; other threads read the data after a
// __syncthreads that follows the wait. Before sm_80, a plain 16-byte copy.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define NCDP_CP_ASYNC16(shared_destination, global_source)                           \
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"                           \
               :                                                                     \
               : "r"(static_cast<unsigned int>(__cvta_generic_to_shared(shared_destination))), \
                 "l"(global_source)                                                  \
               : "memory")
#define NCDP_CP_ASYNC_COMMIT() asm volatile("cp.async.commit_group;" : : : "memory")
#define NCDP_CP_ASYNC_WAIT(pending) \
  asm volatile("cp.async.wait_group %0;" : : "n"(pending) : "memory")
#else
#define NCDP_CP_ASYNC16(shared_destination, global_source)     \
  (*reinterpret_cast<uint4*>(shared_destination) =             \
       *reinterpret_cast<const uint4*>(global_source))
#define NCDP_CP_ASYNC_COMMIT() ((void)0)
#define NCDP_CP_ASYNC_WAIT(pending) ((void)0)
#endif

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
