// Head dim 128, backward. Built when 128 is in FLASH_HDIMS. The tile of 88_hopper_fmha's own
// backward example: 64 query rows a step, 128 keys a CTA.
#include "attention/attention_bwd_sm90.cuh"

namespace torch_flash {

void attention_bwd_sm90_hdim128(const AttentionBwdSm90Params& p, cudaStream_t stream) {
  using namespace cute;
  sm90::dispatch_bwd<Shape<_64, _128, _128>>(p, stream);
}

}  // namespace torch_flash
