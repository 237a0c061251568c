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
// to the first (kReverseKeyBlocks) wait only for CTAs dispatched before them. group > 0: a 1-D
// grid of the first `count` CTAs of this order: the (batch, head) pairs taken group at a time,
// and within a group key block by key block, all pairs of the group at each. Under the causal
// mask without deterministic turns, where a key block's work falls with its index, groups of
// group_for_l2 pairs put the shortest CTAs last (the tail of the grid) while a group's Q, dO and
// dQ stay within L2; groups of one pair give the 3-D grid's order, less its last CTAs where a
// split tail takes those (BwdTailSplit).
struct KeyBlockScheduler {
  using Base = cutlass::fmha::kernel::IndividualTileScheduler;
  struct Params {
    dim3 grid;  // (key blocks, batch, heads)
    bool reversed;
    int group;
    int count;
  };

  Params params;
  bool valid = true;

  CUTLASS_DEVICE explicit KeyBlockScheduler(Params const& params) : params(params) {}

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& problem, cutlass::KernelHardwareInfo hw,
                                        ClusterShape const& cluster, TileShape const& tile) {
    const dim3 grid = Base::to_underlying_arguments(problem, hw, cluster, tile).grid;
    return {grid, false, 0, int(grid.x * grid.y * grid.z)};
  }

  // The most (batch, head) pairs, a power of two, whose Q, dO (Element) and fp32 dQ rows fit in
  // l2_bytes.
  static int group_for_l2(long l2_bytes, long seqlen_q, int head_dim, int element_size) {
    const long pair = seqlen_q * head_dim * (2 * element_size + 4);
    int group = 1;
    while (2l * group * pair <= l2_bytes) group *= 2;
    return group;
  }

  static dim3 get_grid_shape(Params const& params) {
    return params.group > 0 ? dim3(params.count, 1, 1) : params.grid;
  }

  CUTLASS_DEVICE bool is_valid() { return valid; }

  CUTLASS_DEVICE auto get_block_coord() {
    if (params.group > 0) {
      const int blocks = params.grid.x, pairs = params.grid.y * params.grid.z;
      const int index = blockIdx.x, per_group = params.group * blocks;
      const int first = index / per_group * params.group;
      const int members = min(params.group, pairs - first);  // the last group may be short
      const int within = index - first * blocks;
      const int pair = first + within % members;
      return make_coord(within / members, _0{}, make_coord(pair % int(params.grid.y), pair / int(params.grid.y)));
    }
    const int block = params.reversed ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x);
    return make_coord(block, _0{}, make_coord(int(blockIdx.y), int(blockIdx.z)));
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

// One launch of the main kernel: (batch, heads) pairs of sq query rows against sk keys, each
// tensor at a base pointer with its batch and head strides (elements; rows as in the op).
template <class Element>
struct BwdLaunch {
  int batch, heads, sq, sk;
  const Element *q, *k, *v, *grad_out;
  const float *lse, *sum_odo;
  float* dq_acc;
  Element *dk, *dv;
  long q_batch, q_head, k_batch, k_head, v_batch, v_head, do_batch, do_head;
  long lse_batch, lse_head, odo_batch, odo_head, acc_batch, acc_head, dk_batch, dk_head;
  int dk_row;
  bool shared_kv;  // every pair reads the K and V of pair (0, 0)
};

// The split tail: without a mask (each key block's CTA the same work) T CTAs on P SMs leave the
// last round r = T % P SMs busy and the rest idle (the standard grid at D=128: T = 4096 on 132
// SMs, 31 full rounds and 4 CTAs: 3 % of the kernel's time). Those r CTAs, the last key blocks
// of the last (batch, head), are left out of the launch and run as r x parts CTAs, each over
// Sq / parts query rows: a second launch whose batch is the parts (their K and V shared,
// BwdMainloop::shared_kv), whose dK and dV come out per part and one more kernel sums. Only by
// default (deterministic turns expect every key block in one CTA), without ALiBi (positions
// would restart in each part), from one full round, where the r CTAs lie within one (batch,
// head) and parts >= 2 divides Sq's query tiles.
struct BwdTailSplit {
  int blocks = 0;  // key blocks of the last (batch, head) left to the parts; 0: no split
  int parts = 1;
};

template <class Fusion, class TileShape>
BwdTailSplit plan_bwd_tail(const AttentionBwdSm90Params& p, int batch, int heads) {
  constexpr int kRows = get<0>(TileShape{}), kKeys = get<1>(TileShape{});
  BwdTailSplit plan;
  const int key_blocks = ceil_div(p.seqlen_k, kKeys), tiles = p.seqlen_q / kRows;
  const long ctas = long(key_blocks) * batch * heads;
  const int rest = int(ctas % p.sm_count);
  if (p.alloc == nullptr || Fusion::kReverseKeyBlocks || kIsAlibi<Fusion> || p.dq_semaphore != nullptr ||
      ctas < p.sm_count || rest == 0 || rest > key_blocks || p.seqlen_q % kRows != 0) {
    return plan;
  }
  int parts = std::min(tiles, p.sm_count / rest);
  while (parts > 1 && tiles % parts != 0) --parts;
  if (parts < 2) return plan;
  plan.blocks = rest;
  plan.parts = parts;
  return plan;
}

// Row r, column c of `rows` x dim: out[r * out_row_stride + c] = sum over the parts of
// part[i][r][c] (parts x rows x dim), in fp32; blockIdx.y picks dK (0) or dV (1).
template <class Element>
__global__ void sum_parts(const Element* part_k, const Element* part_v, int parts, int rows, int dim,
                          Element* dk, Element* dv, int out_row_stride) {
  const Element* part = blockIdx.y == 0 ? part_k : part_v;
  Element* out = (blockIdx.y == 0 ? dk : dv) + long(blockIdx.x) * out_row_stride;
  for (int c = threadIdx.x; c < dim; c += blockDim.x) {
    float acc = 0.f;
    for (int i = 0; i < parts; ++i) acc += float(part[(long(i) * rows + blockIdx.x) * dim + c]);
    out[c] = Element(acc);
  }
}

template <class Element, class Fusion, class TileShape>
void launch_bwd(const AttentionBwdSm90Params& p, const BwdLaunch<Element>& l, int member, int count,
                cudaStream_t stream) {
  using K = BwdKernel<Element, Fusion, TileShape>;
  using Kernel = typename K::Kernel;
  using Mainloop = typename K::Mainloop;
  const int group = p.heads_q / p.heads_kv, d = p.head_dim;
  const int q_tiles = ceil_div(p.seqlen_q, int(get<0>(TileShape{})));
  const typename K::Scaled::Arguments scaled{
      {{l.q, {int(l.q_batch), int(l.q_head), p.q_row_stride, _1{}},
        l.k, {int(l.k_batch), int(l.k_head), p.k_row_stride, _1{}},
        l.v, {int(l.v_batch), int(l.v_head), p.v_row_stride, _1{}},
        l.grad_out, {int(l.do_batch), int(l.do_head), p.grad_out_row_stride, _1{}},
        l.lse, {int(l.lse_batch), int(l.lse_head), _1{}},
        l.sum_odo, {int(l.odo_batch), int(l.odo_head), _1{}},
        l.dq_acc, {int(l.acc_batch), int(l.acc_head), d, _1{}}},
       p.dq_semaphore == nullptr ? nullptr : p.dq_semaphore + long(member) * q_tiles,
       p.heads_q * q_tiles, q_tiles * group, p.sm_count,
       l.dq_acc, l.acc_batch, l.acc_head, l.shared_kv},
      p.scale};
  typename Mainloop::Arguments mainloop_args;
  if constexpr (kIsAlibi<Fusion>) {  // query heads g, g + G, ...
    mainloop_args = {scaled, p.alibi_slopes + long(member) * p.alibi_head_stride, p.alibi_batch_stride,
                     p.alibi_head_stride * group};
  } else {
    mainloop_args = scaled;
  }
  cutlass::KernelHardwareInfo hw;
  hw.device_id = p.device;
  typename Kernel::Arguments args{
      {l.batch, l.heads, l.sq, l.sk, d},
      mainloop_args,
      {l.dk, {int(l.dk_batch), int(l.dk_head), l.dk_row, _1{}}, l.dv, {int(l.dk_batch), int(l.dk_head), l.dk_row, _1{}}},
      hw};
  if (!Kernel::can_implement(args)) {
    throw std::runtime_error("flash.attention_backward (sm90 kernel): unsupported problem (head dim " +
                             std::to_string(d) + ", seqlen_q " + std::to_string(l.sq) + ")");
  }
  auto params = Kernel::to_underlying_arguments(args, nullptr);
  auto& scheduler = params.tile_scheduler;
  scheduler.reversed = Fusion::kReverseKeyBlocks && p.dq_semaphore != nullptr;
  if (Fusion::kReverseKeyBlocks && p.dq_semaphore == nullptr) {
    scheduler.group = KeyBlockScheduler::group_for_l2(p.l2_bytes, l.sq, d, int(sizeof(Element)));
  }
  if (count < scheduler.count) {  // the first count CTAs in the 3-D grid's order
    scheduler.group = 1;
    scheduler.count = count;
  }
  cutlass::device_kernel<Kernel>
      <<<Kernel::get_grid_shape(params), Kernel::get_block_shape(), Kernel::SharedStorageSize, stream>>>(params);
  check_cuda(cudaGetLastError(), "backward kernel launch");
}

template <class Element, class Fusion, class TileShape>
void run_bwd(const AttentionBwdSm90Params& p, cudaStream_t stream) {
  using K = BwdKernel<Element, Fusion, TileShape>;
  constexpr int kKeys = get<1>(TileShape{});
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

  allow_shared_memory<typename K::Kernel>(p.device);
  const BwdTailSplit tail = plan_bwd_tail<Fusion, TileShape>(p, p.batch, p.heads_kv);
  const int key_blocks = ceil_div(p.seqlen_k, kKeys);
  const int key0 = (key_blocks - tail.blocks) * kKeys, keys = p.seqlen_k - key0;  // the tail's keys
  Element* part_k = tail.blocks == 0 ? nullptr : static_cast<Element*>(p.alloc(
      p.alloc_ctx, 2 * size_t(tail.parts) * keys * d * sizeof(Element)));  // dK, then dV, of each part
  Element* part_v = part_k == nullptr ? nullptr : part_k + long(tail.parts) * keys * d;
  for (int g = 0; g < group; ++g) {  // query heads g, g + G, ... against kv heads 0, 1, ...
    const BwdLaunch<Element> l{
        p.batch, p.heads_kv, sq, p.seqlen_k,
        static_cast<const Element*>(p.q) + long(g) * p.q_head_stride, static_cast<const Element*>(p.k),
        static_cast<const Element*>(p.v), static_cast<const Element*>(p.grad_out) + long(g) * p.grad_out_head_stride,
        p.lse + long(g) * p.lse_head_stride, p.sum_odo + long(g) * sq, p.dq_acc + long(g) * acc_head,
        static_cast<Element*>(p.dk) + g * p.dkv_member_stride, static_cast<Element*>(p.dv) + g * p.dkv_member_stride,
        p.q_batch_stride, long(p.q_head_stride) * group, p.k_batch_stride, p.k_head_stride,
        p.v_batch_stride, p.v_head_stride, p.grad_out_batch_stride, long(p.grad_out_head_stride) * group,
        p.lse_batch_stride, long(p.lse_head_stride) * group, long(p.heads_q) * sq, long(sq) * group,
        long(p.heads_q) * acc_head, long(acc_head) * group, p.dk_batch_stride, p.dk_head_stride,
        p.dk_row_stride, false};
    const long ctas = long(key_blocks) * p.batch * p.heads_kv;
    launch_bwd<Element, Fusion, TileShape>(p, l, g, int(ctas - tail.blocks), stream);
    if (tail.blocks == 0) continue;

    // The tail: the last tail.blocks key blocks of (B - 1, Hkv - 1), the parts as the batch.
    const int rows = sq / tail.parts;
    auto last = [](auto* base, long batch, long head, long row) { return base + batch + head + row; };
    const long b1 = p.batch - 1, h1 = p.heads_kv - 1;
    BwdLaunch<Element> t = l;
    t.batch = tail.parts;
    t.heads = 1;
    t.sq = rows;
    t.sk = keys;
    t.q = last(l.q, b1 * l.q_batch, h1 * l.q_head, 0);
    t.grad_out = last(l.grad_out, b1 * l.do_batch, h1 * l.do_head, 0);
    t.k = last(l.k, b1 * l.k_batch, h1 * l.k_head, long(key0) * p.k_row_stride);
    t.v = last(l.v, b1 * l.v_batch, h1 * l.v_head, long(key0) * p.v_row_stride);
    t.lse = last(l.lse, b1 * l.lse_batch, h1 * l.lse_head, 0);
    t.sum_odo = last(l.sum_odo, b1 * l.odo_batch, h1 * l.odo_head, 0);
    t.dq_acc = last(l.dq_acc, b1 * l.acc_batch, h1 * l.acc_head, 0);
    t.q_batch = long(rows) * p.q_row_stride;
    t.do_batch = long(rows) * p.grad_out_row_stride;
    t.lse_batch = t.odo_batch = rows;
    t.acc_batch = long(rows) * d;  // whole query tiles: their floats lie in row order
    t.dk = part_k;
    t.dv = part_v;
    t.dk_batch = long(keys) * d;
    t.dk_head = t.dk_batch * tail.parts;  // one head: any stride TMA accepts
    t.dk_row = d;
    t.shared_kv = true;
    launch_bwd<Element, Fusion, TileShape>(p, t, g, tail.blocks * tail.parts, stream);
    sum_parts<Element><<<dim3(keys, 2), 128, 0, stream>>>(
        part_k, part_v, tail.parts, keys, d, last(l.dk, b1 * l.dk_batch, h1 * l.dk_head, long(key0) * l.dk_row),
        last(l.dv, b1 * l.dk_batch, h1 * l.dk_head, long(key0) * l.dk_row), l.dk_row);
    check_cuda(cudaGetLastError(), "tail dK/dV sums");
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
