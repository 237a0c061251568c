// Hopper attention forward: CUTLASS's warp-specialised FMHA (examples/88_hopper_fmha of the
// nvidia-cutlass package: TMA loads of Q/K/V tiles, wgmma from shared memory, a producer
// warpgroup and two consumer warpgroups with register reallocation, softmax of one tile
// overlapped with the other warpgroup's matmuls), instantiated for torch-flash's layouts,
// with the softmax scale as an argument and a launch that follows the caller's stream.
#pragma once

#include <algorithm>
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

// Schedules: which CTAs exist and in which order they take (query tile, batch, head).
template <class Scheduler_, bool kPersistent_>
struct Schedule {
  using Scheduler = Scheduler_;
  static constexpr bool kPersistent = kPersistent_;  // persistent CTAs also load Q from a warp of its own
};
// Persistent CTAs (one per SM) take units of work in turn; a unit is the query tiles m and
// M - 1 - m of one (batch, head), the longer first. Under a causal mask tile m reads m + 1 key
// tiles, so every unit reads M + 1 and equal units keep the SMs evenly busy to the end (CTAs
// taking single tiles in turn leave some idle: 0.94x cuDNN at D=128, S=16k). Units run pair
// first, so the CTAs at work share the K/V of a few heads in L2.
struct PairedTileScheduler {
  struct Params {
    int num_units;
    int m_blocks;
    cutlass::FastDivmod divmod_pair, divmod_b, divmod_h;
    cutlass::KernelHardwareInfo hw_info;
  };

  int unit;
  bool second = false;  // on the unit's shorter tile
  Params params;

  CUTLASS_DEVICE explicit PairedTileScheduler(Params const& p) : unit(blockIdx.x), params(p) {}

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& problem, cutlass::KernelHardwareInfo hw,
                                        ClusterShape const& cluster, TileShape const& tile) {
    int m_blocks = cutlass::round_up(ceil_div(size<2>(problem), size<0>(tile)), size<0>(cluster));
    int pairs = (m_blocks + 1) / 2;
    if (hw.sm_count <= 0) hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
    return {pairs * int(size<0>(problem)) * int(size<1>(problem)), m_blocks, cutlass::FastDivmod(pairs),
            cutlass::FastDivmod(size<0>(problem)), cutlass::FastDivmod(size<1>(problem)), hw};
  }

  static dim3 get_grid_shape(Params const& p) { return dim3(std::min(p.num_units, p.hw_info.sm_count), 1, 1); }

  CUTLASS_DEVICE bool is_valid() const { return unit < params.num_units; }

  CUTLASS_DEVICE int pair() const {
    int rest, pair;
    params.divmod_pair(rest, pair, unit);
    return pair;
  }

  CUTLASS_DEVICE auto get_block_coord() const {
    int rest, pair, bidb, bidh;
    params.divmod_pair(rest, pair, unit);
    params.divmod_b(rest, bidb, rest);
    params.divmod_h(rest, bidh, rest);
    return make_coord(second ? pair : params.m_blocks - 1 - pair, _0{}, make_coord(bidb, bidh));
  }

  CUTLASS_DEVICE PairedTileScheduler& operator++() {
    int m = pair();
    if (!second && params.m_blocks - 1 - m != m) {  // the middle tile of an odd count is its own pair
      second = true;
    } else {
      second = false;
      unit += gridDim.x;
    }
    return *this;
  }
};

using Cooperative = Schedule<cutlass::fmha::kernel::IndividualTileScheduler, false>;  // a CTA per tile
using Pingpong = Schedule<cutlass::fmha::kernel::PersistentTileScheduler, true>;  // one CTA per SM
using Paired = Schedule<PairedTileScheduler, true>;  // one CTA per SM, causal tiles in pairs

// One kernel configuration: tile (query rows per CTA, keys per step, head dim), schedule and
// 88_hopper_fmha options (Option<Tag::kStagesKV, _4>, Option<Tag::kNumMmaWarpGroups, _3>, ...).
template <class TileShape_, class Schedule_, class... Options_>
struct Config {
  using TileShape = TileShape_;
  using Schedule = Schedule_;
};

template <class Element, class Fusion, class Config>
struct FwdKernel;

template <class Element, class Fusion, class TileShape, class Schedule, class... Options>
struct FwdKernel<Element, Fusion, Config<TileShape, Schedule, Options...>> {
  using Persistent = Option<Tag::kIsPersistent, cute::bool_constant<Schedule::kPersistent>>;
  using Mainloop = MainloopWithScale<cutlass::fmha::collective::FmhaMainloopTmaWarpSpecialized<
      Element, float, float, TileShape, Stride, Stride, Stride, Fusion, Persistent, Options...>>;
  using Epilogue = cutlass::fmha::collective::FmhaFwdEpilogue<Element, float, typename Mainloop::TileShapePV>;
  using Kernel = cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<
      Mainloop, Epilogue, typename Schedule::Scheduler, Persistent,
      Option<Tag::kLoadsQSeparately, cute::bool_constant<Schedule::kPersistent>>, Options...>;
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

template <class Element, class Fusion, class Config>
void launch(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  using Kernel = typename FwdKernel<Element, Fusion, Config>::Kernel;
  using Mainloop = typename FwdKernel<Element, Fusion, Config>::Mainloop;
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

// Keys from which a head dim's long-sequence configurations run (D=64's three warpgroups lead
// from 2k keys: scripts/sweep_attention_sm90.py).
constexpr int kLongKeys = 2048;

// Every dtype x mask variant of one head dim: without a mask (ResidualFusion masks the keys
// past Sk in the last key tile, and only there) and with the causal mask, one configuration
// for short and one for long key sequences each (the same type builds once).
template <class Element, class FullConfig, class LongFullConfig, class CausalConfig, class LongCausalConfig>
void dispatch_mask(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  using cutlass::fmha::collective::CausalFusion;
  using cutlass::fmha::collective::ResidualFusion;
  const bool long_keys = p.seqlen_k >= kLongKeys;
  if (p.causal && long_keys) launch<Element, CausalFusion, LongCausalConfig>(p, stream);
  else if (p.causal) launch<Element, CausalFusion, CausalConfig>(p, stream);
  else if (long_keys) launch<Element, ResidualFusion, LongFullConfig>(p, stream);
  else launch<Element, ResidualFusion, FullConfig>(p, stream);
}

template <class... Configs>  // FullConfig, LongFullConfig, CausalConfig, LongCausalConfig
void dispatch(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  if (p.bf16) dispatch_mask<cutlass::bfloat16_t, Configs...>(p, stream);
  else dispatch_mask<cutlass::half_t, Configs...>(p, stream);
}

}  // namespace torch_flash::sm90
