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

}  // namespace ncdp
