// Head dim 256: tiles of 128 query rows x 64 keys (the register and shared-memory budget of
// two consumer warpgroups), one CTA per tile (the persistent schedules' separate epilogue
// buffers do not fit in shared memory). Built when 256 is in FLASH_HDIMS.
#include "attention/attention_fwd_sm90.cuh"

namespace torch_flash {

void attention_fwd_sm90_hdim256(const AttentionFwdSm90Params& p, cudaStream_t stream) {
  using namespace cute;
  using namespace sm90;
  using Tile = Shape<_128, _64, _256>;
  using C = Config<Tile, Cooperative>;
  dispatch<C, C, C, C>(p, stream);
}

}  // namespace torch_flash
