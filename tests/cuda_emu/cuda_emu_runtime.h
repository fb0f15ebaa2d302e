// The host half of the CUDA runtime API that csrc/'s launchers and wrappers
// call (*_host.cpp, common/device.cu, common/launcher_probe.cpp), emulated on
// the CPU so that the whole native module, not only its kernels, runs without
// a GPU: the emulated device behind `NCDP_CUDA_EMULATION=1`
// (docs/architecture.md, "The emulated CUDA device").
//
// Model: one device (0) whose memory is the host's: every pointer is device
// memory of device 0, cudaMalloc is an aligned host allocation, every stream is
// the one synchronous queue of the emulator (a launch has finished when it
// returns). Errors are sticky per host thread as in the runtime:
// cudaGetLastError returns and clears the last one. The L2 size is small
// (NCDP_EMU_L2_BYTES, default 2 MiB) so that the kernels' L2-sized chunking
// is reached by small shapes.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

struct CUstream_st;
using cudaStream_t = CUstream_st*;

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorNoDevice = 100,
  cudaErrorInsufficientDriver = 35,
};
using cudaError = cudaError_t;

enum cudaMemoryType {
  cudaMemoryTypeUnregistered = 0,
  cudaMemoryTypeHost = 1,
  cudaMemoryTypeDevice = 2,
  cudaMemoryTypeManaged = 3,
};

struct cudaPointerAttributes {
  cudaMemoryType type;
  int device;
  void* devicePointer;
  void* hostPointer;
};

struct cudaDeviceProp {
  char name[256];
};

enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrL2CacheSize = 89 };

enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};

enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

#define cudaStreamLegacy (reinterpret_cast<cudaStream_t>(0x1))
#define cudaStreamPerThread (reinterpret_cast<cudaStream_t>(0x2))

// The emulated device's name, as `ncdp-fast info` and the tests see it.
#define NCDP_EMU_DEVICE_NAME "ncdp_fast emulated CUDA device (CPU)"
#define NCDP_EMU_DEFAULT_L2_BYTES (2 * 1024 * 1024)

namespace ncdp_emu {

inline cudaError_t& last_error() {
  thread_local cudaError_t error = cudaSuccess;
  return error;
}

inline cudaError_t record(cudaError_t error) {
  if (error != cudaSuccess) last_error() = error;
  return error;
}

inline int l2_bytes() {
  static const int bytes = [] {
    const char* text = std::getenv("NCDP_EMU_L2_BYTES");
    const long value = text != nullptr ? std::atol(text) : 0;
    return value > 0 ? static_cast<int>(value) : NCDP_EMU_DEFAULT_L2_BYTES;
  }();
  return bytes;
}

}  // namespace ncdp_emu

inline cudaError_t cudaGetLastError() {
  const cudaError_t error = ::ncdp_emu::last_error();
  ::ncdp_emu::last_error() = cudaSuccess;
  return error;
}

inline const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
  }
  return "cudaErrorUnknown";
}

inline const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument (emulated)";
    case cudaErrorInvalidDevice: return "invalid device ordinal (emulated: device 0 only)";
    default: return "error of the emulated CUDA device";
  }
}

inline cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

inline cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : ::ncdp_emu::record(cudaErrorInvalidDevice);
}

inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* properties, int device) {
  if (device != 0) return ::ncdp_emu::record(cudaErrorInvalidDevice);
  std::memset(properties, 0, sizeof(*properties));
  std::strncpy(properties->name, NCDP_EMU_DEVICE_NAME, sizeof(properties->name) - 1);
  return cudaSuccess;
}

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  if (device != 0) return ::ncdp_emu::record(cudaErrorInvalidDevice);
  if (attribute == cudaDevAttrMultiProcessorCount) {
    // One multiprocessor: a launcher that sizes its grid by residency
    // (mix/mix.cu) then asks for the fewest blocks, and the emulator's own
    // grid cap (NCDP_EMU_MAX_GRID_BLOCKS) still has blocks share rows.
    *value = 1;
    return cudaSuccess;
  }
  if (attribute != cudaDevAttrL2CacheSize) return ::ncdp_emu::record(cudaErrorInvalidValue);
  *value = ::ncdp_emu::l2_bytes();
  return cudaSuccess;
}

// One block of any valid size is resident at a time (the emulator runs the
// blocks of a launch one after another); the kernel itself is not inspected.
template <typename Kernel>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel,
                                                                 int block_threads,
                                                                 std::size_t shared_bytes) {
  (void)shared_bytes;
  if (block_threads <= 0 || block_threads > 1024) return ::ncdp_emu::record(cudaErrorInvalidValue);
  *blocks = 1;
  return cudaSuccess;
}

namespace ncdp_emu {
// Dynamic shared memory a launch may ask for: 48 KiB, or up to the sm_90
// opt-in limit once cudaFuncSetAttribute raised the kernel's own (as on the
// hardware, where a launch past its kernel's limit fails).
constexpr std::size_t kDefaultDynamicShared = 48u * 1024u;
constexpr std::size_t kMaxDynamicShared = 227u * 1024u;

inline std::mutex& dynamic_shared_mutex() {
  static std::mutex mutex;
  return mutex;
}
inline std::map<const void*, std::size_t>& dynamic_shared_limits() {
  static std::map<const void*, std::size_t> limits;
  return limits;
}
inline std::size_t dynamic_shared_limit(const void* kernel) {
  std::lock_guard<std::mutex> lock(dynamic_shared_mutex());
  const auto found = dynamic_shared_limits().find(kernel);
  return found == dynamic_shared_limits().end() ? kDefaultDynamicShared : found->second;
}
}  // namespace ncdp_emu

template <typename... Params>
inline cudaError_t cudaFuncSetAttribute(void (*kernel)(Params...), cudaFuncAttribute attribute,
                                        int value) {
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      static_cast<std::size_t>(value) > ::ncdp_emu::kMaxDynamicShared) {
    return ::ncdp_emu::record(cudaErrorInvalidValue);
  }
  std::lock_guard<std::mutex> lock(::ncdp_emu::dynamic_shared_mutex());
  ::ncdp_emu::dynamic_shared_limits()[reinterpret_cast<const void*>(kernel)] =
      std::max(::ncdp_emu::kDefaultDynamicShared, static_cast<std::size_t>(value));
  return cudaSuccess;
}

// No toolkit or driver is behind the emulation: both versions read 0.
inline cudaError_t cudaRuntimeGetVersion(int* version) {
  *version = 0;
  return cudaSuccess;
}

inline cudaError_t cudaDriverGetVersion(int* version) {
  *version = 0;
  return cudaSuccess;
}

// Every address is the emulated device's memory: the host is its memory.
inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
  attributes->type = cudaMemoryTypeDevice;
  attributes->device = 0;
  attributes->devicePointer = const_cast<void*>(ptr);
  attributes->hostPointer = const_cast<void*>(ptr);
  return cudaSuccess;
}

// 256-byte granules, as cudaMalloc's.
inline cudaError_t cudaMalloc(void** ptr, std::size_t bytes) {
  *ptr = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
  return *ptr != nullptr ? cudaSuccess : ::ncdp_emu::record(cudaErrorMemoryAllocation);
}

inline cudaError_t cudaFree(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}

inline cudaError_t cudaMemset(void* ptr, int value, std::size_t bytes) {
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}

// Launches run to completion before they return.
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

// The emulator's one queue never records a graph; NCDP_EMU_STREAM_CAPTURING=1
// makes every stream report an active capture (read at each call, so a test
// can set it around one op), to reach the launchers' refusal of a capturing
// stream (common/cuda_check.h, refuse_graph_capture) without a GPU.
inline cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* status) {
  const char* text = std::getenv("NCDP_EMU_STREAM_CAPTURING");
  *status = text != nullptr && std::strcmp(text, "1") == 0 ? cudaStreamCaptureStatusActive
                                                           : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
