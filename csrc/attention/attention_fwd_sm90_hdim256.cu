// Head dim 256: tiles of 128 query rows x 64 keys (the register and shared-memory budget of
// two consumer warpgroups), cooperative schedule. Built when 256 is in FLASH_HDIMS.
#include "attention/attention_fwd_sm90.cuh"

namespace torch_flash {

void attention_fwd_sm90_hdim256(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  using namespace cute;
  sm90::dispatch<Shape<_128, _64, _256>, sm90::Cooperative>(p, stream);
}

}  // namespace torch_flash
