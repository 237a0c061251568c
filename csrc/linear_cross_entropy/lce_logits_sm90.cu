// The Hopper logits GEMM of flash.linear_cross_entropy (lce_logits_sm90.h): a CUTLASS 3
// warp-specialized persistent GEMM (ping-pong: one consumer warpgroup's epilogue runs under
// the other's mainloop) whose epilogue, besides storing the rounded logits, reduces each
// class tile to one (max, sum of exponentials) pair per token through CUTLASS's row-vector
// reduction (Sm90RowReduction, non-final: the partial of every tile is written, no atomics).
// The loss kernels then skip their first sweep over the logits (kernels/triton/
// cross_entropy.py, _ce_combine_kernel's PAIRS mode). Configuration from an H100 probe
// (docs/perf/README.md, "The loss's first sweep in the GEMM's epilogue").
#include <cmath>
#include <stdexcept>
#include <string>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "linear_cross_entropy/lce_logits_sm90.h"

namespace torch_flash::lce_sm90 {

using namespace cute;

// The online log-sum-exp state of a set of logits in log2 units: max m and sum of exp2(z - m).
// A logit z (natural units) converts to (z log2(e), 1); the empty set is (-inf, 0).
struct alignas(8) MaxSum {
  float m, s;
  CUTLASS_HOST_DEVICE MaxSum() : m(-INFINITY), s(0.f) {}
  CUTLASS_HOST_DEVICE MaxSum(float m_, float s_) : m(m_), s(s_) {}
  template <class T>
  CUTLASS_HOST_DEVICE explicit MaxSum(T const& z) : m(static_cast<float>(z) * 1.4426950408889634f), s(1.f) {}
};

CUTLASS_DEVICE float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One exponential per merge: the smaller max's sum is scaled to the larger.
CUTLASS_DEVICE MaxSum merge(MaxSum a, MaxSum b) {
  if (b.m == -INFINITY) return a;
  if (a.m == -INFINITY) return b;
  const float e = ex2(-fabsf(a.m - b.m));
  return a.m >= b.m ? MaxSum(a.m, fmaf(b.s, e, a.s)) : MaxSum(b.m, fmaf(a.s, e, b.s));
}

// The reduction functor of every stage (registers, shuffles, shared memory), on one state or
// an array of them.
template <class T>
struct Merge {
  CUTLASS_DEVICE T operator()(T const& a, T const& b) const {
    T r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kElements; ++i) r[i] = merge(a[i], b[i]);
    return r;
  }
};
template <>
struct Merge<MaxSum> {
  CUTLASS_DEVICE MaxSum operator()(MaxSum const& a, MaxSum const& b) const { return merge(a, b); }
};

constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
using CtaTile = Shape<Int<kLceLogitsTileM>, Int<kLceLogitsTileN>, _64>;
using Cluster = Shape<_1, _1, _1>;

template <class Element>
struct Gemm {
  // the accumulator rounded to the logits' dtype, then reduced: the statistics are those of
  // the stored logits, which the gradient pass reads
  using Rounded = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, Element, float, kRound>,
      cutlass::epilogue::fusion::Sm90AccFetch>;
  using Stats = cutlass::epilogue::fusion::Sm90RowReduction<Merge, Merge, Merge, 0, CtaTile, MaxSum, MaxSum, kRound,
                                                            Stride<_0, _1, _0>, 2, true, false, true>;
  using Fusion = cutlass::epilogue::fusion::Sm90EVT<Stats, Rounded>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, CtaTile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::RowMajor, 8, cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::ColumnMajor, 8, float, CtaTile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

void check(cutlass::Status status, const char* step) {
  if (status != cutlass::Status::kSuccess) {
    throw std::runtime_error(std::string("flash.linear_cross_entropy_logits_sm90: CUTLASS ") + step +
                             " failed: " + cutlassGetStatusString(status));
  }
}

template <class Element>
void run(const LceLogitsSm90Params& p, cudaStream_t stream) {
  using Device = typename Gemm<Element>::Device;
  using Kernel = typename Device::GemmKernel;
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  typename Kernel::StrideA stride_w = make_stride(p.weight_stride, _1{}, int64_t(p.m) * p.weight_stride);
  typename Kernel::StrideB stride_h = make_stride(p.hidden_stride, _1{}, int64_t(p.n) * p.hidden_stride);
  typename Kernel::StrideD stride_z = make_stride(p.logits_stride, _1{}, int64_t(p.m) * p.logits_stride);
  typename Device::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {p.m, p.n, p.k, 1},
      {static_cast<const Element*>(p.weight), stride_w, static_cast<const Element*>(p.hidden), stride_h},
      {{}, nullptr, stride_z, static_cast<Element*>(p.logits), stride_z}};
  args.epilogue.thread = {{{}, {}}, {p.pairs, MaxSum(), {}}};
  args.hw_info.device_id = p.device;
  args.hw_info.sm_count = p.sm_count;
  // along the tokens: a class tile's weight rows are read once for all of a chunk's tokens
  // (along the classes, 340 TFLOP/s against 670 at 1024 tokens)
  args.scheduler.raster_order = Raster::AlongN;
  args.scheduler.max_swizzle_size = 1;
  Device gemm;
  check(gemm.can_implement(args), "can_implement");
  const size_t bytes = Device::get_workspace_size(args);
  void* workspace = bytes ? p.alloc(p.alloc_ctx, bytes) : nullptr;
  check(gemm.initialize(args, workspace, stream), "initialize");
  check(gemm.run(stream), "run");
}

}  // namespace torch_flash::lce_sm90

namespace torch_flash {

void lce_logits_sm90(const LceLogitsSm90Params& p, cudaStream_t stream) {
  if (p.bf16) {
    lce_sm90::run<cutlass::bfloat16_t>(p, stream);
  } else {
    lce_sm90::run<cutlass::half_t>(p, stream);
  }
}

}  // namespace torch_flash
