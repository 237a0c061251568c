#pragma once

#include <string>
#include <vector>

namespace torch_flash {

std::vector<std::string> compiled_archs();  // e.g. {"sm_90a"}
std::string cuda_version();                 // the CUDA runtime the kernels were built against

}  // namespace torch_flash
