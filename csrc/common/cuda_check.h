// Host-side helpers shared by every *_host.cpp wrapper: argument validation,
// CUDA error reporting and the device guard. Errors become C++ exceptions that
// pybind11 translates: std::invalid_argument -> ValueError (a bad argument),
// std::runtime_error -> RuntimeError (the CUDA runtime failed).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace ncdp {

// dtype codes of the Python layer.
constexpr int kDtypeFloat32 = 0;
constexpr int kDtypeFloat64 = 1;

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const std::string& what) {
  // Reset the runtime's last-error slot so that a later, unrelated check does
  // not report this (non-sticky) error a second time.
  (void)cudaGetLastError();
  throw std::runtime_error("ncdp_fast: CUDA error in " + what + ": " + cudaGetErrorName(err) +
                           " (" + cudaGetErrorString(err) + ")");
}

inline void check_cuda(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) throw_cuda_error(err, what);
}

// Launches report configuration errors only through cudaGetLastError.
inline void check_launch(const std::string& what) { check_cuda(cudaGetLastError(), what); }

inline void require_non_negative(std::int64_t value, const char* name) {
  if (value < 0) {
    throw std::invalid_argument(std::string("ncdp_fast: ") + name +
                                " must be non-negative, got " + std::to_string(value));
  }
}

// Bytes per element of a dtype code.
inline std::size_t dtype_size(int dtype) {
  if (dtype == kDtypeFloat32) return sizeof(float);
  if (dtype == kDtypeFloat64) return sizeof(double);
  throw std::invalid_argument("ncdp_fast: dtype must be 0 (float32) or 1 (float64), got " +
                              std::to_string(dtype));
}

// a * b for non-negative sizes, refusing products that do not fit in int64
// (the kernels index with int64 and would silently wrap).
inline std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) {
    throw std::invalid_argument(std::string("ncdp_fast: ") + what + " overflows int64");
  }
  return product;
}

// A pointer argument: it must be non-null when the buffer holds elements, and
// aligned to its element type (a misaligned buffer would fault inside a kernel).
inline void require_pointer(std::uintptr_t ptr, bool has_elements, std::size_t alignment,
                            const char* name) {
  if (has_elements && ptr == 0) {
    throw std::invalid_argument(std::string("ncdp_fast: ") + name +
                                " is a null pointer but the buffer is not empty");
  }
  if (ptr % alignment != 0) {
    throw std::invalid_argument(std::string("ncdp_fast: ") + name + " is not aligned to " +
                                std::to_string(alignment) + " bytes");
  }
}

// The first non-zero pointer of a launch's buffers (in argument order, buffers
// without elements passed as 0): the one whose device the launch runs on.
inline std::uintptr_t first_pointer(std::initializer_list<std::uintptr_t> pointers) {
  for (std::uintptr_t p : pointers) {
    if (p != 0) return p;
  }
  return 0;
}

// A device pointer that crossed from Python as an integer, at its element type.
template <typename T>
T* typed(std::uintptr_t ptr) {
  return reinterpret_cast<T*>(ptr);
}

inline cudaStream_t as_stream(std::uintptr_t stream) {
  // 0 is the legacy default stream; 1 and 2 are cudaStreamLegacy and
  // cudaStreamPerThread, the same values __cuda_array_interface__ uses.
  return reinterpret_cast<cudaStream_t>(stream);
}

// Whether `stream` is capturing a CUDA graph (an invalidated capture counts:
// the capture is still open).
inline bool stream_capturing(std::uintptr_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(as_stream(stream), &status);
  if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice) {
    // No driver or no device: nothing can be capturing, and a launcher's own
    // argument checks, which follow, say what is wrong with its call.
    (void)cudaGetLastError();
    return false;
  }
  check_cuda(err, "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

// A launcher that draws from the Philox stream (noise, subsampling) passes
// its seed and offset by value: a graph that captured the launch would draw
// the same numbers again at every replay -- noise reused, a privacy loss no
// accountant sees, since no Python runs on a replay to account the step. So
// such a launch is refused on a capturing stream, first, before its arguments
// are read (docs/architecture.md, "CUDA graphs").
inline void refuse_graph_capture(std::uintptr_t stream, const char* launcher) {
  if (stream_capturing(stream)) {
    throw std::invalid_argument(
        std::string("ncdp_fast: ") + launcher +
        ": stream: expected a stream that is not capturing a CUDA graph, got one that is "
        "capturing: this launch draws from the Philox stream at a seed and offset fixed "
        "when it is queued, so every replay of the graph would draw the same numbers again "
        "(noise reused) and no replay would be accounted. Refused before this launch was "
        "queued; run the op outside the capture (eagerly)");
  }
}

// Makes the device that owns `ptr` current for the guard's lifetime and restores
// the caller's device afterwards, so that a launch on a tensor of cuda:1 works
// whatever device the Python thread had selected.
class DeviceGuard {
 public:
  DeviceGuard(std::uintptr_t ptr, const char* name) {
    // An error left pending by someone else's earlier call must not be blamed
    // on the launch this guard protects.
    (void)cudaGetLastError();
    cudaPointerAttributes attributes{};
    check_cuda(cudaPointerGetAttributes(&attributes, reinterpret_cast<const void*>(ptr)),
               std::string("cudaPointerGetAttributes(") + name + ")");
    if (attributes.type == cudaMemoryTypeUnregistered) {
      throw std::invalid_argument(std::string("ncdp_fast: ") + name +
                                  " is not CUDA memory (a host pointer reached a CUDA kernel)");
    }
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (attributes.device >= 0 && attributes.device != previous_) {
      check_cuda(cudaSetDevice(attributes.device), "cudaSetDevice");
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace ncdp
