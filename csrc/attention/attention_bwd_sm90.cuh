// Hopper attention backward: CUTLASS's warp-specialised FMHA backward (examples/88_hopper_fmha of
// the nvidia-cutlass package: a CTA per key block, its two consumer warpgroups holding dK and dV
// of half the block in registers while a producer warp streams Q, dO, lse and sum(dO * O) tiles
// by TMA; the softmax recomputed from the lse; dQ of each query tile added into an fp32 buffer
// by bulk reductions from a warp of its own), instantiated for torch-flash's layouts with the
// softmax scale as an argument and the causal mask aligned bottom-right. Around it, the
// example's sum(dO * O) per row before, and after it the dQ buffer's conversion to dq's dtype
// (BwdConvertDq: the buffer holds each tile in the mainloop's thread order). GQA runs one launch
// per query head of a group (as the forward does), each into its own slice of dk and dv. The
// mainloop (attention_bwd_sm90_mainloop.cuh) splits dQ over both warpgroups (by head dim at 128,
// by rows at 64) and, under torch.use_deterministic_algorithms, adds each dQ tile's
// contributions in a fixed key-block order.
#pragma once

#include <algorithm>

#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/kernel_hardware_info.h"
#include "cute/tensor.hpp"

#include "88_hopper_fmha/collective/fmha_collective_bwd_tma_warpspecialized.hpp"
#include "88_hopper_fmha/collective/fmha_epilogue_bwd.hpp"
#include "88_hopper_fmha/collective/fmha_fusion.hpp"
#include "88_hopper_fmha/kernel/fmha_kernel_bwd_sum_OdO.hpp"
#include "88_hopper_fmha/kernel/fmha_kernel_tma_warpspecialized.hpp"
#include "88_hopper_fmha/kernel/fmha_tile_scheduler.hpp"

#include "attention/attention_bwd_sm90.h"
#include "attention/attention_bwd_sm90_mainloop.cuh"
#include "attention/attention_sm90.cuh"

namespace torch_flash::sm90 {

using namespace cute;

// (batch, head, row, 1) element strides, as the backward collectives take them.
using BwdStride = cute::tuple<int, int, int, _1>;
using BwdStrideRow = cute::tuple<int, int, _1>;  // lse, sum(dO * O): (batch, head, 1)

// The backward's coordinates: a query tile m of BlockQO rows against the CTA's key block n of
// BlockKV keys; before_softmax sees (key, query) index pairs. The tiles that see the block's keys
// are a suffix, from first_query_tile on; only those are visited.
struct NoMaskBwd {
  // Deterministic dQ: the key blocks add into a query tile in the order their CTAs reach it, each
  // starting at its own tile (BwdMainloop::ArrivalTurns).
  static constexpr bool kReverseKeyBlocks = false;

  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_trip_count(BlkCoord const&, TileShape const& tile, ProblemSize const& problem) {
    return ceil_div(get<2>(problem), get<0>(tile));
  }

  template <class TileShape, class ProblemSize>
  CUTLASS_DEVICE int first_query_tile(int, TileShape const&, ProblemSize const&) {
    return 0;
  }

  // Keys past Sk are zeros (TMA fills them), which contribute nothing to dQ; their dK and dV rows
  // are never stored. Query rows past Sq have zero dO and lse, hence zero dS and dV terms.
  template <class AccQK, class IndexQK, class ProblemSize>
  CUTLASS_DEVICE void mask(AccQK&, IndexQK const&, ProblemSize const&) {}

  template <class AccQK, class IndexQK, class ProblemSize>
  CUTLASS_DEVICE void before_softmax(AccQK&, IndexQK const&, ProblemSize const&) {}
};

// flash.attention's causal mask, aligned bottom-right: query row i sees keys j <= i + Sk - Sq.
struct CausalBottomRightBwd : NoMaskBwd {
  // Deterministic dQ: the key blocks add into a query tile from the last that sees it to the
  // first, CTAs of later key blocks starting first: a block's first tiles then wait for no one.
  static constexpr bool kReverseKeyBlocks = true;

  // The first query tile that sees key block n: the first whose last row i has n * BlockKV <=
  // i + Sk - Sq (in closed form: testing the tiles one by one cost about 2 % of the backward).
  template <class TileShape, class ProblemSize>
  CUTLASS_DEVICE int first_query_tile(int n, TileShape const& tile, ProblemSize const& problem) {
    const int row = n * int(get<1>(tile)) - (int(get<3>(problem)) - int(get<2>(problem)));  // sees key n * BlockKV first
    return row > 0 ? row / int(get<0>(tile)) : 0;
  }

  // The last key block query tile m sees (-1: none).
  template <class TileShape, class ProblemSize>
  CUTLASS_DEVICE int last_key_block(int m, TileShape const& tile, ProblemSize const& problem) {
    const int last_row = std::min((m + 1) * int(get<0>(tile)), int(get<2>(problem))) - 1;
    const int last_key = std::min(last_row + get<3>(problem) - get<2>(problem), get<3>(problem) - 1);
    return last_key < 0 ? -1 : last_key / int(get<1>(tile));
  }

  template <class AccQK, class IndexQK, class ProblemSize>
  CUTLASS_DEVICE void mask(AccQK& acc, IndexQK const& index, ProblemSize const& problem) {
    const int off = get<3>(problem) - get<2>(problem);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); i++) {
      auto pos = index(i);
      if (get<0>(pos) > get<1>(pos) + off) acc(i) = -INFINITY;
    }
  }

  // all of the thread's keys within its first query row's: nothing to mask
  template <class AccQK, class IndexQK, class ProblemSize>
  CUTLASS_DEVICE void before_softmax(AccQK& acc, IndexQK const& index, ProblemSize const& problem) {
    if (get<0>(greatest(index)) > get<1>(least(index)) + get<3>(problem) - get<2>(problem)) {
      mask(acc, index, problem);
    }
  }
};

// One CTA per (key block, head, batch), as the example's IndividualTileScheduler; reversed: the
// key blocks numbered last to first, so that deterministic dQ reductions from the last key block
// to the first (kReverseKeyBlocks) wait only for CTAs dispatched before them.
struct KeyBlockScheduler {
  using Base = cutlass::fmha::kernel::IndividualTileScheduler;
  struct Params {
    dim3 grid;
    bool reversed;
  };

  Params params;
  bool valid = true;

  CUTLASS_DEVICE explicit KeyBlockScheduler(Params const& params) : params(params) {}

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& problem, cutlass::KernelHardwareInfo hw,
                                        ClusterShape const& cluster, TileShape const& tile) {
    return {Base::to_underlying_arguments(problem, hw, cluster, tile).grid, false};
  }

  static dim3 get_grid_shape(Params const& params) { return params.grid; }

  CUTLASS_DEVICE bool is_valid() { return valid; }

  CUTLASS_DEVICE auto get_block_coord() {
    const int block = params.reversed ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x);
    return make_coord(block, _0{}, make_coord(blockIdx.y, blockIdx.z));
  }

  CUTLASS_DEVICE KeyBlockScheduler& operator++() {
    valid = false;
    return *this;
  }
};

// dq in q's dtype from dq_acc, whose tiles hold their floats in the order BwdMainloop's dQ stage
// has them (Dq: that mainloop; thread t of warpgroup part p put its dQ fragment's floats 4v..4v+3
// at p * kDqPart + (v * 128 + t) * 4). A CTA a (query tile, head, batch): each thread takes its
// floats back to (row, column) through the same GEMM's partition of an identity tensor into
// shared memory, then the tile leaves row by row, 16 bytes a thread; rows past seqlen_q are not
// written.
template <class Element, class Dq>
struct BwdConvertDq {
  struct Params {
    const float* dq_acc;
    long acc_batch_stride, acc_head_stride;  // floats
    Element* dq;
    int batch_stride, head_stride, row_stride;  // elements
    int seqlen_q;
  };
  static constexpr int kThreads = 2 * cutlass::NumThreadsPerWarpGroup;
  // Rows 16 bytes apart beyond the head dim: the accumulator layout's 8 rows of a warp's store
  // then fall in distinct banks.
  static constexpr int kPitch = Dq::kHeadDim + 8;
  static constexpr int kVectors = Dq::kHeadDim / 8;  // 16-byte pieces a row

  CUTLASS_DEVICE void operator()(Params const& p) const {
    __shared__ alignas(16) Element tile[Dq::kQueryRows * kPitch];
    const int part = threadIdx.x / cutlass::NumThreadsPerWarpGroup;
    const int thread = threadIdx.x % cutlass::NumThreadsPerWarpGroup;
    Tensor coord = typename Dq::TiledMmaDQ{}.get_thread_slice(thread).partition_C(
        make_identity_tensor(make_shape(Int<Dq::kDQRows>{}, Int<Dq::kDQCols>{})));
    static_assert(decltype(size(coord))::value % 4 == 0);
    const float* src = p.dq_acc + blockIdx.z * p.acc_batch_stride + blockIdx.y * p.acc_head_stride +
                       long(blockIdx.x) * Dq::kDqStage + part * Dq::kDqPart + thread * 4;
    const bool by_rows = Dq::kSplit == Dq::DQSplit::kRows;
    const int row0 = by_rows ? part * Dq::kDQRows : 0;
    const int col0 = by_rows ? 0 : part * Dq::kDQCols;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < size(coord) / 4; v++) {
      const float4 x = *reinterpret_cast<const float4*>(src + v * cutlass::NumThreadsPerWarpGroup * 4);
      const float values[4] = {x.x, x.y, x.z, x.w};
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 4; e++) {
        const int row = row0 + get<0>(coord(4 * v + e)), col = col0 + get<1>(coord(4 * v + e));
        tile[row * kPitch + col] = Element(values[e]);
      }
    }
    __syncthreads();
    Element* dst = p.dq + blockIdx.z * long(p.batch_stride) + blockIdx.y * long(p.head_stride);
    const int first_row = blockIdx.x * Dq::kQueryRows;
    CUTLASS_PRAGMA_UNROLL
    for (int i = threadIdx.x; i < Dq::kQueryRows * kVectors; i += kThreads) {
      const int r = i / kVectors, c = i % kVectors * 8;
      if (first_row + r < p.seqlen_q) {
        *reinterpret_cast<uint4*>(dst + long(first_row + r) * p.row_stride + c) =
            *reinterpret_cast<const uint4*>(tile + r * kPitch + c);
      }
    }
  }
};

template <class Op>
__global__ void __launch_bounds__(Op::kThreads) run_op(typename Op::Params const params) {
  Op{}(params);
}

// TileShape: (query rows per step, keys per CTA, head dim).
template <class Element, class Fusion, class TileShape>
struct BwdKernel {
  using Scaled = MainloopWithScale<BwdMainloop<Element, TileShape, Fusion>>;
  using Mainloop = std::conditional_t<kIsAlibi<Fusion>, MainloopWithAlibi<Scaled>, Scaled>;
  using Epilogue = cutlass::fmha::collective::FmhaBwdEpilogueKV<Element, float, typename Mainloop::TileShapePV>;
  using Kernel = cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<
      Mainloop, Epilogue, cutlass::fmha::kernel::TileSchedulerBwdAdapter<KeyBlockScheduler>>;
  using SumOdO = cutlass::fmha::kernel::FmhaKernelBwdSumOdO<Element, float>;
  using Convert = BwdConvertDq<Element, BwdMainloop<Element, TileShape, Fusion>>;
};

template <class Kernel>
void launch_simple(const typename Kernel::Params& params, cudaStream_t stream, const char* what) {
  cutlass::device_kernel<Kernel><<<Kernel::get_grid_shape(params), Kernel::get_block_shape(), 0, stream>>>(params);
  check_cuda(cudaGetLastError(), what);
}

template <class Element, class Fusion, class TileShape>
void run_bwd(const AttentionBwdSm90Params& p, cudaStream_t stream) {
  using K = BwdKernel<Element, Fusion, TileShape>;
  using Kernel = typename K::Kernel;
  using Scaled = typename K::Scaled;
  using Mainloop = typename K::Mainloop;
  const int group = p.heads_q / p.heads_kv;
  const int sq = p.seqlen_q, d = p.head_dim, q_tiles = ceil_div(sq, int(get<0>(TileShape{})));
  const cute::tuple<int, int, int, int, int> all_heads{p.batch, p.heads_q, sq, p.seqlen_k, d};
  const BwdStrideRow row_stride{p.heads_q * sq, sq, _1{}};  // sum_odo (B, Hq, Sq)
  const int acc_head = ceil_div(sq, kBwdQueryRowsMax) * kBwdQueryRowsMax * d;  // dq_acc's floats a head

  typename K::SumOdO::Arguments sum_args{
      all_heads,
      static_cast<const Element*>(p.out), {p.out_batch_stride, p.out_head_stride, p.out_row_stride, _1{}},
      static_cast<const Element*>(p.grad_out),
      {p.grad_out_batch_stride, p.grad_out_head_stride, p.grad_out_row_stride, _1{}},
      p.sum_odo, row_stride};
  if (!K::SumOdO::can_implement(sum_args)) throw std::runtime_error("flash.attention_backward (sm90 kernel): head dim");
  launch_simple<typename K::SumOdO>(K::SumOdO::to_underlying_arguments(sum_args, nullptr), stream, "sum(dO * O)");

  cutlass::KernelHardwareInfo hw;
  hw.device_id = p.device;
  allow_shared_memory<Kernel>(p.device);
  for (int g = 0; g < group; ++g) {  // query heads g, g + G, ... against kv heads 0, 1, ...
    auto at = [g](const void* base, int head_stride, int element_size) {
      return static_cast<const char*>(base) + long(g) * head_stride * element_size;
    };
    const long dkv_at = g * p.dkv_member_stride;
    const typename Scaled::Arguments scaled{
        {{reinterpret_cast<const Element*>(at(p.q, p.q_head_stride, sizeof(Element))),
          {p.q_batch_stride, p.q_head_stride * group, p.q_row_stride, _1{}},
          static_cast<const Element*>(p.k), {p.k_batch_stride, p.k_head_stride, p.k_row_stride, _1{}},
          static_cast<const Element*>(p.v), {p.v_batch_stride, p.v_head_stride, p.v_row_stride, _1{}},
          reinterpret_cast<const Element*>(at(p.grad_out, p.grad_out_head_stride, sizeof(Element))),
          {p.grad_out_batch_stride, p.grad_out_head_stride * group, p.grad_out_row_stride, _1{}},
          p.lse + long(g) * p.lse_head_stride, {p.lse_batch_stride, p.lse_head_stride * group, _1{}},
          p.sum_odo + long(g) * sq, {p.heads_q * sq, sq * group, _1{}},
          p.dq_acc + long(g) * acc_head, {p.heads_q * acc_head, acc_head * group, d, _1{}}},
         p.dq_semaphore == nullptr ? nullptr : p.dq_semaphore + long(g) * q_tiles,
         p.heads_q * q_tiles, q_tiles * group, p.sm_count,
         p.dq_acc + long(g) * acc_head, long(p.heads_q) * acc_head, long(acc_head) * group},
        p.scale};
    typename Mainloop::Arguments mainloop_args;
    if constexpr (kIsAlibi<Fusion>) {  // query heads g, g + G, ...
      mainloop_args = {scaled, p.alibi_slopes + long(g) * p.alibi_head_stride, p.alibi_batch_stride,
                       p.alibi_head_stride * group};
    } else {
      mainloop_args = scaled;
    }
    typename Kernel::Arguments args{
        {p.batch, p.heads_kv, sq, p.seqlen_k, d},
        mainloop_args,
        {static_cast<Element*>(p.dk) + dkv_at, {p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, _1{}},
         static_cast<Element*>(p.dv) + dkv_at, {p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, _1{}}},
        hw};
    if (!Kernel::can_implement(args)) {
      throw std::runtime_error("flash.attention_backward (sm90 kernel): unsupported problem (head dim " +
                               std::to_string(d) + ", seqlen_q " + std::to_string(sq) + ")");
    }
    auto params = Kernel::to_underlying_arguments(args, nullptr);
    params.tile_scheduler.reversed = Fusion::kReverseKeyBlocks && p.dq_semaphore != nullptr;
    cutlass::device_kernel<Kernel>
        <<<Kernel::get_grid_shape(params), Kernel::get_block_shape(), Kernel::SharedStorageSize, stream>>>(params);
    check_cuda(cudaGetLastError(), "backward kernel launch");
  }

  const typename K::Convert::Params convert{p.dq_acc, long(p.heads_q) * acc_head, acc_head,
                                            static_cast<Element*>(p.dq), p.dq_batch_stride, p.dq_head_stride,
                                            p.dq_row_stride, sq};
  run_op<typename K::Convert>
      <<<dim3(q_tiles, p.heads_q, p.batch), K::Convert::kThreads, 0, stream>>>(convert);
  check_cuda(cudaGetLastError(), "dq conversion");
}

// Every dtype x mask variant of one head dim, each with ALiBi.
template <class TileShape>
void dispatch_bwd(const AttentionBwdSm90Params& p, cudaStream_t stream) {
  if (p.alibi_slopes != nullptr) {
    using Causal = Alibi<CausalBottomRightBwd, true>;
    using Full = Alibi<NoMaskBwd, true>;
    if (p.bf16 && p.causal) run_bwd<cutlass::bfloat16_t, Causal, TileShape>(p, stream);
    else if (p.bf16) run_bwd<cutlass::bfloat16_t, Full, TileShape>(p, stream);
    else if (p.causal) run_bwd<cutlass::half_t, Causal, TileShape>(p, stream);
    else run_bwd<cutlass::half_t, Full, TileShape>(p, stream);
    return;
  }
  if (p.bf16 && p.causal) run_bwd<cutlass::bfloat16_t, CausalBottomRightBwd, TileShape>(p, stream);
  else if (p.bf16) run_bwd<cutlass::bfloat16_t, NoMaskBwd, TileShape>(p, stream);
  else if (p.causal) run_bwd<cutlass::half_t, CausalBottomRightBwd, TileShape>(p, stream);
  else run_bwd<cutlass::half_t, NoMaskBwd, TileShape>(p, stream);
}

}  // namespace torch_flash::sm90
