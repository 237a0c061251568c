// Hopper attention forward: CUTLASS's warp-specialised FMHA (examples/88_hopper_fmha of the
// nvidia-cutlass package: TMA loads of Q/K/V tiles, wgmma from shared memory, a producer
// warpgroup and two consumer warpgroups with register reallocation, softmax of one tile
// overlapped with the other warpgroup's matmuls), instantiated for torch-flash's layouts,
// with the softmax scale as an argument and a launch that follows the caller's stream.
#pragma once

#include <cmath>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/kernel_hardware_info.h"
#include "cute/tensor.hpp"

#include "88_hopper_fmha/collective/fmha_fusion.hpp"
#include "88_hopper_fmha/kernel/fmha_kernel_builder.hpp"

#include "attention/attention_fwd_sm90.h"

namespace torch_flash::sm90 {

using namespace cute;
using cutlass::fmha::kernel::Option;
using cutlass::fmha::kernel::Tag;

// (row, 1, (batch, head)) element strides, as the FMHA collectives index their tensors.
using Stride = cute::tuple<int, _1, cute::tuple<int, int>>;
using StrideLse = cute::tuple<_1, cute::tuple<int, int>>;

// The example mainloop fixes the scale at 1/sqrt(D); this one takes it from the arguments.
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

struct Cooperative {};  // one CTA per (query tile, batch, head)
struct Pingpong {};     // persistent CTAs, Q loaded by its own producer warp

template <class Element, class TileShape, class Fusion, class Schedule>
struct FwdKernel {
  static constexpr bool kPersistent = std::is_same_v<Schedule, Pingpong>;
  using Mainloop = MainloopWithScale<cutlass::fmha::collective::FmhaMainloopTmaWarpSpecialized<
      Element, float, float, TileShape, Stride, Stride, Stride, Fusion,
      Option<Tag::kIsPersistent, cute::bool_constant<kPersistent>>>>;
  using Epilogue = cutlass::fmha::collective::FmhaFwdEpilogue<Element, float, typename Mainloop::TileShapePV>;
  using Scheduler = std::conditional_t<kPersistent, cutlass::fmha::kernel::PersistentTileScheduler,
                                       cutlass::fmha::kernel::IndividualTileScheduler>;
  using Kernel = cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<
      Mainloop, Epilogue, Scheduler, Option<Tag::kIsPersistent, cute::bool_constant<kPersistent>>,
      Option<Tag::kLoadsQSeparately, cute::bool_constant<kPersistent>>>;
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

template <class Element, class TileShape, class Fusion, class Schedule>
void launch(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  using Kernel = typename FwdKernel<Element, TileShape, Fusion, Schedule>::Kernel;
  using Mainloop = typename FwdKernel<Element, TileShape, Fusion, Schedule>::Mainloop;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = p.device;
  hw.sm_count = p.sm_count;
  typename Kernel::Arguments args{
      {p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.head_dim},
      typename Mainloop::Arguments{
          {static_cast<const Element*>(p.q), Stride{p.q_row_stride, _1{}, {p.q_batch_stride, p.q_head_stride}},
           static_cast<const Element*>(p.k), Stride{p.k_row_stride, _1{}, {p.k_batch_stride, p.k_head_stride}},
           static_cast<const Element*>(p.v), Stride{p.v_row_stride, _1{}, {p.v_batch_stride, p.v_head_stride}}},
          p.scale},
      {static_cast<Element*>(p.out), Stride{p.out_row_stride, _1{}, {p.out_batch_stride, p.out_head_stride}},
       p.lse, StrideLse{_1{}, {p.lse_batch_stride, p.lse_head_stride}}},
      hw};
  if (!Kernel::can_implement(args)) {
    throw std::runtime_error("flash.attention (sm90 kernel): unsupported problem (head dim " +
                             std::to_string(p.head_dim) + ", seqlen_q " + std::to_string(p.seqlen_q) + ")");
  }
  auto params = Kernel::to_underlying_arguments(args, nullptr);
  allow_shared_memory<Kernel>(p.device);
  cutlass::device_kernel<Kernel>
      <<<Kernel::get_grid_shape(params), Kernel::get_block_shape(), Kernel::SharedStorageSize, stream>>>(params);
  check_cuda(cudaGetLastError(), "kernel launch");
}

// Every dtype x mask variant of one tile configuration. Measured on an H200 (2026-11-21, bf16,
// 32k tokens): ping-pong leads without a mask (D=128, S=16k: 619 vs 535 TFLOP/s), cooperative
// with the causal one (564 vs 500), whose per-tile trip counts differ between query tiles.
template <class TileShape, class NonCausalSchedule>
void dispatch(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  using cutlass::fmha::collective::CausalFusion;
  // ResidualFusion masks the keys past Sk in the last key tile (and only there)
  using cutlass::fmha::collective::ResidualFusion;
  if (p.bf16) {
    if (p.causal) launch<cutlass::bfloat16_t, TileShape, CausalFusion, Cooperative>(p, stream);
    else launch<cutlass::bfloat16_t, TileShape, ResidualFusion, NonCausalSchedule>(p, stream);
  } else {
    if (p.causal) launch<cutlass::half_t, TileShape, CausalFusion, Cooperative>(p, stream);
    else launch<cutlass::half_t, TileShape, ResidualFusion, NonCausalSchedule>(p, stream);
  }
}

}  // namespace torch_flash::sm90
