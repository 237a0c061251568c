// Head dim 64. Built when 64 is in FLASH_HDIMS. Chosen by scripts/sweep_attention_sm90.py on an
// H100 (2026-11-21, bf16, 32k tokens; x SDPA-cuDNN in the same run): without a mask, 128 query
// rows on two consumer warpgroups below 2k keys (S=1k: 0.92x, three warpgroups 0.87x), 192 rows
// on three from 2k keys (S=2k: 1.01x vs 0.97x, 4k: 1.07x vs 0.99x, 16k: 1.09x vs 1.06x);
// causal, persistent CTAs taking query tiles in pairs (sm90::Paired), of 128 rows below 2k keys
// and of 192 rows on three warpgroups from 2k (two sweeps, S=1k / 4k / 16k: pairs of 128 rows
// 0.94x / 0.96x-1.00x / 1.00x-1.04x, of 192 rows 0.75x / 0.95x-0.99x / 1.08x-1.11x, one CTA per
// 128-row tile 0.78x / 0.93x-0.97x / 1.04x-1.07x).
#include "attention/attention_fwd_sm90.cuh"

namespace torch_flash {

void attention_fwd_sm90_hdim64(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  using namespace cute;
  using namespace sm90;
  using Tile = Shape<_128, _128, _64>;
  using LongTile = Shape<_192, _128, _64>;
  using ThreeWarpGroups = Option<Tag::kNumMmaWarpGroups, _3>;
  dispatch<Config<Tile, Pingpong>, Config<LongTile, Pingpong, ThreeWarpGroups>, Config<Tile, Paired>,
           Config<LongTile, Paired, ThreeWarpGroups>>(p, stream);
}

}  // namespace torch_flash
