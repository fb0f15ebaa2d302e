// What this build of ncdp_fast._C can do; safe to call on a machine with no
// GPU and no driver (nothing here touches the CUDA runtime unless it was
// compiled in, and then only through calls that report errors as values).
#pragma once
#include <string>
#include <tuple>

namespace ncdp {

bool cuda_compiled();
std::string cuda_archs();
// Why the CUDA kernels are missing ('' when they were compiled in).
std::string build_note();

#ifdef NCDP_WITH_CUDA
// 0 when there is no driver or no device; never throws.
int cuda_device_count();
std::string cuda_device_name(int device);
// (runtime version, driver version) as CUDA encodes them (1000*major + 10*minor);
// the driver version is 0 when no driver is installed.
std::tuple<int, int> cuda_versions();
#endif

}  // namespace ncdp
