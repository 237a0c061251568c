"""Fakes for flash.attention, flash.attention_with_lse, flash.attention_backward and the
Hopper kernels flash.attention_fwd_sm90 and flash.attention_bwd_sm90."""
import torch

from torch_flash.ops.attention import (check_alibi, check_args, check_backward_args, check_sinks,
                                       check_sm90_args, check_sm90_bwd_args, out_shapes)
from torch_flash.reference.attention import layout_strides


def _in_layout(like, shape):
    """An output of `shape` laid out like `like` (out like q, each gradient like its input)."""
    return like.new_empty_strided(shape, layout_strides(like, shape))


def _forward(op, q, k, v, attn_bias, softcap, dropout_p, dropout_seed, window_left, window_right, alibi_slopes,
             sinks):
    check_args(op, q, k, v, attn_bias, softcap, dropout_p, dropout_seed, window_left, window_right, alibi_slopes,
               sinks)
    out, lse, lse_dtype = out_shapes(q, v)
    return _in_layout(q, out), q.new_empty(lse, dtype=lse_dtype)


@torch.library.register_fake("flash::attention")
def attention(q, k, v, attn_bias=None, dropout_seed=None, alibi_slopes=None, sinks=None, *, scale=None,
              causal=False, window_left=-1, window_right=-1, softcap=0.0, dropout_p=0.0):
    return _forward("attention", q, k, v, attn_bias, softcap, dropout_p, dropout_seed,
                    window_left, window_right, alibi_slopes, sinks)[0]


@torch.library.register_fake("flash::attention_with_lse")
def attention_with_lse(q, k, v, attn_bias=None, dropout_seed=None, alibi_slopes=None, sinks=None, *,
                       scale=None, causal=False, window_left=-1, window_right=-1, softcap=0.0, dropout_p=0.0):
    return _forward("attention_with_lse", q, k, v, attn_bias, softcap, dropout_p, dropout_seed,
                    window_left, window_right, alibi_slopes, sinks)


@torch.library.register_fake("flash::attention_backward")
def attention_backward(grad_out, grad_lse, q, k, v, attn_bias, out, lse, scale, causal,
                       window_left, window_right, softcap, dropout_p, dropout_seed,
                       bias_requires_grad, alibi_slopes=None, sinks=None):
    check_backward_args("attention_backward", grad_out, grad_lse, q, k, v, attn_bias, out, lse, softcap,
                        dropout_p, dropout_seed, window_left, window_right, alibi_slopes, sinks)
    dbias = attn_bias.new_empty(attn_bias.shape) if bias_requires_grad else q.new_empty(0)
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return _in_layout(q, q.shape), _in_layout(k, k.shape), _in_layout(v, v.shape), dbias, dsinks


@torch.library.register_fake("flash::attention_fwd_sm90")
def attention_fwd_sm90(q, k, v, scale, causal, sinks=None, alibi_slopes=None):
    check_sm90_args("attention_fwd_sm90", q, k, v, causal)
    check_sinks("attention_fwd_sm90", sinks, q)
    check_alibi("attention_fwd_sm90", alibi_slopes, q, q.shape[0])
    out, lse, lse_dtype = out_shapes(q, v)
    return _in_layout(q, out), q.new_empty(lse, dtype=lse_dtype)


@torch.library.register_fake("flash::attention_bwd_sm90")
def attention_bwd_sm90(grad_out, q, k, v, out, lse, scale, causal, alibi_slopes=None):
    check_sm90_bwd_args("attention_bwd_sm90", grad_out, q, k, v, out, lse, causal)
    check_alibi("attention_bwd_sm90", alibi_slopes, q, q.shape[0])
    return _in_layout(q, q.shape), _in_layout(k, k.shape), _in_layout(k, v.shape)
