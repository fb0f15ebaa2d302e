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

// D (16x8) = A (16x4) B (4x8) + C on sm_90's larger FP64 shape (PTX
// mma.sync.m16n8k4 .f64): two m8n8k4 products stacked in m that share B.
// Lane l = 4 g + q holds a0 = A[g][q], a1 = A[g + 8][q], b = B[q][g], and
// d0, d1 = D[g][2q], D[g][2q + 1], d2, d3 = D[g + 8][2q], D[g + 8][2q + 1]
// (PTX's fragment layout; CuTe's SM90_16x8x4_F64F64F64F64_TN reads the same),
// accumulated in place. Why: the H200 ran the Gram kernel's m8n8k4 at 34% of
// an SM's FP64 tensor-core peak; sm_90 issues the same products in half the
// mma instructions (bench/dmma_rate.py measures each shape's rate). Below
// sm_90, and in the CPU emulation, it is the two m8n8k4 products it stands
// for, so the contract is met (and tested) everywhere; the order of a
// product's four terms is the hardware's own either way.
__device__ __forceinline__ void mma_f64_16x8x4(double& d0, double& d1, double& d2, double& d3,
                                               double a0, double a1, double b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(NCDP_CPU_EMULATION)
  asm volatile("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5}, "
               "{%6}, {%0, %1, %2, %3};"
               : "+d"(d0), "+d"(d1), "+d"(d2), "+d"(d3)
               : "d"(a0), "d"(a1), "d"(b));
#else
  mma_f64_8x8x4(d0, d1, a0, b, d0, d1);
  mma_f64_8x8x4(d2, d3, a1, b, d2, d3);
#endif
}

}  // namespace ncdp
