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

// 88_hopper_fmha's mainloop with the K/V stages handed back to the producer as soon as the
// GEMMs reading them have completed: the example releases K_j and V_{j-1} only after the
// softmax of tile j and the issue of P_j V_j, so the producer's refill waits a softmax longer
// than it must (five stages are all the shared memory holds; fewer measured 5-15% slower).
template <class Base, class Fusion>
struct EarlyReleaseMainloop : Base {
  template <class BlkCoord, class ProblemShape, class MainloopPipelineReducer, class PipelineStateReducer,
            class MathWgOrderBarrier>
  CUTLASS_DEVICE auto compute(BlkCoord const& blk_coord, BlkCoord const& wg_coord,
                              typename Base::Params const& params, ProblemShape const& problem_size,
                              typename Base::MainloopPipeline& pipeline, typename Base::PipelineState& smem_pipe_read,
                              typename Base::MainloopPipelineQ& pipeline_q,
                              typename Base::PipelineStateQ& smem_pipe_read_q, MainloopPipelineReducer&,
                              PipelineStateReducer&, typename Base::SharedStorage& storage,
                              MathWgOrderBarrier& math_wg_order_barrier) {
    using namespace cutlass::fmha::collective;
    using TileShape = typename Base::TileShape;
    using TileShapeQK = typename Base::TileShapeQK;
    using TiledMmaPV = typename Base::TiledMmaPV;
    int thread_idx = int(threadIdx.x);

    typename Base::TiledMmaQK tiled_mma_qk;
    auto thr_mma_qk = tiled_mma_qk.get_thread_slice(thread_idx);
    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), typename Base::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), typename Base::SmemLayoutK{});
    Tensor tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ));
    Tensor tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK));

    TiledMmaPV tiled_mma_pv;
    auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), typename Base::SmemLayoutV{});
    Tensor tOrV = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sV));

    // query x key coordinates of the S tile, for the mask
    Tensor tPcP = thr_mma_qk.partition_C(make_identity_tensor(take<0, 2>(TileShapeQK{})));
    tPcP.data() = tPcP.data() + E<0>{} * int(get<0>(wg_coord)) * get<0>(TileShapeQK{});

    Tensor acc_pv = partition_fragment_C(tiled_mma_pv, take<0, 2>(typename Base::TileShapePV{}));
    CollectiveSoftmax<typename Base::ElementAccumulatorQK, Fusion, typename Base::Params> softmax{params};
    auto softmax_state = softmax.init(acc_pv, tiled_mma_pv);

    // K_j and V_j take turns in one pipeline: smem_pipe_read walks K_0, V_0, K_1, V_1, ...
    auto issue_qk = [&](auto& acc_qk) {
      pipeline.consumer_wait(smem_pipe_read);
      warpgroup_fence_operand(acc_qk);
      warpgroup_arrive();
      gemm_zero_acc(tiled_mma_qk, tSrQ(_, _, _, smem_pipe_read_q.index()), tSrK(_, _, _, smem_pipe_read.index()),
                    acc_qk);
      warpgroup_commit_batch();
    };
    auto issue_pv = [&](auto& acc_qk, bool first) {
      Tensor p = make_acc_into_op<typename Base::Element>(acc_qk, typename TiledMmaPV::LayoutA_TV{});
      pipeline.consumer_wait(smem_pipe_read);
      warpgroup_fence_operand(acc_pv);
      warpgroup_fence_operand(p);
      warpgroup_arrive();
      if (first) gemm_zero_acc(tiled_mma_pv, p, tOrV(_, _, _, smem_pipe_read.index()), acc_pv);
      else cute::gemm(tiled_mma_pv, p, tOrV(_, _, _, smem_pipe_read.index()), acc_pv);
      warpgroup_commit_batch();
    };

    pipeline_q.consumer_wait(smem_pipe_read_q);

    // first key tile: the softmax starts the running max and sum
    Tensor acc_qk = partition_fragment_C(tiled_mma_qk, take<0, 2>(TileShapeQK{}));
    math_wg_order_barrier.wait();  // staggers the consumer warpgroups, which then keep ping-ponging
    issue_qk(acc_qk);
    math_wg_order_barrier.arrive();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_qk);
    pipeline.consumer_release(smem_pipe_read);
    ++smem_pipe_read;
    softmax.step(acc_qk, tiled_mma_qk, tPcP, softmax_state, problem_size);
    issue_pv(acc_qk, true);
    auto v_stage = smem_pipe_read;  // V of the P.V product in flight
    ++smem_pipe_read;
    tPcP.data() = tPcP.data() + E<1>{} * get<1>(TileShapeQK{});

    auto step = [&](auto mask) {
      Tensor acc_qk = partition_fragment_C(tiled_mma_qk, take<0, 2>(TileShapeQK{}));
      issue_qk(acc_qk);
      warpgroup_wait<0>();  // S_j, and the P_{j-1} V_{j-1} issued before it
      warpgroup_fence_operand(acc_qk);
      warpgroup_fence_operand(acc_pv);
      pipeline.consumer_release(smem_pipe_read);
      pipeline.consumer_release(v_stage);
      ++smem_pipe_read;
      softmax.template step<decltype(mask)::value>(acc_qk, tiled_mma_qk, tPcP, softmax_state, acc_pv, tiled_mma_pv,
                                                   problem_size);
      issue_pv(acc_qk, false);
      v_stage = smem_pipe_read;
      ++smem_pipe_read;
      tPcP.data() = tPcP.data() + E<1>{} * get<1>(TileShapeQK{});
    };

    // the first tile came out of the unmasked count, as in the example's mainloop
    int unmasked = Fusion{}.get_unmasked_trip_count(blk_coord, TileShape{}, problem_size) - 1;
    int masked = Fusion{}.get_masked_trip_count(blk_coord, TileShape{}, problem_size) + cute::min(unmasked, 0);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; unmasked > 0; --unmasked) step(cute::false_type{});
    CUTLASS_PRAGMA_NO_UNROLL
    for (; masked > 0; --masked) step(cute::true_type{});

    if (Base::kIsPersistent) pipeline_q.consumer_release(smem_pipe_read_q);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_pv);
    pipeline.consumer_release(v_stage);

    Tensor lse = softmax.tail(softmax_state, acc_pv, tiled_mma_pv);
    return make_tuple(acc_pv, lse);
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
template <bool kEarlyRelease_, class TileShape_, class Schedule_, class... Options_>
struct ConfigT {
  using TileShape = TileShape_;
  using Schedule = Schedule_;
};
template <class TileShape, class Schedule, class... Options>
using Config = ConfigT<false, TileShape, Schedule, Options...>;
template <class TileShape, class Schedule, class... Options>
using EarlyRelease = ConfigT<true, TileShape, Schedule, Options...>;

template <class Element, class Fusion, class Config>
struct FwdKernel;

template <class Element, class Fusion, bool kEarlyRelease, class TileShape, class Schedule, class... Options>
struct FwdKernel<Element, Fusion, ConfigT<kEarlyRelease, TileShape, Schedule, Options...>> {
  using Persistent = Option<Tag::kIsPersistent, cute::bool_constant<Schedule::kPersistent>>;
  using ExampleMainloop = MainloopWithScale<cutlass::fmha::collective::FmhaMainloopTmaWarpSpecialized<
      Element, float, float, TileShape, Stride, Stride, Stride, Fusion, Persistent, Options...>>;
  using Mainloop = std::conditional_t<kEarlyRelease, EarlyReleaseMainloop<ExampleMainloop, Fusion>, ExampleMainloop>;
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
