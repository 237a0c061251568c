"""Fakes for flash.attention_varlen and flash.attention_varlen_backward."""
import torch

from torch_flash.ops.attention_varlen import check_args, check_backward_args, out_shapes


@torch.library.register_fake("flash::attention_varlen")
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     dropout_seed=None, alibi_slopes=None, sinks=None, *, scale=None, causal=False,
                     window_left=-1, window_right=-1, softcap=0.0, dropout_p=0.0):
    check_args("attention_varlen", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               softcap, dropout_p, dropout_seed, window_left, window_right, alibi_slopes, sinks)
    out, lse, lse_dtype = out_shapes(q, v)
    return q.new_empty(out), q.new_empty(lse, dtype=lse_dtype)


@torch.library.register_fake("flash::attention_varlen_backward")
def attention_varlen_backward(grad_out, grad_lse, q, k, v, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, out, lse, scale, causal, window_left,
                              window_right, softcap, dropout_p, dropout_seed, alibi_slopes=None, sinks=None):
    check_backward_args("attention_varlen_backward", grad_out, grad_lse, q, k, v, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, out, lse, softcap, dropout_p, dropout_seed, window_left,
                        window_right, alibi_slopes, sinks)
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks
