// What the Hopper attention kernels (attention_fwd_sm90.cuh, attention_bwd_sm90.cuh) share:
// the softmax scale as an argument of 88_hopper_fmha's mainloops, and the launch helpers.
#pragma once

#include <cmath>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"

namespace torch_flash::sm90 {

// 88_hopper_fmha's mainloops (forward and backward) fix the scale at 1/sqrt(D); this one takes it
// from the arguments.
template <class Base>
struct MainloopWithScale : Base {
  struct Arguments : Base::Arguments {
    float scale;
  };

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem, Arguments const& args) {
    return Base::can_implement(problem, args);
  }

  template <class ProblemShape>
  static typename Base::Params to_underlying_arguments(ProblemShape const& problem, Arguments const& args,
                                                       void* workspace) {
    auto params = Base::to_underlying_arguments(problem, args, workspace);
    params.scale_softmax = args.scale;
    params.scale_softmax_log2 = args.scale * static_cast<float>(M_LOG2E);
    return params;
  }
};

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash.attention (sm90 kernel): ") + what + ": " +
                             cudaGetErrorString(err));
  }
}

// Raises the kernel's dynamic shared memory limit once per device (a CUDA function attribute
// is per device context).
template <class Kernel>
void allow_shared_memory(int device) {
  static std::once_flag flags[64];
  if (device < 0 || device >= 64) throw std::runtime_error("flash.attention (sm90 kernel): device index out of range");
  std::call_once(flags[device], [] {
    check_cuda(cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    Kernel::SharedStorageSize),
               "cudaFuncSetAttribute");
  });
}

}  // namespace torch_flash::sm90
