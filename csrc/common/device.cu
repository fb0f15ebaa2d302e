// Device discovery for ncdp_fast.info() and per-device properties for launchers.
// Everything here reports failure as a value or a C++ exception; nothing aborts
// on a machine without a driver.
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "common/capabilities.h"
#include "common/cuda_check.h"
#include "common/device_info.h"

namespace ncdp {

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    // No driver or no device: clear the error so later calls start clean.
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

std::string cuda_device_name(int device) {
  cudaDeviceProp properties{};
  check_cuda(cudaGetDeviceProperties(&properties, device),
             "cudaGetDeviceProperties(device=" + std::to_string(device) + ")");
  return std::string(properties.name);
}

std::tuple<int, int> cuda_versions() {
  int runtime = 0;
  int driver = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  (void)cudaGetLastError();
  return std::make_tuple(runtime, driver);
}

std::int64_t l2_cache_bytes(int device) {
  // Launchers ask on every call; the attribute query is cheap but not free, and
  // the answer never changes for a device.
  static std::mutex mutex;
  static std::map<int, std::int64_t> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int bytes = 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, device) != cudaSuccess) {
    (void)cudaGetLastError();
    bytes = 0;
  }
  cache.emplace(device, static_cast<std::int64_t>(bytes));
  return bytes;
}

}  // namespace ncdp
