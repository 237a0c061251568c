// Hopper attention forward: CUTLASS's warp-specialised FMHA (examples/88_hopper_fmha of the
// nvidia-cutlass package: TMA loads of Q/K/V tiles, wgmma from shared memory, a producer
// warpgroup and two consumer warpgroups with register reallocation, softmax of one tile
// overlapped with the other warpgroup's matmuls), instantiated for torch-flash's layouts,
// with the softmax scale as an argument, the output rescaled only when a row's maximum climbs
// far (attention_fwd_sm90_softmax.cuh), and a launch that follows the caller's stream; the
// causal mask aligned bottom-right (CausalBottomRight), ALiBi from the slopes (Alibi,
// MainloopWithAlibi), causal tiles in equal pairs
// (PairedTileScheduler) with a partial tile's rows run first (causal_rows), and without a mask
// the persistent launch's short last round run as key splits (TailSplit).
#pragma once

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/kernel_hardware_info.h"
#include "cute/tensor.hpp"

#include "88_hopper_fmha/collective/fmha_fusion.hpp"
#include "88_hopper_fmha/kernel/fmha_kernel_builder.hpp"

#include "attention/attention_fwd_sm90.h"
#include "attention/attention_fwd_sm90_softmax.cuh"
#include "attention/attention_sm90.cuh"

namespace torch_flash::sm90 {

using namespace cute;
using cutlass::fmha::kernel::Option;
using cutlass::fmha::kernel::Tag;

// (row, 1, (batch, head)) element strides, as the FMHA collectives index their tensors.
using Stride = cute::tuple<int, _1, cute::tuple<int, int>>;
using StrideLse = cute::tuple<_1, cute::tuple<int, int>>;

// flash.attention's causal mask, aligned bottom-right: query row i sees keys j <= i + Sk - Sq
// (CUTLASS's CausalFusion aligns top-left, the same only for Sq == Sk). Needs Sq <= Sk, so that
// every row sees a key. Query tile m's first row sees whole key tiles up to its diagonal
// (unmasked), the rest of its trip needs the mask, which also hides keys past Sk (a partial
// last key tile always lies there: the first row of a valid tile sees at most key Sk - 1).
struct CausalBottomRight : cutlass::fmha::collective::DefaultFusion {
  // its unmasked key steps: every key at or left of every row's diagonal
  static constexpr bool kWholeStepsLeftOfDiagonal = true;

  template <class ProblemSize>
  CUTLASS_DEVICE static int offset(ProblemSize const& problem_size) {
    return get<3>(problem_size) - get<2>(problem_size);
  }

  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_trip_count(BlkCoord const& blk_coord, TileShape const& tile_shape,
                                    ProblemSize const& problem_size) {
    const int last_row_keys = (get<0>(blk_coord) + 1) * get<0>(tile_shape) + offset(problem_size);
    return std::min(DefaultFusion::get_trip_count(blk_coord, tile_shape, problem_size),
                    int(ceil_div(last_row_keys, get<1>(tile_shape))));
  }

  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_unmasked_trip_count(BlkCoord const& blk_coord, TileShape const& tile_shape,
                                             ProblemSize const& problem_size) {
    const int first_row_keys = get<0>(blk_coord) * get<0>(tile_shape) + offset(problem_size) + 1;
    return std::min(get_trip_count(blk_coord, tile_shape, problem_size), first_row_keys / int(get<1>(tile_shape)));
  }

  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_masked_trip_count(BlkCoord const& blk_coord, TileShape const& tile_shape,
                                           ProblemSize const& problem_size) {
    return get_trip_count(blk_coord, tile_shape, problem_size) -
           get_unmasked_trip_count(blk_coord, tile_shape, problem_size);
  }

  template <class AccQK, class IndexQK, class ProblemSize>
  CUTLASS_DEVICE void mask(AccQK& acc_qk, IndexQK const& index_qk, ProblemSize const& problem_size) {
    const int off = offset(problem_size);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc_qk); i++) {
      auto pos = index_qk(i);
      if (get<0>(pos) + off < get<1>(pos)) acc_qk(i) = -INFINITY;
    }
  }

  // all of the thread's keys within its first row's: nothing to mask (keys past Sk lie beyond)
  template <class AccQK, class IndexQK, class ProblemSize>
  CUTLASS_DEVICE void before_softmax(AccQK& acc_qk, IndexQK const& index_qk, ProblemSize const& problem_size) {
    if (get<1>(greatest(index_qk)) > get<0>(least(index_qk)) + offset(problem_size)) {
      mask(acc_qk, index_qk, problem_size);
    }
  }
};

// Without a mask: the keys past Sk masked on the last key step, as CUTLASS's ResidualFusion,
// but no masked step where Sk is a multiple of the key tile, and only in the threads that hold
// such keys.
struct Residual : cutlass::fmha::collective::ResidualFusion {
  static constexpr bool kWholeStepsLeftOfDiagonal = false;

  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_masked_trip_count(BlkCoord const&, TileShape const& tile_shape,
                                           ProblemSize const& problem_size) {
    return get<3>(problem_size) % int(get<1>(tile_shape)) != 0;
  }

  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_unmasked_trip_count(BlkCoord const& blk_coord, TileShape const& tile_shape,
                                             ProblemSize const& problem_size) {
    return get_trip_count(blk_coord, tile_shape, problem_size) -
           get_masked_trip_count(blk_coord, tile_shape, problem_size);
  }

  template <class AccQK, class IndexQK, class ProblemSize>
  CUTLASS_DEVICE void mask(AccQK& acc_qk, IndexQK const& index_qk, ProblemSize const& problem_size) {
    ResidualFusion::before_softmax(acc_qk, index_qk, problem_size);
  }

  template <class AccQK, class IndexQK, class ProblemSize>
  CUTLASS_DEVICE void before_softmax(AccQK& acc_qk, IndexQK const& index_qk, ProblemSize const& problem_size) {
    if (get<1>(greatest(index_qk)) >= get<3>(problem_size)) mask(acc_qk, index_qk, problem_size);
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
// first, so the CTAs at work share the K/V of a few heads in L2. With M odd the middle tiles of
// two (batch, head)s make a unit, after all the others: a middle tile alone is half a unit, and
// as the units go round the CTAs, the same CTAs would take one every round.
struct PairedTileScheduler {
  struct Params {
    int num_units;
    int pair_units;  // units of one (batch, head); the rest pair middle tiles
    int m_blocks;
    int heads;  // batch x heads
    cutlass::FastDivmod divmod_pair, divmod_b, divmod_h;
    cutlass::KernelHardwareInfo hw_info;
  };

  int unit;
  bool second = false;  // on the unit's second tile
  Params params;

  CUTLASS_DEVICE explicit PairedTileScheduler(Params const& p) : unit(blockIdx.x), params(p) {}

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& problem, cutlass::KernelHardwareInfo hw,
                                        ClusterShape const& cluster, TileShape const& tile) {
    const int m_blocks = cutlass::round_up(ceil_div(size<2>(problem), size<0>(tile)), size<0>(cluster));
    const int pairs = m_blocks / 2, heads = int(size<0>(problem)) * int(size<1>(problem));
    const int pair_units = pairs * heads, middle_units = m_blocks % 2 ? (heads + 1) / 2 : 0;
    if (hw.sm_count <= 0) hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
    return {pair_units + middle_units, pair_units, m_blocks, heads, cutlass::FastDivmod(std::max(pairs, 1)),
            cutlass::FastDivmod(size<0>(problem)), cutlass::FastDivmod(size<1>(problem)), hw};
  }

  static dim3 get_grid_shape(Params const& p) { return dim3(std::min(p.num_units, p.hw_info.sm_count), 1, 1); }

  CUTLASS_DEVICE bool is_valid() const { return unit < params.num_units; }

  CUTLASS_DEVICE int middle_head() const { return 2 * (unit - params.pair_units) + second; }

  CUTLASS_DEVICE auto get_block_coord() const {
    int rest, pair, bidb, bidh;
    if (unit < params.pair_units) {
      params.divmod_pair(rest, pair, unit);
      params.divmod_b(rest, bidb, rest);
      params.divmod_h(rest, bidh, rest);
      return make_coord(second ? pair : params.m_blocks - 1 - pair, _0{}, make_coord(bidb, bidh));
    }
    params.divmod_b(bidh, bidb, middle_head());
    return make_coord(params.m_blocks / 2, _0{}, make_coord(bidb, bidh));
  }

  CUTLASS_DEVICE PairedTileScheduler& operator++() {
    if (!second && (unit < params.pair_units || middle_head() + 1 < params.heads)) {
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
  template <class Other>
  using WithSchedule = Config<TileShape_, Other, Options_...>;
};

// The example's epilogue, with attention sinks where params.sinks is set: each row's lse becomes
// logaddexp(lse, sink of its head) and its output is scaled by exp(old lse - new lse) in
// registers before the store (a row without keys: 0, its lse the sink), so that sinks cost no
// pass over the output.
template <class ElementOut, class TileShapePV>
struct SinkEpilogue : cutlass::fmha::collective::FmhaFwdEpilogue<ElementOut, float, TileShapePV> {
  using Base = cutlass::fmha::collective::FmhaFwdEpilogue<ElementOut, float, TileShapePV>;
  struct Arguments : Base::Arguments {
    const float* sinks;
    int sinks_head_stride;
  };
  struct Params : Base::Params {
    const float* sinks;
    int sinks_head_stride;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem, Arguments const& args, void* workspace = nullptr) {
    return {Base::to_underlying_arguments(problem, args, workspace), args.sinks, args.sinks_head_stride};
  }

  template <class TileShape, class BlkCoord, class ResultTuple, class TiledMma, class ProblemShape>
  CUTLASS_DEVICE void operator()(TileShape const& tile_shape, BlkCoord const& blk_coord, ResultTuple const& result,
                                 TiledMma const& tiled_mma, ProblemShape const& problem_size, Params const& params,
                                 typename Base::LoadPipeline epi_load_pipeline,
                                 typename Base::TensorStorage& epi_tensor_storage) {
    if (params.sinks == nullptr) {
      Base::operator()(tile_shape, blk_coord, result, tiled_mma, problem_size, params, epi_load_pipeline,
                       epi_tensor_storage);
      return;
    }
    auto acc = get<0>(result);
    auto lse = get<1>(result);
    const float sink = params.sinks[get<1>(get<2>(blk_coord)) * params.sinks_head_stride];  // (batch, head)
    Tensor acc_mn = make_tensor(acc.data(), cutlass::fmha::collective::layout_acc_mn(tiled_mma, acc.layout()));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(acc_mn); ++i) {
      const bool no_keys = lse(i) == INFINITY;  // the softmax's mark of a row with no keys
      const float top = fmaxf(lse(i), sink);
      const float with_sink = no_keys ? sink : top + logf(expf(lse(i) - top) + expf(sink - top));
      const float factor = no_keys ? 0.f : expf(lse(i) - with_sink);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(acc_mn); ++j) acc_mn(i, j) *= factor;
      lse(i) = with_sink;
    }
    Base::operator()(tile_shape, blk_coord, cute::make_tuple(acc, lse), tiled_mma, problem_size, params,
                     epi_load_pipeline, epi_tensor_storage);
  }
};

// ElementOut: the output's type (float for the split tail's partial results).
template <class Element, class Fusion, class Config, class ElementOut = Element>
struct FwdKernel;

template <class Element, class Fusion, class TileShape, class Schedule, class... Options, class ElementOut>
struct FwdKernel<Element, Fusion, Config<TileShape, Schedule, Options...>, ElementOut> {
  using Persistent = Option<Tag::kIsPersistent, cute::bool_constant<Schedule::kPersistent>>;
  using Scaled = MainloopWithScale<cutlass::fmha::collective::FmhaMainloopTmaWarpSpecialized<
      Element, float, float, TileShape, Stride, Stride, Stride, Fusion, Persistent, Options...>>;
  using Mainloop = std::conditional_t<kIsAlibi<Fusion>, MainloopWithAlibi<Scaled>, Scaled>;
  using Epilogue = SinkEpilogue<ElementOut, typename Mainloop::TileShapePV>;
  using Kernel = cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<
      Mainloop, Epilogue, typename Schedule::Scheduler, Persistent,
      Option<Tag::kLoadsQSeparately, cute::bool_constant<Schedule::kPersistent>>, Options...>;
};

template <class Element, class Fusion, class Config, class ElementOut = Element>
void run(const AttentionFwdSm90Params& p, int tail_tiles, cudaStream_t stream) {
  using Kernel = typename FwdKernel<Element, Fusion, Config, ElementOut>::Kernel;
  using Scaled = typename FwdKernel<Element, Fusion, Config, ElementOut>::Scaled;
  using Mainloop = typename FwdKernel<Element, Fusion, Config, ElementOut>::Mainloop;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = p.device;
  hw.sm_count = p.sm_count;
  const typename Scaled::Arguments scaled{
      {static_cast<const Element*>(p.q), Stride{p.q_row_stride, _1{}, {p.q_batch_stride, p.q_head_stride}},
       static_cast<const Element*>(p.k), Stride{p.k_row_stride, _1{}, {p.k_batch_stride, p.k_head_stride}},
       static_cast<const Element*>(p.v), Stride{p.v_row_stride, _1{}, {p.v_batch_stride, p.v_head_stride}}},
      p.scale};
  typename Mainloop::Arguments mainloop_args;
  if constexpr (kIsAlibi<Fusion>) {
    mainloop_args = {scaled, p.alibi_slopes, p.alibi_batch_stride, p.alibi_head_stride};
  } else {
    mainloop_args = scaled;
  }
  typename Kernel::Arguments args{
      {p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.head_dim},
      mainloop_args,
      {{static_cast<ElementOut*>(p.out), Stride{p.out_row_stride, _1{}, {p.out_batch_stride, p.out_head_stride}},
        p.lse, StrideLse{_1{}, {p.lse_batch_stride, p.lse_head_stride}}},
       p.sinks, p.sinks_head_stride},
      hw};
  if (!Kernel::can_implement(args)) {
    throw std::runtime_error("flash.attention (sm90 kernel): unsupported problem (head dim " +
                             std::to_string(p.head_dim) + ", seqlen_q " + std::to_string(p.seqlen_q) + ")");
  }
  auto params = Kernel::to_underlying_arguments(args, nullptr);
  if constexpr (std::is_same_v<typename Config::Schedule, Pingpong>) {
    params.tile_scheduler.num_blocks -= tail_tiles;  // the last tiles in the scheduler's order
  }
  allow_shared_memory<Kernel>(p.device);
  cutlass::device_kernel<Kernel>
      <<<Kernel::get_grid_shape(params), Kernel::get_block_shape(), Kernel::SharedStorageSize, stream>>>(params);
  check_cuda(cudaGetLastError(), "kernel launch");
}

// Keys from which a head dim's long-sequence configurations run (D=64's three warpgroups lead
// from 2k keys: scripts/sweep_attention_sm90.py).
constexpr int kLongKeys = 2048;

// The split tail. A persistent launch of T query tiles on P SMs runs ceil(T / P) rounds; with
// T % P = r small, the last round keeps r SMs busy and the rest idle (the standard grid at
// D=128 has T = 4096 on 132 SMs: 31 full rounds and 4 tiles, 3% of the kernel's time). Those
// r tiles, the last of the scheduler's order (query tiles of the last (batch, head)), are then
// left out of the launch and run as r x s units of Sk / s keys each, on the same kernel: a
// second problem whose batch is the s key splits (the r tiles' queries copied s times, each
// split's keys a stride apart), whose fp32 partial outputs and log-sum-exps one more kernel
// merges (out = sum_i exp(lse_i - lse) out_i, lse = log sum_i exp(lse_i)). The split launch
// has a CTA per unit, whose epilogue may reuse the mainloop's shared memory (a persistent
// CTA's may not, and fp32 staging does not fit beside it). Without a mask or ALiBi only (key
// positions restart in each split), from kLongKeys keys, and where s >= kMinSplits divides Sk's
// key tiles (no split is partial).
struct TailSplit {
  int tiles = 0;  // query tiles of the last (batch, head) left to the splits; 0: no split
  int splits = 1;
  int split_keys = 0;
};

constexpr int kMinSplits = 4;

inline TailSplit plan_tail_split(const AttentionFwdSm90Params& p, int block_m, int block_n) {
  TailSplit plan;
  const int m_blocks = (p.seqlen_q + block_m - 1) / block_m;
  const long tiles = long(m_blocks) * p.batch * p.heads;
  const int rest = int(tiles % p.sm_count);
  if (p.alloc == nullptr || p.causal || tiles < p.sm_count || rest == 0 || rest > m_blocks ||
      p.seqlen_k < kLongKeys || p.seqlen_k % block_n != 0) {
    return plan;
  }
  const int key_tiles = p.seqlen_k / block_n;
  int splits = std::min(key_tiles, p.sm_count / rest);
  while (key_tiles % splits != 0) --splits;
  if (splits < kMinSplits) return plan;
  plan.tiles = rest;
  plan.splits = splits;
  plan.split_keys = p.seqlen_k / splits;
  return plan;
}

// Row r of `rows` x dim elements, copy c of `copies`: dst[c][r] = src[r] (rows `src_stride` apart).
template <class Element>
__global__ void broadcast_rows(const Element* src, int src_stride, Element* dst, int rows, int dim) {
  using Vec = uint4;  // 16 bytes; dim * sizeof(Element) is a multiple of it (dim >= 64)
  constexpr int kPerVec = sizeof(Vec) / sizeof(Element);
  const auto* from = reinterpret_cast<const Vec*>(src + long(blockIdx.x) * src_stride);
  auto* to = reinterpret_cast<Vec*>(dst + (long(blockIdx.y) * rows + blockIdx.x) * dim);
  for (int i = threadIdx.x; i < dim / kPerVec; i += blockDim.x) to[i] = from[i];
}

// Row r: out[r] = sum_i exp(lse_i[r] - lse[r]) part_i[r], lse[r] = log(sum_i exp(lse_i[r]) +
// exp(sink)), over the `splits` partial results part (splits, rows, dim) and part_lse (splits,
// rows); the sink logit at sink_at (device memory), null: none.
template <class Element>
__global__ void merge_splits(const float* part, const float* part_lse, int splits, int rows, int dim, Element* out,
                             int out_row_stride, float* lse, const float* sink_at) {
  const int row = blockIdx.x;
  const float sink = sink_at ? *sink_at : -INFINITY;
  float max_lse = sink;
  for (int i = 0; i < splits; ++i) max_lse = fmaxf(max_lse, part_lse[i * rows + row]);
  float sum = expf(sink - max_lse);
  for (int i = 0; i < splits; ++i) sum += expf(part_lse[i * rows + row] - max_lse);
  const float row_lse = max_lse + logf(sum);
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    float acc = 0.f;
    for (int i = 0; i < splits; ++i) {
      acc += expf(part_lse[i * rows + row] - row_lse) * part[(long(i) * rows + row) * dim + d];
    }
    out[long(row) * out_row_stride + d] = Element(acc);
  }
  if (threadIdx.x == 0) lse[row] = row_lse;
}

// Query rows [begin, end) of a bottom-right causal problem as a problem of their own: row i
// keeps its keys j <= i + Sk - Sq, so the keys end at end + Sk - Sq.
template <class Element>
AttentionFwdSm90Params causal_rows(const AttentionFwdSm90Params& p, int begin, int end) {
  AttentionFwdSm90Params r = p;
  r.q = static_cast<const Element*>(p.q) + long(begin) * p.q_row_stride;
  r.out = static_cast<Element*>(p.out) + long(begin) * p.out_row_stride;
  r.lse = p.lse + begin;
  r.seqlen_q = end - begin;
  r.seqlen_k = end + p.seqlen_k - p.seqlen_q;
  return r;
}

// The split tail (TailSplit): rows [row0, Sq) of the last (batch, head), left out of the
// persistent launch, as plan.splits key splits merged by merge_splits.
template <class Element, class Fusion, class Config>
void run_split_tail(const AttentionFwdSm90Params& p, const TailSplit& plan, cudaStream_t stream) {
  constexpr int kBlockM = size<0>(typename Config::TileShape{});
  const int row0 = ((p.seqlen_q + kBlockM - 1) / kBlockM - plan.tiles) * kBlockM;
  const int rows = p.seqlen_q - row0, d = p.head_dim, s = plan.splits;
  auto last_head = [&](int batch_stride, int head_stride) {  // element offset of (B - 1, H - 1)
    return long(p.batch - 1) * batch_stride + long(p.heads - 1) * head_stride;
  };
  const long q_at = last_head(p.q_batch_stride, p.q_head_stride);
  const long k_at = last_head(p.k_batch_stride, p.k_head_stride);
  const long v_at = last_head(p.v_batch_stride, p.v_head_stride);
  const long o_at = last_head(p.out_batch_stride, p.out_head_stride);
  const long l_at = last_head(p.lse_batch_stride, p.lse_head_stride);
  const size_t part_elems = size_t(s) * rows * d;
  auto* part = static_cast<float*>(p.alloc(p.alloc_ctx, part_elems * (sizeof(float) + sizeof(Element)) + s * rows * sizeof(float)));
  float* part_lse = part + part_elems;
  auto* q_copies = reinterpret_cast<Element*>(part_lse + s * rows);
  broadcast_rows<<<dim3(rows, s), 64, 0, stream>>>(static_cast<const Element*>(p.q) + q_at + long(row0) * p.q_row_stride,
                                                   p.q_row_stride, q_copies, rows, d);
  check_cuda(cudaGetLastError(), "tail query copies");

  AttentionFwdSm90Params t = p;  // batch: the key splits, one head
  t.batch = s;
  t.heads = 1;
  t.seqlen_q = rows;
  t.seqlen_k = plan.split_keys;
  t.q = q_copies;
  t.q_row_stride = t.out_row_stride = d;
  t.q_batch_stride = t.out_batch_stride = rows * d;
  t.q_head_stride = t.out_head_stride = s * rows * d;  // one head: any stride TMA accepts
  t.k = static_cast<const Element*>(p.k) + k_at;
  t.v = static_cast<const Element*>(p.v) + v_at;
  t.k_batch_stride = plan.split_keys * p.k_row_stride;
  t.v_batch_stride = plan.split_keys * p.v_row_stride;
  t.out = part;
  t.lse = part_lse;
  t.sinks = nullptr;  // partial results: merge_splits adds the sink
  t.lse_batch_stride = rows;
  t.lse_head_stride = s * rows;
  run<Element, Fusion, typename Config::template WithSchedule<Cooperative>, float>(t, 0, stream);  // one round

  merge_splits<Element><<<rows, 128, 0, stream>>>(part, part_lse, s, rows, d,
                                         static_cast<Element*>(p.out) + o_at + long(row0) * p.out_row_stride,
                                         p.out_row_stride, p.lse + l_at + row0,
                                         p.sinks ? p.sinks + long(p.heads - 1) * p.sinks_head_stride : nullptr);
  check_cuda(cudaGetLastError(), "tail merge");
}

template <class Element, class Fusion, class Config>
void launch(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  using TileShape = typename Config::TileShape;
  constexpr int kBlockM = size<0>(TileShape{}), kBlockN = size<1>(TileShape{});
  // Under the causal mask a query tile costs the keys its last row sees, so a partial tile
  // (Sq % kBlockM rows) costs all Sk keys at the bottom and only Sq % kBlockM + Sk - Sq at the
  // top: those rows run first, as a launch of their own (192-row tiles at Sq = Sk = 4096: 352
  // key steps a head instead of 384). From kLongKeys rows, where a partial tile's keys outweigh
  // the second launch.
  if constexpr (std::is_base_of_v<CausalBottomRight, Fusion>) {  // with ALiBi too: causal_rows keeps i + Sk - Sq
    const int top = p.seqlen_q % kBlockM;
    if (top != 0 && p.seqlen_q >= kLongKeys) {
      run<Element, Fusion, Config>(causal_rows<Element>(p, 0, top), 0, stream);
      run<Element, Fusion, Config>(causal_rows<Element>(p, top, p.seqlen_q), 0, stream);
      return;
    }
  }
  TailSplit plan;
  if constexpr (std::is_same_v<typename Config::Schedule, Pingpong> && !kIsAlibi<Fusion>) {
    plan = plan_tail_split(p, kBlockM, kBlockN);
  }
  run<Element, Fusion, Config>(p, plan.tiles, stream);
  if constexpr (!kIsAlibi<Fusion>) {
    if (plan.tiles != 0) run_split_tail<Element, Fusion, Config>(p, plan, stream);
  }
}

// Every dtype x mask variant of one head dim: without a mask (Residual) and with the causal
// mask, one configuration for short and one for long key sequences each (the same type builds
// once); each with ALiBi.
template <class Element, class FullConfig, class LongFullConfig, class CausalConfig, class LongCausalConfig>
void dispatch_mask(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  if (p.alibi_slopes != nullptr) {  // one configuration a mask: the long sequences ALiBi is for
    if (p.causal) launch<Element, Alibi<CausalBottomRight>, LongCausalConfig>(p, stream);
    else launch<Element, Alibi<Residual>, LongFullConfig>(p, stream);
    return;
  }
  const bool long_keys = p.seqlen_k >= kLongKeys;
  if (p.causal && long_keys) launch<Element, CausalBottomRight, LongCausalConfig>(p, stream);
  else if (p.causal) launch<Element, CausalBottomRight, CausalConfig>(p, stream);
  else if (long_keys) launch<Element, Residual, LongFullConfig>(p, stream);
  else launch<Element, Residual, FullConfig>(p, stream);
}

template <class... Configs>  // FullConfig, LongFullConfig, CausalConfig, LongCausalConfig
void dispatch(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  if (p.bf16) dispatch_mask<cutlass::bfloat16_t, Configs...>(p, stream);
  else dispatch_mask<cutlass::half_t, Configs...>(p, stream);
}

}  // namespace torch_flash::sm90
