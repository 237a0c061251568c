// Head dim 64: tiles of 128 query rows x 128 keys. Built when 64 is in FLASH_HDIMS.
#include "attention/attention_fwd_sm90.cuh"

namespace torch_flash {

void attention_fwd_sm90_hdim64(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  using namespace cute;
  sm90::dispatch<Shape<_128, _128, _64>, sm90::Pingpong>(p, stream);
}

}  // namespace torch_flash
