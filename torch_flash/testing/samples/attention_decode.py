"""flash.attention_decode: inputs shared by its opcheck samples and its tests
(tests/ops/test_attention_decode.py)."""
import torch

from ...ops.rotary import rotary_cos_sin

S_MAX, BLOCK = 16, 4


def to_paged(k_cache, v_cache, block_size=BLOCK, spare=3):
    """Scatter contiguous (B, H, S_max, D) caches over shuffled pools of blocks with spare
    blocks; returns (k_pool, v_pool, block_table)."""
    B, H, S, _ = k_cache.shape
    nb = S // block_size
    phys = torch.randperm(B * nb + spare)[:B * nb]
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.randn(B * nb + spare, H, block_size, cache.shape[-1], dtype=cache.dtype)
        pool[phys] = cache.reshape(B, H, nb, block_size, -1).transpose(1, 2).reshape(B * nb, H, block_size, -1)
        pools.append(pool)
    return pools[0], pools[1], phys.view(B, nb).int()


def make(B=3, Hq=2, Hkv=2, Sq=1, Snew=1, D=16, Dv=None, dtype=torch.float32, rotary_dim=0,
         flash_layout=False, leftpad=False, S=S_MAX, **flags):
    """Inputs of one call: (args, kwargs); S slots per sequence. cache_seqlens (and with leftpad, kwargs'
    cache_leftpad) leave every query a visible key."""
    Dv = Dv or D

    def t(*shape):  # (B, H, S, D), or the .transpose(1, 2) view of (B, S, H, D)
        if flash_layout:
            return torch.randn(shape[0], shape[2], shape[1], shape[3], dtype=dtype).transpose(1, 2)
        return torch.randn(shape, dtype=dtype)

    q, kc, vc = t(B, Hq, Sq, D), t(B, Hkv, S, D), t(B, Hkv, S, Dv)
    low = max(Sq - Snew, 0)
    cache_seqlens = torch.randint(low, S - Snew + 1, (B,), dtype=torch.int32)
    cache_seqlens[0] = low
    kn, vn = (t(B, Hkv, Snew, D), t(B, Hkv, Snew, Dv)) if Snew else (None, None)
    if leftpad:  # at most the first query's position (it keeps a key); the last sequence at that bound
        most = torch.minimum(cache_seqlens, cache_seqlens + Snew - Sq)
        flags["cache_leftpad"] = (torch.rand(B) * (most + 1)).int()
        flags["cache_leftpad"][-1] = most[-1]
    if rotary_dim:
        flags["rotary_cos"], flags["rotary_sin"] = rotary_cos_sin(S + Sq, rotary_dim)
    return (q, kc, vc, cache_seqlens, kn, vn), flags


CONFIGS = {
    "decode": {},
    "gqa": dict(Hq=4, Hkv=2),
    "mqa_sq3": dict(Hq=4, Hkv=1, Sq=3, Snew=3),
    "no_append": dict(Sq=2, Snew=0),
    "window": dict(Sq=2, Snew=2, window=(3, -1)),
    "window_noncausal": dict(Sq=3, Snew=1, causal=False, window=(2, 1)),
    "noncausal": dict(Sq=2, Snew=2, causal=False),
    "softcap": dict(Hq=4, softcap=2.0, scale=0.7),
    "rotary_neox_partial": dict(Hq=4, Sq=2, Snew=2, rotary_dim=8),
    "rotary_gptj": dict(Sq=1, Snew=1, rotary_dim=16, rotary_interleaved=True),
    "dv": dict(Hq=4, D=16, Dv=8, Sq=2, Snew=2),
    "leftpad": dict(Hq=4, Hkv=2, Sq=2, Snew=2, leftpad=True),
    "leftpad_window": dict(Sq=2, Snew=1, window=(3, -1), leftpad=True),
    "leftpad_window_noncausal": dict(Sq=3, Snew=1, causal=False, window=(2, 1), leftpad=True),
    "leftpad_rotary": dict(Hq=4, Sq=2, Snew=2, rotary_dim=8, leftpad=True),
}


def op_kwargs(kwargs):
    """The op's keyword arguments from the public function's (window -> window_left/right)."""
    kwargs = dict(kwargs)
    kwargs["window_left"], kwargs["window_right"] = kwargs.pop("window", (-1, -1))
    return kwargs


def _samples():
    for name, dtype in (("decode", torch.float32), ("mqa_sq3", torch.bfloat16), ("no_append", torch.float16),
                        ("window_noncausal", torch.float32), ("softcap", torch.bfloat16),
                        ("rotary_gptj", torch.float32), ("dv", torch.float16)):
        (q, kc, vc, cs, kn, vn), kw = make(dtype=dtype, flash_layout=dtype == torch.float16, **CONFIGS[name])
        cos, sin = kw.pop("rotary_cos", None), kw.pop("rotary_sin", None)
        yield (q, kc, vc, cs, kn, vn, None, cos, sin), op_kwargs(kw)
    (q, kc, vc, cs, kn, vn), kw = make(Hq=4, Sq=2, Snew=2, rotary_dim=8)
    kp, vp, table = to_paged(kc, vc)
    yield (q, kp, vp, cs, kn, vn, table, *rotary_cos_sin(S_MAX + 2, 8)), {"window_left": 4, "num_splits": 2}
    # ALiBi slopes (B, Hq) and sinks on a paged cache
    (q, kc, vc, cs, kn, vn), kw = make(Hq=4, Hkv=2, Sq=2, Snew=1)
    kp, vp, table = to_paged(kc, vc)
    yield (q, kp, vp, cs, kn, vn, table, None, None, torch.rand(q.shape[0], 4), torch.randn(4)), {"causal": False}
    # left-padded caches (FlashAttention 2's cache_leftpad) with a window
    (q, kc, vc, cs, kn, vn), kw = make(Hq=4, Sq=2, Snew=2, leftpad=True)
    yield (q, kc, vc, cs, kn, vn, None, None, None, None, None, kw["cache_leftpad"]), {"window_left": 5}


OPCHECK_SAMPLES = {"attention_decode": _samples}
