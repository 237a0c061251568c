// Head dim 128. Built when 128 is in FLASH_HDIMS. Chosen by scripts/sweep_attention_sm90.py on
// an H100 (2026-11-21, bf16, 32k tokens): without a mask, 128 query rows x 128 keys on the
// persistent ping-pong schedule (S=4k: 1.05x SDPA-cuDNN, 16k: 1.04x); causal, persistent CTAs
// taking query tiles in pairs (sm90::Paired; two sweeps, S=1k / 4k / 16k: 1.01x / 0.96x-1.00x /
// 1.10x-1.13x; one CTA per tile 0.90x / 0.92x-0.98x / 1.04x-1.10x, persistent CTAs taking single
// tiles 0.89x / 0.93x at 4k / 16k). Without a mask the persistent launch's short last round
// runs as key splits (TailSplit in attention_fwd_sm90.cuh): +2-4% at S=4k/16k.
#include "attention/attention_fwd_sm90.cuh"

namespace torch_flash {

void attention_fwd_sm90_hdim128(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  using namespace cute;
  using namespace sm90;
  using Tile = Shape<_128, _128, _128>;
  using Full = Config<Tile, Pingpong>;
  using Causal = Config<Tile, Paired>;
  dispatch<Full, Full, Causal, Causal>(p, stream);
}

}  // namespace torch_flash
