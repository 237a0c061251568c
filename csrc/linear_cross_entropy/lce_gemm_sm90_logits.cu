// lce_gemm_sm90_logits: a chunk's logits, hidden (C, H) @ weight (V, H)^T.
// scripts/sweep_lce_gemm_sm90.py on the H100 (docs/perf/sweep_lce_gemm_sm90_h100.json),
// 1024 x 4096 x 128256 bf16: 682 TFLOP/s, 1.07x cuBLAS, with 256 x 128 tiles in 1 x 2 clusters
// taken along M (the chunk's 4-8 row tiles of one weight tile run together: the weight is
// read from memory once), swizzled by 8.
#include "linear_cross_entropy/lce_gemm_sm90.cuh"

namespace torch_flash {

void lce_gemm_sm90_logits(const LceGemmSm90Params& p, cudaStream_t stream) {
  using namespace lce_sm90;
  run<Kind::Logits, Config<Shape<_256, _128, _64>, Shape<_1, _2, _1>, Cooperative, cutlass::gemm::PersistentScheduler,
                           /*raster=*/1, /*swizzle=*/8>>(p, stream);
}

}  // namespace torch_flash
