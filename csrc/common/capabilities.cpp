#include "common/capabilities.h"

namespace ncdp {

bool cuda_compiled() {
#ifdef NCDP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::string cuda_archs() { return NCDP_CUDA_ARCHS; }

#ifndef NCDP_BUILD_NOTE
#define NCDP_BUILD_NOTE ""
#endif
std::string build_note() { return NCDP_BUILD_NOTE; }

}  // namespace ncdp
