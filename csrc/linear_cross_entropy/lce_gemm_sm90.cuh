// The Hopper GEMMs behind lce_gemm_sm90.h: CUTLASS 3 warp-specialized persistent kernels (TMA
// loads, wgmma, TMA epilogue) from its collective builders, in a tile configuration (Config)
// per GEMM. scripts/sweep_lce_gemm_sm90.py compiles each of the three GEMMs in every
// configuration it lists and times them against cuBLAS at the chunk shapes of an lm-head; the
// extension instantiates the winners that beat cuBLAS (the logits GEMM, lce_gemm_sm90_logits.cu).
#pragma once

#include <stdexcept>
#include <string>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "linear_cross_entropy/lce_gemm_sm90.h"

namespace torch_flash::lce_sm90 {

using namespace cute;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;
using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;

// Two consumer warpgroups share each tile (its M split between them) ...
struct Cooperative {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
// ... or each takes whole tiles in turn, one's epilogue under the other's mainloop.
struct Pingpong {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};

// Tile (M, N, K) per CTA, cluster (M, N, 1), schedule, tile scheduler (PersistentScheduler or
// StreamKScheduler), and the tile order used where the caller leaves it to the entry.
template <class Tile_, class Cluster_, class Schedule_, class Scheduler_ = cutlass::gemm::PersistentScheduler,
          int kRaster = 3, int kSwizzle = 1>
struct Config {
  using Tile = Tile_;
  using Cluster = Cluster_;
  using Schedule = Schedule_;
  using Scheduler = Scheduler_;
  static constexpr int raster = kRaster;
  static constexpr int swizzle = kSwizzle;
};

// A (M, K) and B (K, N) in CUTLASS's layout tags: RowMajor A and ColumnMajor B are K-major.
template <class Element, class LayoutA, class LayoutB, class Cfg>
struct Gemm {
  static constexpr int kAlign = 16 / sizeof(Element);
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, RowMajor, kAlign, Element, RowMajor,
      kAlign, typename Cfg::Schedule::Epilogue>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element, LayoutB, kAlign, float,
      typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::Schedule::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      typename Cfg::Scheduler>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

inline void check(cutlass::Status status, const char* name, const char* step) {
  if (status != cutlass::Status::kSuccess) {
    throw std::runtime_error(std::string(name) + ": CUTLASS " + step + " failed: " + cutlassGetStatusString(status));
  }
}

template <class Element, class LayoutA, class LayoutB, class Cfg>
void run_as(const LceGemmSm90Params& p, cudaStream_t stream, const char* name) {
  using Device = typename Gemm<Element, LayoutA, LayoutB, Cfg>::Device;
  using Kernel = typename Device::GemmKernel;
  // B's stride is over (N, K): CUTLASS 3 takes every operand as (rows of the output, K)
  const auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(p.m, p.k, 1));
  const auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(p.n, p.k, 1));
  const auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(p.m, p.n, 1));
  auto* d = static_cast<Element*>(p.d);
  typename Device::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {p.m, p.n, p.k, 1},
                                  {static_cast<const Element*>(p.a), stride_a, static_cast<const Element*>(p.b), stride_b},
                                  {{1.0f, p.accumulate ? 1.0f : 0.0f}, d, stride_d, d, stride_d}};
  args.hw_info.device_id = p.device;
  args.hw_info.sm_count = p.sm_count;
  constexpr Raster kOrders[] = {Raster::AlongM, Raster::AlongN, Raster::Heuristic};
  args.scheduler.raster_order = kOrders[(p.raster ? p.raster : Cfg::raster) - 1];
  args.scheduler.max_swizzle_size = p.swizzle ? p.swizzle : Cfg::swizzle;
  Device gemm;
  check(gemm.can_implement(args), name, "can_implement");
  const size_t bytes = Device::get_workspace_size(args);
  void* workspace = bytes ? p.alloc(p.alloc_ctx, bytes) : nullptr;
  check(gemm.initialize(args, workspace, stream), name, "initialize");
  check(gemm.run(stream), name, "run");
}

// The three GEMMs of lce_gemm_sm90.h by their operands' layouts: logits reads the weight (V, H)
// as a K-major B, grad_weight reads dlogits (C, V) as an M-major A (its transpose).
enum class Kind { Logits, GradHidden, GradWeight };
template <Kind> struct Layouts;
template <> struct Layouts<Kind::Logits> {
  using A = RowMajor;
  using B = ColumnMajor;
  static constexpr const char* name = "lce_gemm_sm90_logits";
};
template <> struct Layouts<Kind::GradHidden> {
  using A = RowMajor;
  using B = RowMajor;
  static constexpr const char* name = "lce_gemm_sm90_grad_hidden";
};
template <> struct Layouts<Kind::GradWeight> {
  using A = ColumnMajor;
  using B = RowMajor;
  static constexpr const char* name = "lce_gemm_sm90_grad_weight";
};

// One GEMM of lce_gemm_sm90.h in configuration Cfg, in either dtype.
template <Kind kKind, class Cfg>
void run(const LceGemmSm90Params& p, cudaStream_t stream) {
  using L = Layouts<kKind>;
  if (p.raster < 0 || p.raster > 3 || p.swizzle < 0) {
    throw std::runtime_error(std::string(L::name) + ": raster must be 0-3 and swizzle >= 0");
  }
  if (p.bf16) {
    run_as<cutlass::bfloat16_t, typename L::A, typename L::B, Cfg>(p, stream, L::name);
  } else {
    run_as<cutlass::half_t, typename L::A, typename L::B, Cfg>(p, stream, L::name);
  }
}

}  // namespace torch_flash::lce_sm90
