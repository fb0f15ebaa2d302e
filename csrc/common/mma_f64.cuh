// One warp's float64 matrix multiply-add D (8x8) = A (8x4) B (4x8) + C, the
// shape of the FP64 tensor cores (PTX mma.sync.m8n8k4 .f64, sm_80 and later).
// Lane l = 4 g + q (g = l / 4, q = l % 4) holds the fragments of PTX's
// layout: a = A[g][q], b = B[q][g], c0, c1 = C[g][2q], C[g][2q + 1], and gets
// d0, d1 = D[g][2q], D[g][2q + 1]. Every lane of the warp must call it.
//
// Below sm_80 and in the CPU emulation (tests/cuda_emu) the same contract is
// met with shuffles and FMAs in k order, each rounded once; the tensor
// cores' order of the four products is their own, so results may differ in
// the last bits: callers bound the error of any order (a float64 dot
// product of length n within gamma_n of the sum of |products|).
#pragma once

#include "common/host_device.h"

namespace ncdp {

__device__ __forceinline__ void mma_f64_8x8x4(double& d0, double& d1, double a, double b,
                                              double c0, double c1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(NCDP_CPU_EMULATION)
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%4, %5};"
               : "=d"(d0), "=d"(d1)
               : "d"(a), "d"(b), "d"(c0), "d"(c1));
#else
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, q = lane % 4;
  // A[g][k] lives in lane 4 g + k; B[k][col] in lane 4 col + k.
#if defined(NCDP_CPU_EMULATION)
  // Every lane's a and b in two exchanges (twelve shuffles would each be a
  // rendezvous of the emulated warp).
  double as[32], bs[32];
  ::ncdp_emu::exchange_all(0xffffffffu, a, as, "mma_f64_8x8x4");
  ::ncdp_emu::exchange_all(0xffffffffu, b, bs, "mma_f64_8x8x4");
#endif
  double x0 = c0, x1 = c1;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#if defined(NCDP_CPU_EMULATION)
    const double ak = as[4 * g + k], b0 = bs[4 * (2 * q) + k], b1 = bs[4 * (2 * q + 1) + k];
#else
    const double ak = __shfl_sync(0xffffffffu, a, 4 * g + k);
    const double b0 = __shfl_sync(0xffffffffu, b, 4 * (2 * q) + k);
    const double b1 = __shfl_sync(0xffffffffu, b, 4 * (2 * q + 1) + k);
#endif
    x0 = fma(ak, b0, x0);
    x1 = fma(ak, b1, x1);
  }
  d0 = x0;
  d1 = x1;
#endif
}

}  // namespace ncdp
