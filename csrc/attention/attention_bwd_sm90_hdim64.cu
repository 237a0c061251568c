// Head dim 64, backward. Built when 64 is in FLASH_HDIMS. 128 query rows a step, 128 keys a CTA,
// dQ split over the warpgroups by rows: FlashAttention 3's sm90 tile at this head dim (the
// example's 64-row steps ran 0.68x-0.79x FlashAttention 4, H200 2026-11-29). 195 KiB of shared
// memory, no register spills (nvcc 13.0).
#include "attention/attention_bwd_sm90.cuh"

namespace torch_flash {

void attention_bwd_sm90_hdim64(const AttentionBwdSm90Params& p, cudaStream_t stream) {
  using namespace cute;
  sm90::dispatch_bwd<Shape<_128, _128, _64>>(p, stream);
}

}  // namespace torch_flash
