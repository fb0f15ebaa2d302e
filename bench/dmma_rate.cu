// The FP64 tensor cores' rate per mma shape (bench/dmma_rate.py): the Gram
// kernel (csrc/clip/gram_f64.cu) multiplied with mma.m8n8k4, the one f64 shape
// before sm_90, when the H200 measured it at 34% of an SM's FP64 tensor-core
// peak with one block an SM; sm_90 added m16n8k4, m16n8k8 and m16n8k16, and
// the kernel takes m16n8k4 there now. The rates say what each shape is worth.
//
// Each warp runs `iters` rounds of kChains independent mma chains on
// register operands (no memory traffic, no dependence within a round), then
// writes its accumulators so nothing is optimised away. Prints one JSON line
// a (shape, blocks per SM) with the FLOPs and the time of the timed launch.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace {

// Independent accumulators a warp (latency hidden): 8 of m8n8k4's 2 doubles a
// lane, 4 of m16n8's 4, so that both stay near the Gram kernel's 80 registers
// and several blocks of 8 warps fit an SM.
constexpr int kChains8 = 8;
constexpr int kChains16 = 4;
constexpr int kWarps = 8;      // warps a block

// A failed CUDA call throws; main reports it and returns 1 (no exit or abort
// in host code).
#define CHECK(call)                                                                   \
  do {                                                                                \
    cudaError_t err = (call);                                                         \
    if (err != cudaSuccess) {                                                         \
      throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorString(err));  \
    }                                                                                 \
  } while (0)

__global__ void m8n8k4(long long iters, double seed, double* out) {  // out: [threads, 2]
#if __CUDA_ARCH__ >= 800
  double a = seed + threadIdx.x, b = seed - threadIdx.x;
  double c[kChains8][2] = {};
#pragma unroll 1
  for (long long i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < kChains8; ++j) {
      asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
                   : "+d"(c[j][0]), "+d"(c[j][1])
                   : "d"(a), "d"(b));
    }
  }
  double s0 = 0, s1 = 0;
#pragma unroll
  for (int j = 0; j < kChains8; ++j) {
    s0 += c[j][0];
    s1 += c[j][1];
  }
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  out[2 * t] = s0;
  out[2 * t + 1] = s1;
#endif
}

// m16n8k{4,8,16}: A holds K/2 doubles a lane, B K/4, C and D 4.
template <int K>
__global__ void m16n8(long long iters, double seed, double* out) {  // out: [threads, 2]
#if __CUDA_ARCH__ >= 900
  double a[K / 2], b[K / 4];
#pragma unroll
  for (int i = 0; i < K / 2; ++i) a[i] = seed + threadIdx.x + i;
#pragma unroll
  for (int i = 0; i < K / 4; ++i) b[i] = seed - threadIdx.x - i;
  double c[kChains16][4] = {};
#pragma unroll 1
  for (long long i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < kChains16; ++j) {
      if constexpr (K == 4) {
        asm volatile(
            "mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
            "{%0,%1,%2,%3};"
            : "+d"(c[j][0]), "+d"(c[j][1]), "+d"(c[j][2]), "+d"(c[j][3])
            : "d"(a[0]), "d"(a[1]), "d"(b[0]));
      } else if constexpr (K == 8) {
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+d"(c[j][0]), "+d"(c[j][1]), "+d"(c[j][2]), "+d"(c[j][3])
            : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
      } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, "
            "{%4,%5,%6,%7,%8,%9,%10,%11}, {%12,%13,%14,%15}, {%0,%1,%2,%3};"
            : "+d"(c[j][0]), "+d"(c[j][1]), "+d"(c[j][2]), "+d"(c[j][3])
            : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]),
              "d"(a[7]), "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
      }
    }
  }
  double s0 = 0, s1 = 0;
#pragma unroll
  for (int j = 0; j < kChains16; ++j) {
    s0 += c[j][0] + c[j][2];
    s1 += c[j][1] + c[j][3];
  }
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  out[2 * t] = s0;
  out[2 * t + 1] = s1;
#endif
}

template <typename Kernel>
void measure(const char* shape, double flops_per_mma, int chains, Kernel kernel, int sms,
             int per_sm, long long iters) {
  const int blocks = sms * per_sm, threads = 32 * kWarps;
  double* out = nullptr;
  CHECK(cudaMalloc(&out, sizeof(double) * 2 * blocks * threads));
  kernel<<<blocks, threads>>>(iters / 10, 1.0, out);  // warm-up (clocks up)
  CHECK(cudaGetLastError());
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  CHECK(cudaEventRecord(t0));
  kernel<<<blocks, threads>>>(iters, 1.0, out);
  CHECK(cudaEventRecord(t1));
  CHECK(cudaEventSynchronize(t1));
  CHECK(cudaGetLastError());
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, t0, t1));
  const double flops = flops_per_mma * chains * iters * kWarps * blocks;
  std::printf("{\"shape\": \"%s\", \"blocks_per_sm\": %d, \"warps_per_sm\": %d, "
              "\"flops\": %.0f, \"ms\": %.6f}\n",
              shape, per_sm, per_sm * kWarps, flops, ms);
  CHECK(cudaEventDestroy(t0));
  CHECK(cudaEventDestroy(t1));
  CHECK(cudaFree(out));
}

}  // namespace

int run(long long iters) {
  int dev = 0, sms = 0, major = 0, minor = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  std::printf("{\"sms\": %d, \"compute_capability\": \"%d.%d\"}\n", sms, major, minor);
  for (const int per_sm : {1, 2, 3, 4}) {
    // Each launch does the same FLOPs a block: iterations scaled by the shape.
    measure("m8n8k4", 2.0 * 8 * 8 * 4, kChains8, m8n8k4, sms, per_sm, iters);
    if (major >= 9) {
      measure("m16n8k4", 2.0 * 16 * 8 * 4, kChains16, m16n8<4>, sms, per_sm, iters);
      measure("m16n8k8", 2.0 * 16 * 8 * 8, kChains16, m16n8<8>, sms, per_sm, iters / 2);
      measure("m16n8k16", 2.0 * 16 * 8 * 16, kChains16, m16n8<16>, sms, per_sm, iters / 4);
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  const long long iters = argc > 1 ? std::atoll(argv[1]) : 1000;
  try {
    return run(iters);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dmma_rate: %s\n", e.what());
    return 1;
  }
}
