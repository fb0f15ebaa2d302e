// Per-device properties the launchers size their work by, queried once per device.
#pragma once
#include <cstdint>

namespace ncdp {

// L2 cache size in bytes of `device` (0 when the runtime cannot tell).
std::int64_t l2_cache_bytes(int device);

}  // namespace ncdp
