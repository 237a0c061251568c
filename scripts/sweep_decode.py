"""Sweep the decode kernel's tile configs and split counts on the GPU: the fraction of a
device copy of the caches that each (config, num_splits) reaches at the benchmark's points,
so that auto_num_splits and the autotune key of torch_flash/kernels/triton/attention_decode.py can be
chosen from measurements. Usage: python scripts/sweep_decode.py OUT.json
"""
import json

import torch
from torch._library.triton import set_wrap_triton_enabled

from torch_flash.bench._common import copy_bandwidth, env_info, median_ms, out_dir
from torch_flash.kernels.triton import attention_decode as K

POINTS = [(1, 131072), (2, 65536), (8, 32768), (32, 32768)]
SPLITS = (0, 8, 16, 33, 66, 132, 256)


def main(path):
    rows = []
    tuned = K._DECODE["narrow"]
    configs = list(tuned.configs)
    flags = dict(scale=None, causal=True, window_left=-1, window_right=-1, softcap=0.0,
                 rotary_interleaved=False)
    for b, s in POINTS:
        q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, 8, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cs = torch.full((b,), s, dtype=torch.int32, device="cuda")
        nbytes = 2 * kc.numel() * 2
        ceiling = copy_bandwidth(nbytes)
        for cfg in configs:
            tuned.configs = [cfg]
            tuned.cache.clear()
            for splits in SPLITS:
                ms = median_ms(lambda: K.decode_fwd(q, kc, vc, cs, None, None, None, None, None,
                                                    num_splits=splits, **flags))
                rows.append(dict(shape=[b, s], config=str(cfg), splits=splits, ms=ms,
                                 frac=nbytes / (ms * 1e-3) / ceiling))
                print(rows[-1], flush=True)
        del kc, vc
        torch.cuda.empty_cache()
    tuned.configs = configs
    with open(path, "w") as f:
        json.dump({"env": env_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    with set_wrap_triton_enabled(False):  # launchers called outside their op
        main(out_dir(__doc__))
