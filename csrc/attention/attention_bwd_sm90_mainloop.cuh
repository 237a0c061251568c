// The Hopper backward's mainloop: consumers sharing dQ, and the dQ reducer warp.
//
// 88_hopper_fmha's backward gives each consumer warpgroup half of the CTA's key block: both
// compute S, dP, dV and dK of their half (four 64 x 64 x D GEMMs a query tile), and the second
// warpgroup alone computes the query tile's whole dQ = dS K over the block's keys (two more), so
// it runs six GEMMs to the first's four. Here both warpgroups share the dQ GEMM, five each, over
// all keys of the block from both warpgroups' dS, exchanged through shared memory (DQSplit):
//   kHeadDim  (D = 128) each warpgroup computes dQ for half of the head dim;
//   kRows     (128 query rows a step, D = 64) each computes dQ for half of the rows (half of
//             D = 64, 64 bytes, would be narrower than a 128-byte swizzle atom).
// dK = dS^T Q takes dS from registers, as dV = P^T dO takes P. dV is issued before the exchange,
// so the tensor cores have it while a warpgroup waits for the other's dS; dK after the dQ GEMM,
// so that it runs while the warpgroup stores its dQ (FlashAttention 4's order).
// Named barriers (user ids):
//   kDsReady         both warpgroups' dS of this query tile are in shared memory
//   kDsFree + w      warpgroup w may overwrite its dS: the other one's dQ GEMM has read it
// The reducer warp returns a dQ stage to the consumers only once its bulk reductions have read it
// (the example's returned it one reduction early). Producer and epilogue are the example's.
#pragma once

#include <cmath>

#include "cutlass/arch/barrier.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cute/tensor.hpp"

#include "88_hopper_fmha/collective/fmha_collective_bwd_tma_warpspecialized.hpp"

#include "attention/attention_bwd_sm90.h"

namespace torch_flash::sm90 {

using namespace cute;

template <class Element, class TileShape, class Fusion>
struct BwdMainloop
    : cutlass::fmha::collective::FmhaBwdMainloopTmaWarpSpecialized<Element, float, TileShape, Fusion> {
  using Base = cutlass::fmha::collective::FmhaBwdMainloopTmaWarpSpecialized<Element, float, TileShape, Fusion>;
  using typename Base::MainloopPipeline;
  using typename Base::MainloopPipelineQ;
  using typename Base::PipelineState;
  using typename Base::PipelineStateQ;
  using typename Base::SharedStorage;
  using typename Base::TiledMmaND;
  using typename Base::TiledMmaNM;
  using typename Base::TileShapeMD;
  using typename Base::TileShapeND;
  using typename Base::TileShapeNM;

  static constexpr int kHeadDim = get<2>(TileShape{});
  static constexpr int kQueryRows = get<0>(TileShape{});
  static_assert(Base::NumMmaWarpGroups == 2);
  static_assert(kQueryRows % kBwdQueryRows == 0);
  // How the warpgroups share the dQ GEMM (above). A GMMA operand slice of half the head dim must
  // span whole 128-byte swizzle atoms; half the rows must be a whole GMMA tile (64).
  enum class DQSplit { kHeadDim, kRows };
  static constexpr DQSplit kSplit = kHeadDim / 2 * sizeof(Element) % 128 == 0 ? DQSplit::kHeadDim : DQSplit::kRows;
  static_assert(kSplit == DQSplit::kHeadDim || kQueryRows == 128, "dQ split: neither half of D nor of the rows");
  static constexpr int kDQRows = kSplit == DQSplit::kRows ? kQueryRows / 2 : kQueryRows;
  static constexpr int kDQCols = kSplit == DQSplit::kHeadDim ? kHeadDim / 2 : kHeadDim;

  // (query rows, head-dim columns, keys of one warpgroup): each warpgroup's dQ GEMM per dS half.
  using TileShapeDQ = Shape<Int<kDQRows>, Int<kDQCols>, tuple_element_t<2, TileShapeMD>>;
  using TiledMmaDQ = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cute::tuple<_1, int, cute::tuple<int, int>>, Base::Alignment,
      Element, cute::tuple<_1, int, cute::tuple<int, int>>, Base::Alignment,
      float, TileShapeDQ, typename Base::ClusterShape, typename Base::Stages,
      cutlass::gemm::KernelTmaWarpSpecialized>::CollectiveOp::TiledMma;

  static constexpr int kConsumerThreads = 2 * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kDsReady = 0;  // user named-barrier ids (CUTLASS reserves the ones below)
  static constexpr int kDsFree = 1;  // and 2

  // The dQ stage in thread order: warpgroup w's part (kDQRows x kDQCols floats) at w * kDqPart,
  // its thread t's accumulator floats 4v..4v+3 at (v * 128 + t) * 4 (128-bit stores, consecutive
  // threads in consecutive banks); the dq_acc buffer holds each tile in the same order, added by
  // one bulk reduction a part, and BwdConvertDq puts the rows back.
  static constexpr int kDqPart = kDQRows * kDQCols;
  static constexpr int kDqStage = 2 * kDqPart;
  static_assert(kDqStage == get<0>(TileShapeMD{}) * get<1>(TileShapeMD{}));
  static_assert(2 * kDqStage == cosize_v<typename Base::SmemLayoutDQ>, "two dQ stages");

  // dq_acc: fp32 zeros, a (batch, head)'s query tiles one after another at its batch and head
  // strides (floats), kDqStage floats each in the stage's order. dq_semaphore (B, H, query
  // tiles) int32 zeros, or null: each dQ tile then takes the key blocks' reductions in a fixed
  // order (torch.use_deterministic_algorithms), each CTA waiting until its predecessors have
  // added theirs, the first storing (dq_acc then needs zeros only in tiles no key block sees).
  // Strides in elements. resident_blocks: how many CTAs run at once (one an SM), the most key
  // blocks whose turns may follow their arrival (rotates()). shared_kv: every (batch, head)
  // reads the K and V of (0, 0) (the split tail's parts, BwdTailSplit).
  struct Arguments : Base::Arguments {
    int* dq_semaphore;
    int semaphore_batch_stride, semaphore_head_stride;
    int resident_blocks;
    float* dq_acc;
    long dq_acc_batch_stride, dq_acc_head_stride;
    bool shared_kv;
  };
  struct Params : Base::Params {
    int* dq_semaphore;
    int semaphore_batch_stride, semaphore_head_stride;
    int resident_blocks;
    float* dq_acc;
    long dq_acc_batch_stride, dq_acc_head_stride;
    bool shared_kv;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem, Arguments const& args, void* workspace) {
    return {Base::to_underlying_arguments(problem, args, workspace), args.dq_semaphore, args.semaphore_batch_stride,
            args.semaphore_head_stride, args.resident_blocks, args.dq_acc, args.dq_acc_batch_stride,
            args.dq_acc_head_stride, args.shared_kv};
  }

  // The query tiles of a CTA run from first_tile, wrapping around. Under deterministic dQ
  // without a causal mask every key block adds into every tile in its turn: started together at
  // tile 0, the CTAs of a head would queue there behind each other, so each starts at
  // key block * tiles / key blocks instead and a tile's turns follow the order in which the CTAs
  // reach it (ArrivalTurns). That needs all of a head's blocks resident at once: a block waits
  // on ones that start later, so with more blocks than resident CTAs they could wait on blocks
  // never dispatched. Elsewhere (more blocks, or key blocks * tiles past 32 bits) from tile 0 in
  // block order, each waiting only on blocks dispatched before it; the causal mask staggers the
  // CTAs itself.
  struct TileIter {
    int tile, count;
    CUTLASS_DEVICE int operator*() const { return tile; }
    CUTLASS_DEVICE TileIter& operator++() {
      tile = tile + 1 == count ? 0 : tile + 1;
      return *this;
    }
  };

  template <class ProblemShape>
  static CUTLASS_DEVICE bool rotates(Params const& params, ProblemShape const& problem, int tiles) {
    return !Fusion::kReverseKeyBlocks && params.dq_semaphore != nullptr &&
           key_blocks(problem) <= params.resident_blocks &&
           (long(key_blocks(problem)) + 1) * (tiles + 1) < (1l << 31);
  }

  template <class BlkCoord, class ProblemShape>
  static CUTLASS_DEVICE int first_tile(BlkCoord const& blk, Params const& params, ProblemShape const& problem,
                                       int tiles) {
    return rotates(params, problem, tiles) ? get<1>(blk) * tiles / key_blocks(problem) : 0;
  }

  // The tiles before the first that sees the CTA's key block (the causal mask's; never rotated).
  template <class BlkCoord, class ProblemShape>
  static CUTLASS_DEVICE int skipped_tiles(BlkCoord const& blk, ProblemShape const& problem, int tiles) {
    return min(tiles, Fusion{}.first_query_tile(get<1>(blk), TileShape{}, problem));
  }

  template <class ProblemShape>
  static CUTLASS_DEVICE int key_blocks(ProblemShape const& problem) {
    return ceil_div(int(get<3>(problem)), int(get<1>(TileShape{})));
  }

  // Key block n's turns when each block starts at first_tile: the blocks reach tile t in the order
  // of how far into their sequence t lies ((t - start) mod tiles), ties by index. Starts rise with
  // n, so those starting at or before t come first, the latest start first, then the others
  // likewise. 32-bit arithmetic (rotates()): the reducer warp has 24 registers.
  struct ArrivalTurns {
    int blocks, tiles, start, offset;
    CUTLASS_DEVICE ArrivalTurns(int n, int blocks, int tiles) : blocks(blocks), tiles(tiles), start(n * tiles / blocks) {
      const int first = (start * blocks + tiles - 1) / tiles;  // the first and last blocks of this start
      const int last = ((start + 1) * blocks + tiles - 1) / tiles - 1;
      offset = n - first - 1 - last;
    }
    CUTLASS_DEVICE int operator()(int t) const {
      const int started = min(blocks, ((t + 1) * blocks + tiles - 1) / tiles);  // the blocks starting <= t
      return started + offset + (t < start ? blocks : 0);
    }
  };

  // The producer warp, in the example's order (K0 Q0 lse0 V0 K1 dO0 sum(dO*O)0 V1, then Q, lse,
  // dO and sum(dO * O) a query tile) over the CTA's tiles from first_tile, skipping those the
  // mask leaves out. Only the elected lane loads and advances its tile iterator.
  template <bool kLoadOuter, class BlkCoord, class ProblemShape, class LoadWarpBarrier>
  CUTLASS_DEVICE void load_kv_maybe_q(int block_rank_in_cluster, BlkCoord const& blk_coord, Params const& params,
                                      ProblemShape const& problem_size, MainloopPipeline& pipeline_inner,
                                      PipelineState& write_inner, MainloopPipelineQ& pipeline_outer,
                                      PipelineStateQ& write_outer, SharedStorage& storage, LoadWarpBarrier&, bool) {
    static_assert(kLoadOuter, "one producer warp loads K, V and the query tiles");
    const int lane_predicate = cute::elect_one_sync();
    int outer_count = Base::NumMmaWarpGroups;
    const int tiles = this->get_inner_tile_count(blk_coord, problem_size);
    const int skipped = skipped_tiles(blk_coord, problem_size, tiles);
    int inner_count = tiles - skipped;
    auto outer = cute::make_coord_iterator(outer_count);
    TileIter inner{first_tile(blk_coord, params, problem_size, tiles) + skipped, tiles};

    typename Base::LoadQ load_q{params.tma_load_q, pipeline_inner, storage.smem_q};
    typename Base::LoadDO load_do{params.tma_load_do, pipeline_inner, storage.smem_do};
    typename Base::LoadK load_k{params.tma_load_k, pipeline_outer, storage.smem_k};
    typename Base::LoadV load_v{params.tma_load_v, pipeline_outer, storage.smem_v};
    typename Base::LoadLSE load_lse{params.tma_load_lse, pipeline_inner, storage.smem_lse};
    typename Base::LoadODO load_odo{params.tma_load_odo, pipeline_inner, storage.smem_sumOdO};
    auto state_q = load_q.init_state(block_rank_in_cluster, problem_size, TileShapeNM{}, blk_coord, inner_count);
    auto state_do = load_do.init_state(block_rank_in_cluster, problem_size, TileShapeNM{}, blk_coord, inner_count);
    const auto kv_coord = make_coord(get<0>(blk_coord), get<1>(blk_coord),
                                     make_coord(params.shared_kv ? 0 : get<2, 0>(blk_coord),
                                                params.shared_kv ? 0 : get<2, 1>(blk_coord)));
    auto state_k = load_k.init_state(_0{}, problem_size, TileShapeNM{}, kv_coord, outer_count);
    auto state_v = load_v.init_state(_0{}, problem_size, TileShapeNM{}, kv_coord, outer_count);
    auto state_lse = load_lse.init_state(_0{}, problem_size, TileShapeNM{}, blk_coord, outer_count);
    auto state_odo = load_odo.init_state(_0{}, problem_size, TileShapeNM{}, blk_coord, outer_count);
    outer_count *= 2;  // K and V
    inner_count *= 4;  // Q, lse, dO and sum(dO * O)

    auto load_q_lse = [&] {
      load_q.template step<false, false, true>(inner, state_q, write_inner, lane_predicate, inner_count);
      load_lse.template step<false, true, false>(inner, state_lse, write_inner, lane_predicate, inner_count);
    };
    auto load_do_odo = [&] {
      load_do.template step<false, false, true>(inner, state_do, write_inner, lane_predicate, inner_count);
      load_odo.template step<true, true, false>(inner, state_odo, write_inner, lane_predicate, inner_count);
    };
    load_k.template step<false>(outer, state_k, write_outer, lane_predicate, outer_count);
    load_q_lse();
    load_v.template step<true>(outer, state_v, write_outer, lane_predicate, outer_count);
    load_k.template step<false>(outer, state_k, write_outer, lane_predicate, outer_count);
    load_do_odo();
    load_v.template step<true>(outer, state_v, write_outer, lane_predicate, outer_count);
    CUTLASS_PRAGMA_NO_UNROLL
    while (inner_count > 0) {
      load_q_lse();
      load_do_odo();
    }
  }

  // The reducer warp: each dQ tile the consumers leave in a stage is added into the fp32 dQ
  // buffer by one bulk reduction a warpgroup's part (stored by a bulk copy on a deterministic
  // tile's first turn); a stage goes back once they have read it.
  template <class BlkCoord, class ProblemShape, class PipelineReducer, class PipelineStateReducer>
  CUTLASS_DEVICE void reduce(BlkCoord const& blk_coord, Params const& params, ProblemShape const& problem_size,
                             PipelineReducer& pipeline, PipelineStateReducer& read, SharedStorage& storage) {
    const bool leader = cute::elect_one_sync();
    float* const dq_acc = params.dq_acc + get<2, 0>(blk_coord) * params.dq_acc_batch_stride +
                          get<2, 1>(blk_coord) * params.dq_acc_head_stride;
    const uint32_t stages = cute::cast_smem_ptr_to_uint(storage.smem_dq.data());

    // Deterministic turns: under the causal mask the key blocks that add into a query tile are a
    // prefix 0..last, taken last first; without it all of them, in arrival order where the CTAs
    // rotate (rotates()), else by index.
    const int key_block = get<1>(blk_coord);
    int* const locks = params.dq_semaphore == nullptr ? nullptr
        : params.dq_semaphore + get<2, 0>(blk_coord) * params.semaphore_batch_stride +
              get<2, 1>(blk_coord) * params.semaphore_head_stride;

    // The stage to return once the next reduction has been issued, -1 for none (an index only:
    // this warp runs on 24 registers). Deterministic turns without deferral return each stage as
    // soon as its reduction has completed, which passing the turn waits for anyway.
    int previous = -1;
    const int tiles = this->get_inner_tile_count(blk_coord, problem_size);
    const int skipped = skipped_tiles(blk_coord, problem_size, tiles);
    TileIter q_tile{first_tile(blk_coord, params, problem_size, tiles) + skipped, tiles};
    // one tile: every block starts at tile 0, and a block's turn is its index
    const bool rotated = rotates(params, problem_size, tiles);
    const ArrivalTurns turns(key_block, key_blocks(problem_size), rotated ? tiles : 1);
    // Deferred turns: a tile's turn passes once the next tile's reductions have been issued, so
    // that waiting for one tile's reductions to complete overlaps the next tile's instead of
    // stalling this warp. Only where the next key block reaches a tile two or more tiles later
    // (two query tiles a key block, D = 128): under the causal mask always, without it where the
    // blocks' starting tiles lie two or more apart. A waits only on blocks later in a tile's
    // order, which never wait on A: no cycle.
    constexpr bool kTwoTilesABlock = 2 * kQueryRows <= int(get<1>(TileShape{}));
    const bool defer = kTwoTilesABlock && locks != nullptr &&
                       (Fusion::kReverseKeyBlocks || (rotated && tiles >= 2 * key_blocks(problem_size)));
    int pending = -1;  // deferred: the tile whose turn is still to pass
    for (int i = skipped; i < tiles; ++i, ++q_tile) {
      pipeline.consumer_wait(read);
      if (leader) {
        bool first = false;  // the tile's first turn stores: dq_acc may hold anything there
        if (locks) {
          int turn;
          if constexpr (Fusion::kReverseKeyBlocks) {
            turn = Fusion{}.last_key_block(*q_tile, TileShape{}, problem_size) - key_block;
          } else {
            turn = turns(*q_tile);
          }
          wait_for_turn(locks + *q_tile, turn);
          first = turn == 0;
        }
        CUTLASS_PRAGMA_UNROLL
        for (int part = 0; part < 2; ++part) {
          float* const dst = dq_acc + long(*q_tile) * kDqStage + part * kDqPart;
          const uint32_t src = stages + (read.index() * kDqStage + part * kDqPart) * uint32_t(sizeof(float));
          if (first) {
            bulk_store(dst, src);
          } else {
            bulk_reduce_add(dst, src);
          }
        }
        tma_store_arrive();
        if (defer) {
          if (pending >= 0) pass_turn<1>(locks + pending);  // also: the previous stage is read
          pending = *q_tile;
        } else if (locks) {
          pass_turn<0>(locks + *q_tile);
        } else {
          tma_store_wait<1>();  // the previous tile's reduction has read its stage
        }
      }
      __syncwarp();
      if (locks && !defer) {  // pass_turn waited for the reduction: its stage is free
        pipeline.consumer_release(read);
      } else {
        if (previous >= 0) pipeline.consumer_release(PipelineStateReducer(previous, 0, 0));
        previous = read.index();
      }
      ++read;
    }
    if (leader) {
      tma_store_wait<0>();
      if (pending >= 0) pass_turn<0>(locks + pending);
    }
    __syncwarp();
    if (previous >= 0) pipeline.consumer_release(PipelineStateReducer(previous, 0, 0));
  }

  static CUTLASS_DEVICE void wait_for_turn(int const* lock, int turn) {
    int seen;
    do {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(lock) : "memory");
    } while (seen != turn);
    asm volatile("fence.proxy.async.global;" ::: "memory");  // before the bulk reductions
  }

  // Once this thread's bulk reductions but the newest kNewer groups have completed (not only read
  // shared memory).
  template <int kNewer>
  static CUTLASS_DEVICE void pass_turn(int* lock) {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kNewer) : "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(lock) : "memory");
  }

  // One warpgroup's part of a dQ stage added into dq_acc, or stored there (bulk copies,
  // completed by the bulk group as the tensor reductions are).
  static CUTLASS_DEVICE void bulk_reduce_add(float* dst, uint32_t src) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 ::"l"(dst), "r"(src), "n"(kDqPart * int(sizeof(float))) : "memory");
  }
  static CUTLASS_DEVICE void bulk_store(float* dst, uint32_t src) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(dst), "r"(src), "n"(kDqPart * int(sizeof(float))) : "memory");
  }

  // A shared-memory operand's GMMA descriptors, re-derived in the loop from an opaque base: hoisted
  // out of it, the loop-invariant ones (K, V and dS, every k-block) outgrow the uniform registers
  // and spill. Only the base stays live; each descriptor is an add from it.
  template <class FragTensor>
  static CUTLASS_DEVICE auto in_loop(FragTensor const& t) {
    auto iter = t.data();
    asm volatile("" : "+r"(iter.desc_.reg32_[0]));
    return make_tensor(iter, t.layout());
  }

  template <class BlkCoord, class ProblemShape, class PipelineReducer, class PipelineStateReducer, class OrderBarrier>
  CUTLASS_DEVICE auto compute(BlkCoord const& blk_coord, BlkCoord const& wg_coord, Params const& params,
                              ProblemShape const& problem_size, MainloopPipeline& pipeline_inner,
                              PipelineState& smem_pipe_read_inner, MainloopPipelineQ& pipeline_outer,
                              PipelineStateQ& smem_pipe_read_outer, PipelineReducer& pipeline_reducer,
                              PipelineStateReducer& smem_pipe_write_reducer, SharedStorage& storage,
                              OrderBarrier& order_barrier) {
    const int thread_idx = int(threadIdx.x) % cutlass::NumThreadsPerWarpGroup;
    const int wg_idx = __shfl_sync(0xffffffff, get<1>(wg_coord) % 2, 0);
    constexpr auto kRows = get<1>(TileShapeNM{});  // query rows a step
    constexpr auto kKeys = get<0>(TileShapeNM{});  // keys of one warpgroup

    TiledMmaND mma_nd;
    Tensor acc_DV = partition_fragment_C(mma_nd, take<0, 2>(TileShapeND{}));
    Tensor acc_DK = partition_fragment_C(mma_nd, take<0, 2>(TileShapeND{}));
    clear(acc_DV);
    clear(acc_DK);

    // This warpgroup's K and V sit in outer stages 2w and 2w + 1; the other's K two stages on.
    // smem_pipe_read_outer stays where it is: the kernel's advances around compute already add
    // up to one work item's outer loads (the example's compute moved it two more, which left a
    // CTA's second item reading the wrong stages).
    PipelineStateQ read_k = smem_pipe_read_outer;
    PipelineStateQ read_v = read_k;
    ++read_v;
    pipeline_outer.consumer_wait(read_k);
    pipeline_outer.consumer_wait(read_v);
    PipelineStateQ read_k_other = read_k;
    read_k_other.advance(2);

    // S = K Q^T and dP = V dO^T, (keys, rows), both operands in shared memory.
    TiledMmaNM mma_nm;
    auto thr_nm = mma_nm.get_thread_slice(thread_idx);
    Tensor tSrK = thr_nm.make_fragment_A(thr_nm.partition_A(
        make_tensor(make_smem_ptr(storage.smem_k.data()), typename Base::SmemLayoutK{})));
    Tensor tSrQ = thr_nm.make_fragment_B(thr_nm.partition_B(
        make_tensor(make_smem_ptr(storage.smem_q.data()), typename Base::SmemLayoutQ{})));
    Tensor tDPrV = thr_nm.make_fragment_A(thr_nm.partition_A(
        make_tensor(make_smem_ptr(storage.smem_v.data()), typename Base::SmemLayoutV{})));
    Tensor tDPrDO = thr_nm.make_fragment_B(thr_nm.partition_B(
        make_tensor(make_smem_ptr(storage.smem_do.data()), typename Base::SmemLayoutDO{})));

    // dV += P^T dO and dK += dS^T Q, P and dS from registers.
    auto thr_nd = mma_nd.get_thread_slice(thread_idx);
    Tensor tDVrDO = thr_nd.make_fragment_B(thr_nd.partition_B(
        make_tensor(make_smem_ptr(storage.smem_dop.data()), typename Base::SmemLayoutDOp{})));
    Tensor tDKrQ = thr_nd.make_fragment_B(thr_nd.partition_B(
        make_tensor(make_smem_ptr(storage.smem_qp.data()), typename Base::SmemLayoutQp{})));

    // dS: (rows, keys, warpgroup) as the dQ GEMM reads it; (keys, rows, warpgroup) as written.
    Tensor sDS = make_tensor(make_smem_ptr(storage.smem_ds.data()), typename Base::SmemLayoutDS{});
    Tensor sDSt = sDS.compose(make_layout(make_shape(size<1>(sDS), size<0>(sDS), size<2>(sDS)),
                                          make_stride(size<0>(sDS), _1{}, size<1>(sDS) * size<0>(sDS))));
    // dS leaves the S/dP accumulator layout by stmatrix: four 8x8 matrices an instruction, a row
    // of 8 query rows (16 contiguous bytes of sDSt) an address, instead of a 32-bit store a pair.
    auto ds_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_nm);
    auto thr_ds_copy = ds_copy.get_thread_slice(thread_idx);
    Tensor tDSsDS = thr_ds_copy.partition_D(sDSt);

    // kHeadDim: dQ[:, this warpgroup's half of D] = dS K, K (D, keys, stage) sliced to the half.
    // kRows: dQ[this warpgroup's half of the rows, :] = dS K, dS (rows, keys, wg) sliced to it.
    const int dq_row_part = kSplit == DQSplit::kRows ? wg_idx : 0;
    const int dq_col_part = kSplit == DQSplit::kHeadDim ? wg_idx : 0;
    TiledMmaDQ mma_dq;
    auto thr_dq = mma_dq.get_thread_slice(thread_idx);
    Tensor sDSPart = local_tile(sDS, make_shape(Int<kDQRows>{}, size<1>(sDS), size<2>(sDS)),
                                make_coord(dq_row_part, _0{}, _0{}));
    Tensor tDQrDS = thr_dq.make_fragment_A(thr_dq.partition_A(sDSPart));
    Tensor sKp = make_tensor(make_smem_ptr(storage.smem_kp.data()), typename Base::SmemLayoutKp{});
    Tensor sKpPart = local_tile(sKp, make_shape(Int<kDQCols>{}, size<1>(sKp), size<2>(sKp)),
                                make_coord(dq_col_part, _0{}, _0{}));
    Tensor tDQrK = thr_dq.make_fragment_B(thr_dq.partition_B(sKpPart));
    // This thread's first float of its part of dQ stage 0 (the stage's thread order, above).
    const uint32_t dq_thread = cute::cast_smem_ptr_to_uint(storage.smem_dq.data()) +
                               uint32_t((wg_idx * kDqPart + thread_idx * 4) * sizeof(float));
    const int k_stage[2] = {wg_idx == 0 ? read_k.index() : read_k_other.index(),
                            wg_idx == 1 ? read_k.index() : read_k_other.index()};

    // lse and sum(dO * O) per query row, broadcast over keys.
    constexpr int kStages = Base::StageCount;
    Tensor tSsLSE = thr_nm.partition_C(make_tensor(make_smem_ptr(storage.smem_lse.data()),
                                                   make_shape(kKeys, kRows, Int<kStages>{}),
                                                   make_stride(_0{}, _1{}, kRows)));
    Tensor tDPsODO = thr_nm.partition_C(make_tensor(make_smem_ptr(storage.smem_sumOdO.data()),
                                                    make_shape(kKeys, kRows, Int<kStages>{}),
                                                    make_stride(_0{}, _1{}, kRows)));
    Tensor cS = make_identity_tensor(take<0, 2>(TileShapeNM{}));
    Tensor tScS = thr_nm.partition_C(cS);
    const int key_block = get<1>(wg_coord);
    tScS.data() = tScS.data() + E<0>{} * key_block * get<0>(TileShapeNM{});
    const auto tScS_origin = tScS.data();

    // ds_ready: both halves of dS are in shared memory for the dQ GEMMs.
    cutlass::arch::NamedBarrier ds_ready(kConsumerThreads, kDsReady);
    cutlass::arch::NamedBarrier my_ds_free(kConsumerThreads, kDsFree + wg_idx);
    cutlass::arch::NamedBarrier other_ds_free(kConsumerThreads, kDsFree + 1 - wg_idx);
    // Nothing of the other's dS read yet; balanced by the sync after the loop.
    other_ds_free.arrive();

    const int total = this->get_inner_tile_count(wg_coord, problem_size);
    const int skipped = skipped_tiles(blk_coord, problem_size, total);
    TileIter q_tile{first_tile(blk_coord, params, problem_size, total) + skipped, total};
    for (int tiles = total - skipped; tiles > 0; --tiles, ++q_tile) {
      tScS.data() = tScS_origin + E<1>{} * (*q_tile * get<1>(TileShapeNM{}));

      Tensor tSrK_ = in_loop(tSrK);
      Tensor tSrQ_ = in_loop(tSrQ);
      Tensor tDPrV_ = in_loop(tDPrV);
      Tensor tDPrDO_ = in_loop(tDPrDO);
      Tensor tDVrDO_ = in_loop(tDVrDO);
      Tensor tDKrQ_ = in_loop(tDKrQ);
      Tensor tDQrDS_ = in_loop(tDQrDS);
      Tensor tDQrK_ = in_loop(tDQrK);

      pipeline_inner.consumer_wait(smem_pipe_read_inner);
      PipelineState read_q = smem_pipe_read_inner;
      ++smem_pipe_read_inner;
      PipelineState read_do = smem_pipe_read_inner;
      ++smem_pipe_read_inner;

      Tensor acc_S = partition_fragment_C(mma_nm, take<0, 2>(TileShapeNM{}));
      warpgroup_fence_operand(acc_S);
      warpgroup_arrive();
      cutlass::fmha::collective::gemm_zero_acc(mma_nm, tSrK_(_, _, _, read_k.index()), tSrQ_(_, _, _, read_q.index()), acc_S);
      warpgroup_commit_batch();

      pipeline_inner.consumer_wait(read_do);
      Tensor acc_DP = partition_fragment_C(mma_nm, take<0, 2>(TileShapeNM{}));
      warpgroup_fence_operand(acc_DP);
      warpgroup_arrive();
      cutlass::fmha::collective::gemm_zero_acc(mma_nm, tDPrV_(_, _, _, read_v.index()), tDPrDO_(_, _, _, read_do.index()), acc_DP);
      warpgroup_commit_batch();

      // lse and sum(dO * O) are read from shared memory where used (a broadcast load a row):
      // register fragments of them would hold 64 floats a thread across the two GEMMs.
      Tensor lse = tSsLSE(_, _, _, read_q.index());
      Tensor odo = tDPsODO(_, _, _, read_do.index());

      // P from S, the warpgroups' exponentials taking turns so one's overlaps the other's GEMMs.
      warpgroup_wait<1>();
      warpgroup_fence_operand(acc_S);
      order_barrier.wait();
      Fusion{}.before_softmax(acc_S, tScS, problem_size);
      Tensor acc_P = make_fragment_like<float>(acc_S);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc_P); i++) acc_P(i) = ::exp2f(params.scale_softmax_log2 * acc_S(i) - float(M_LOG2E) * lse(i));
      order_barrier.arrive();

      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_DP);
      // dS in registers: the dK GEMM's A operand, in the accumulator's order (16-bit elements),
      // and, published, the dQ GEMMs'.
      Tensor op_DS = make_fragment_like<Element>(
          cutlass::fmha::collective::convert_c_layout_to_a_layout(acc_DP.layout(), shape<1>(typename TiledMmaND::LayoutA_TV{})));
      Tensor acc_DS = make_tensor(op_DS.data(), acc_DP.layout());
      static_assert(sizeof(Element) == 2);
      // dS = P scale (dP - odo) as P fma(dP, scale, -scale odo): one FFMA and one FMUL a score
      // (-scale odo is the row's, shared by its keys) instead of an FADD and two FMULs.
      const float scale = params.scale_softmax;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc_DS); i++) acc_DS(i) = Element(acc_P(i) * fmaf(acc_DP(i), scale, -scale * odo(i)));

      auto op_P = cutlass::fmha::collective::make_acc_into_op<Element>(acc_P, typename TiledMmaND::LayoutA_TV{});
      warpgroup_fence_operand(acc_DV);
      warpgroup_fence_operand(acc_DK);
      warpgroup_fence_operand(op_P);
      warpgroup_fence_operand(op_DS);
      warpgroup_arrive();
      cute::gemm(mma_nd, op_P, tDVrDO_(_, _, _, read_do.index()), acc_DV);
      warpgroup_commit_batch();

      // Publish this warpgroup's dS once the other's dQ GEMM of the previous tile has read it.
      my_ds_free.sync();
      copy(ds_copy, thr_ds_copy.retile_S(acc_DS), tDSsDS(_, _, _, wg_idx));
      cutlass::arch::fence_view_async_shared();
      ds_ready.sync();

      Tensor acc_DQ = partition_fragment_C(mma_dq, take<0, 2>(TileShapeDQ{}));
      warpgroup_fence_operand(acc_DQ);
      warpgroup_arrive();
      cutlass::fmha::collective::gemm_zero_acc(mma_dq, tDQrDS_(_, _, _, 0), tDQrK_(_, _, _, k_stage[0]), acc_DQ);
      cute::gemm(mma_dq, tDQrDS_(_, _, _, 1), tDQrK_(_, _, _, k_stage[1]), acc_DQ);
      warpgroup_commit_batch();
      // dK last: its GEMM (dS from registers, Q from shared memory) runs under the dQ stores.
      warpgroup_arrive();
      cute::gemm(mma_nd, op_DS, tDKrQ_(_, _, _, read_q.index()), acc_DK);
      warpgroup_commit_batch();

      warpgroup_wait<1>();  // dV and dQ done
      warpgroup_fence_operand(acc_DV);
      warpgroup_fence_operand(acc_DQ);
      other_ds_free.arrive();

      // This warpgroup's part of the dQ tile into the reducer's stage; the reducer warp adds the
      // whole tile into the fp32 dQ buffer once both warpgroups have committed.
      pipeline_reducer.producer_acquire(smem_pipe_write_reducer);
      static_assert(decltype(size(acc_DQ))::value % 4 == 0);
      const uint32_t dq_stage = dq_thread + uint32_t(smem_pipe_write_reducer.index() * kDqStage * sizeof(float));
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < size(acc_DQ) / 4; v++) {
        const uint32_t dst = dq_stage + uint32_t(v * cutlass::NumThreadsPerWarpGroup * 4 * sizeof(float));
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "f"(acc_DQ(4 * v)), "f"(acc_DQ(4 * v + 1)),
                     "f"(acc_DQ(4 * v + 2)), "f"(acc_DQ(4 * v + 3))
                     : "memory");
      }
      cutlass::arch::fence_view_async_shared();
      pipeline_reducer.producer_commit(smem_pipe_write_reducer);
      ++smem_pipe_write_reducer;

      warpgroup_wait<0>();  // dK done
      warpgroup_fence_operand(acc_DK);
      warpgroup_fence_operand(op_DS);
      // The GEMMs have read Q and dO: release them.
      pipeline_inner.consumer_release(read_q);
      pipeline_inner.consumer_release(read_do);
    }
    my_ds_free.sync();

    pipeline_outer.consumer_release(read_k);
    pipeline_outer.consumer_release(read_v);
    pipeline_reducer.producer_tail(smem_pipe_write_reducer);
    warpgroup_fence_operand(acc_DK);
    warpgroup_fence_operand(acc_DV);
    return make_tuple(acc_DK, acc_DV);
  }
};

}  // namespace torch_flash::sm90
