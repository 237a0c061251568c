// Head dim 128. Built when 128 is in FLASH_HDIMS. Chosen by scripts/sweep_attention_sm90.py on
// an H100 (2026-11-21, bf16, 32k tokens): without a mask, 128 query rows x 128 keys on the
// persistent ping-pong schedule (S=4k: 1.05x SDPA-cuDNN, 16k: 1.04x); causal, one CTA per tile
// (S=16k: 1.08x; persistent 0.94x, its static tile order leaves SMs idle at the end).
#include "attention/attention_fwd_sm90.cuh"

namespace torch_flash {

void attention_fwd_sm90_hdim128(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  using namespace cute;
  using namespace sm90;
  using Tile = Shape<_128, _128, _128>;
  dispatch<Config<Tile, Pingpong>, Config<Tile, Pingpong>, Config<Tile, Cooperative>>(p, stream);
}

}  // namespace torch_flash
