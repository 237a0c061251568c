// What this build of torch_flash._C contains, for `python -m torch_flash info`. A .cu file
// because only nvcc knows the architectures it compiled for (__CUDA_ARCH_LIST__).
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "build_info.h"

namespace torch_flash {

std::vector<std::string> compiled_archs() {
  std::vector<std::string> archs;
#ifdef __CUDA_ARCH_LIST__
  for (int arch : {__CUDA_ARCH_LIST__}) {
    // the build targets compute_90a (wgmma, setmaxnreg): arch-specific, hence the suffix
    archs.push_back("sm_" + std::to_string(arch / 10) + (arch == 900 ? "a" : ""));
  }
#endif
  return archs;
}

std::string cuda_version() {
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
}

}  // namespace torch_flash
