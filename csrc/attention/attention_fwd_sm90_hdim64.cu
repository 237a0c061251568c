// Head dim 64. Built when 64 is in FLASH_HDIMS. Chosen by scripts/sweep_attention_sm90.py on an
// H100 (2026-11-21, bf16, 32k tokens; x SDPA-cuDNN in the same run): without a mask, 128 query
// rows on two consumer warpgroups below 2k keys (S=1k: 0.92x, three warpgroups 0.87x), 192 rows
// on three from 2k keys (S=2k: 1.01x vs 0.97x, 4k: 1.07x vs 0.99x, 16k: 1.09x vs 1.06x);
// causal, one CTA per 128-row tile (persistent and longest-first orders measured slower).
#include "attention/attention_fwd_sm90.cuh"

namespace torch_flash {

void attention_fwd_sm90_hdim64(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  using namespace cute;
  using namespace sm90;
  using Tile = Shape<_128, _128, _64>;
  using LongTile = Shape<_192, _128, _64>;
  dispatch<Config<Tile, Pingpong>, Config<LongTile, Pingpong, Option<Tag::kNumMmaWarpGroups, _3>>,
           Config<Tile, Cooperative>>(p, stream);
}

}  // namespace torch_flash
