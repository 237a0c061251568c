"""Fake for flash.attention_decode (inference only: no backward op)."""
import torch

from torch_flash.ops.attention_decode import check_args


@torch.library.register_fake("flash::attention_decode")
def attention_decode(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, block_table=None,
                     rotary_cos=None, rotary_sin=None, alibi_slopes=None, sinks=None, cache_leftpad=None, *,
                     scale=None, causal=True, window_left=-1, window_right=-1, softcap=0.0,
                     rotary_interleaved=False, num_splits=0):
    check_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, rotary_cos, rotary_sin,
               alibi_slopes, sinks, softcap, window_left, window_right, num_splits, cache_leftpad)
    B, Hq, Sq, _ = q.shape
    return q.new_empty(B, Hq, Sq, v_cache.shape[-1]), q.new_empty(B, Hq, Sq, dtype=torch.float32)
