"""compat.flash_attn_varlen_func(block_table=...): paged keys/values for prefill, as FlashAttention
2 defines them (its tests' _generate_block_kvcache), against the packed call and float64."""
import math

import pytest
import torch

from torch_flash import compat
from _utils import TOL, assert_rel_close, force_triton_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _paged(lens, Hkv, D, page, dtype=torch.float32, device="cpu", spare=3):
    """Pools (num_blocks, page, Hkv, D) with a shuffled block_table, and the packed (total, Hkv, D)
    k/v they hold (sequence b's key s in block block_table[b, s // page])."""
    B, nblk = len(lens), max(-(-n // page) for n in lens)
    num_blocks = B * nblk + spare
    k_pool, v_pool = (torch.randn(num_blocks, page, Hkv, D, dtype=dtype, device=device) for _ in range(2))
    table = torch.randperm(num_blocks, device=device)[:B * nblk].view(B, nblk).int()
    packed = [torch.cat([pool[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lens)])
              for pool in (k_pool, v_pool)]
    return k_pool, v_pool, table, packed[0], packed[1]


def _cu(lens, device="cpu"):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _ref(q, k, v, lens_q, lens_k, causal, window, slopes=None):
    """float64 per-sequence attention, bottom-right aligned, (B, H) or (H,) ALiBi slopes."""
    out, cq, ck = [], 0, 0
    group = q.shape[1] // k.shape[1]
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        qb = q[cq:cq + sq].double().transpose(0, 1)
        kb, vb = (t[ck:ck + sk].double().transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))
        s = qb @ kb.transpose(-1, -2) / math.sqrt(q.shape[-1])
        rel = torch.arange(sk) - (torch.arange(sq)[:, None] + sk - sq)
        if slopes is not None:
            s = s - (slopes[b] if slopes.dim() == 2 else slopes).double()[:, None, None] * rel.abs()
        hidden = torch.zeros(sq, sk, dtype=torch.bool)
        if causal or window[1] >= 0:
            hidden |= rel > (0 if causal else window[1])
        if window[0] >= 0:
            hidden |= rel < -window[0]
        out.append((torch.softmax(s.masked_fill(hidden, -math.inf), -1) @ vb).transpose(0, 1))
        cq, ck = cq + sq, ck + sk
    return torch.cat(out)


CASES = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(3, 0)),
    "noncausal_window": dict(window_size=(2, 3)),
    "alibi_per_batch": dict(causal=True, alibi_slopes="per_batch"),
}


def _check(case, device, lens_q, lens_k, Hq=4, Hkv=2, D=16, page=4, dtype=torch.float32):
    """Forward against float64; forward and gradients (dq, and dk landing in the pool's used
    slots only) against the packed call on the same keys."""
    kw = dict(CASES[case])
    if kw.get("alibi_slopes") == "per_batch":
        kw["alibi_slopes"] = torch.rand(len(lens_q), Hq, device=device)
    k_pool, v_pool, table, k, v = _paged(lens_k, Hkv, D, page, dtype, device)
    k_pool.requires_grad_()
    k = k.requires_grad_()
    q = torch.randn(sum(lens_q), Hq, D, dtype=dtype, device=device, requires_grad=True)
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    out = compat.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lens_q), max(lens_k),
                                        block_table=table, **kw)
    slopes = kw["alibi_slopes"].cpu() if "alibi_slopes" in kw else None
    want = _ref(q.detach().cpu(), k.detach().cpu(), v.cpu(), lens_q, lens_k, kw.get("causal", False),
                kw.get("window_size", (-1, -1)), slopes)
    assert_rel_close(out.cpu(), want, TOL[dtype])
    packed = compat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    torch.testing.assert_close(out, packed)
    g = torch.randn_like(out)
    dq, dpool = torch.autograd.grad(out, (q, k_pool), g)
    dq_packed, dk_packed = torch.autograd.grad(packed, (q, k), g)
    torch.testing.assert_close(dq, dq_packed)
    used = torch.zeros(k_pool.shape[:2], dtype=torch.bool, device=device)
    got = []
    for b, n in enumerate(lens_k):
        slots = torch.arange(n, device=device)
        blk, off = table[b].long()[slots // page], slots % page
        used[blk, off] = True
        got.append(dpool[blk, off])
    torch.testing.assert_close(torch.cat(got), dk_packed)
    assert torch.all(dpool[~used] == 0)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_packed_and_float64(case):
    _check(case, "cpu", lens_q=[3, 1, 6], lens_k=[5, 9, 6])


def test_triton_kernels(force_backend):
    """The packed call with the extra query-less sequences, on the Triton kernels (interpreter)."""
    force_triton_kernels(force_backend)
    _check("window", DEVICE, lens_q=[2, 5], lens_k=[7, 5])


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu(case, dtype):
    """FlashAttention's page sizes (a multiple of 256), sequences of mixed lengths."""
    _check(case, "cuda", lens_q=[300, 17, 1000, 1], lens_k=[300, 900, 1000, 513], Hq=8, Hkv=2, D=128,
           page=256, dtype=dtype)


def _bad_cases():
    k_pool, v_pool, table, _, _ = _paged([5, 9], 2, 16, 4)
    q, cu_q, cu_k = torch.randn(4, 2, 16), _cu([2, 2]), _cu([5, 9])
    call = lambda k=k_pool, t=table, cu=cu_k, mk=9: compat.flash_attn_varlen_func(  # noqa: E731
        q, k, v_pool if k.dim() == 4 else k, cu_q, cu, 2, mk, block_table=t)
    return [
        (lambda: call(k=k_pool.flatten(0, 1)), "with block_table, k and v must be pools"),
        (lambda: call(t=table.float()), "block_table must be a \\(batch, max_blocks\\) int32 tensor"),
        (lambda: call(t=table[:1]), "block_table has 1 rows, cu_seqlens_k 2 sequences"),
        (lambda: call(mk=8), "cu_seqlens_k holds a sequence of 9 keys, more than max_seqlen_k \\(8\\)"),
        (lambda: call(t=table[:, :2]), "cu_seqlens_k holds a sequence of 9 keys, more than max_seqlen_k \\(9\\) or the 8 slots"),
        (lambda: call(t=table.clone().fill_(99)), "block_table entries in use must be in \\[0, 9\\)"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs(case):
    bad, match = _bad_cases()[case]
    with pytest.raises(ValueError, match=f"compat.flash_attn_varlen_func: {match}"):
        bad()
