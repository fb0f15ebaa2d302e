// NCDP_HOST_DEVICE: the marker of helpers that kernels and host launchers both
// call. A helper a launcher needs must carry it, never plain __device__: nvcc
// compiles a host template that calls a __device__-only function without a
// diagnostic and gives it a body that calls exit(1), so the first launch ends
// the Python process (issue 14). tests/test_native_guard.py looks for such
// bodies in the built objects.

#pragma once

#if defined(__CUDACC__)
#define NCDP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define NCDP_HOST_DEVICE inline
#endif

// NCDP_UNROLL: `#pragma unroll` where nvcc compiles device code; nothing in the
// host and emulated builds (g++ warns on the unknown pragma).
#if defined(__CUDA_ARCH__)
#define NCDP_UNROLL _Pragma("unroll")
#else
#define NCDP_UNROLL
#endif
