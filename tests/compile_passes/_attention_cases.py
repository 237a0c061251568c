"""Shared pieces of the attention pattern tests (test_attention_patterns*.py): small q, k, v
and masks, the compile with the attention rewrite only, and the checks of its flash.attention
calls against eager in float64."""
import pytest
import torch

import torch_flash
from _utils import assert_rel_close
from models import causal_additive_mask

B, H, KV, S, D = 2, 4, 2, 6, 8
INF = float("-inf")


def _compile(fn, report=None, **compile_kwargs):
    """fn compiled with the attention rewrite only; the rewritten graphs run eagerly (no
    Inductor: fast on CPU, and autograd runs the flash op's own backward). report: a
    compile_passes.Report the attention sites are added to as the first call compiles (what
    explain reports of that family, without a second trace)."""
    graphs = []

    def inner(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    backend = torch_flash.backend(ops=["attention"], inner=inner, report=report)
    return torch.compile(fn, backend=backend, **compile_kwargs), graphs


def _calls(graphs) -> list[dict]:
    """The flash.attention calls of the graphs: their keyword arguments, plus `bias` (whether
    there is an attn_bias), `seed`, `alibi` (whether there are alibi_slopes), `sinks` and
    `kv_heads`."""
    calls = []
    for g in graphs:
        for n in g.graph.find_nodes(op="call_function", target=torch.ops.flash.attention.default):
            q, k, v, bias, seed, slopes, sinks = (list(n.args) + [None] * 7)[:7]
            calls.append(dict(n.kwargs, bias=bias is not None, seed=seed is not None, alibi=slopes is not None,
                              sinks=sinks is not None, kv_heads=k.meta["val"].shape[1]))
    return calls


def _window(call) -> tuple:
    return call["window_left"], call["window_right"]


def _f64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().double().requires_grad_(x.requires_grad)
    return x


def _out_and_grads(fn, args, weight=None):
    out = fn(*args)
    out = out[0] if isinstance(out, tuple) else out
    weight = torch.randn(out.shape, dtype=torch.float64, device=out.device) if weight is None else weight
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad((out * weight.to(out.dtype)).sum(), leaves)
    return out, grads, weight


def _check(fn, args, **expect):
    """One flash.attention with the expected arguments; output and input gradients equal to
    eager fn in float64."""
    ref, ref_grads, w = _out_and_grads(fn, [_f64(a) for a in args])
    compiled, graphs = _compile(fn)
    out, grads, _ = _out_and_grads(compiled, args, w)
    calls = _calls(graphs)
    assert len(calls) == 1, calls
    for key, value in expect.items():
        got = _window(calls[0]) if key == "window" else calls[0][key]
        assert got == (pytest.approx(value) if isinstance(value, float) else value), (key, got)
    assert_rel_close(out, ref, tol=1e-5)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_rel_close(g, r, tol=1e-5, what=f"grad {i}")


def _qkv(hkv=H, sq=S, sk=S, layout="bhsd"):
    shape = (lambda h, s: (B, s, h, D)) if layout == "bshd" else (lambda h, s: (B, h, s, D))
    return [torch.randn(shape(h, s), requires_grad=True) for h, s in ((H, sq), (hkv, sk), (hkv, sk))]


def _pad(b=B, s=S):
    """(B, S) keep-mask: the last keys of sequence 0 are padding (every query still sees a key)."""
    pad = torch.ones(b, s, dtype=torch.bool)
    pad[0, -2:] = False
    return pad


def _scores(q, k):
    return q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5


def _attend(s, v):
    return torch.softmax(s, dim=-1) @ v


def _ij(q, sk=None):
    """Query and key indices of q's scores as (Sq, 1) and (1, Sk) columns."""
    sq = q.shape[-2]
    return torch.arange(sq, device=q.device)[:, None], torch.arange(sk or sq, device=q.device)[None, :]


def _ones(q, *size):
    return torch.ones(*size, dtype=torch.bool, device=q.device)


def _args(*extra, **qkv_kwargs):
    return lambda: [*_qkv(**qkv_kwargs), *(e() for e in extra)]


PADDING = _pad


def _padding_only():
    """(B, S) keep-mask: sequence 0 is padding on its last 2 keys, sequence 1 everywhere."""
    pad = _pad()
    pad[1] = False
    return pad


def _left_padded():
    """(B, S) keep-mask: keys 0, 1 of sequence 0 are padding."""
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[0, :2] = False
    return pad


def _causal_left_padded():
    """(B, 1, S, S) keep-mask: causal, and keys 0, 1 of sequence 0 padding (its queries 0, 1 see nothing)."""
    keep = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S).clone()
    keep[0, ..., :2] = False
    return keep


ADDITIVE = lambda: causal_additive_mask(B, S)  # noqa: E731
SLOPES = lambda: torch.tensor([2.0 ** -(i + 1) for i in range(H)])  # noqa: E731
# Bloom's: slope per head times key position, (B*H, 1, S)
BLOOM_ALIBI = lambda: (SLOPES()[:, None] * torch.arange(S)).expand(B, H, S).reshape(B * H, 1, S)  # noqa: E731
POSITION_BIAS = lambda: (0.5 * torch.randn(1, H, S, S)).requires_grad_()  # noqa: E731
ALIBI = lambda: SLOPES()[:, None, None] * -torch.arange(S)  # noqa: E731  MPT's: (H, 1, Sk)
REL = lambda: (0.5 * torch.randn(B * H, S, S)).requires_grad_()  # noqa: E731  DeBERTa's learned, (B*H, S, S)
NONE = (-1, -1)


def _through_flash_backend(fn, args, ref_args, tol):
    """fn compiled with backend="flash" (Inductor included): one flash.attention, no fallback
    to the unmodified graph; output and input gradients against eager fn on ref_args."""
    torch_flash.counters.clear()
    ref, ref_grads, w = _out_and_grads(fn, ref_args)
    out, grads, _ = _out_and_grads(torch.compile(fn, backend="flash"), args, w)
    assert torch_flash.counters["flash.attention"] == 1
    assert_rel_close(out, ref, tol=tol)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_rel_close(g, r, tol=tol, what=f"grad {i}")


def _cuda(x, dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to("cuda", dtype).requires_grad_(x.requires_grad)
    return x.to("cuda") if isinstance(x, torch.Tensor) else x


def _through_flash_backend_cuda_bf16(fn, args):
    """_through_flash_backend on CUDA bf16 copies of args, against float64 copies of their bf16 values."""
    _through_flash_backend(fn, [_cuda(a, torch.bfloat16) for a in args],
                           [_cuda(a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point()
                                  else a, torch.float64) for a in args], tol=1e-2)
