// The pybind11 module torch_flash._C. Importing it registers the CUDA kernels
// (TORCH_LIBRARY_IMPL blocks in the op folders); the module itself only answers build queries.
#include <torch/extension.h>

#include "build_info.h"

#ifndef FLASH_CUTLASS_VERSION
#define FLASH_CUTLASS_VERSION "unknown"
#endif

namespace {

// Head dims with forward kernels (backward: those up to 128, attention_bwd_sm90_hdim*.cu).
std::vector<int> built_hdims(bool backward) {
  std::vector<int> hdims;
#ifdef FLASH_HDIM_64
  hdims.push_back(64);
#endif
#ifdef FLASH_HDIM_128
  hdims.push_back(128);
#endif
#ifdef FLASH_HDIM_256
  if (!backward) hdims.push_back(256);
#endif
  return hdims;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch-flash CUDA kernels (registered as torch.ops.flash CUDA implementations on import)";
  m.def(
      "build_info",
      [] {
        pybind11::dict info;
        info["archs"] = torch_flash::compiled_archs();
        info["hdims"] = built_hdims(false);
        info["backward_hdims"] = built_hdims(true);
        info["cuda_version"] = torch_flash::cuda_version();
        info["cutlass_version"] = std::string(FLASH_CUTLASS_VERSION);
        info["ops"] = std::vector<std::string>{"flash::attention_fwd_sm90", "flash::attention_bwd_sm90"};
        return info;
      },
      "dict: archs, hdims, backward_hdims, cuda_version, cutlass_version, ops (flash ops with CUDA kernels here)");
}
