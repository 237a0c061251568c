"""Host time of one eager call, ours against the alternatives, at shapes whose kernels take a
few microseconds (so the host, not the GPU, sets the pace): `python scripts/host_overhead.py OUT`.

Each case runs CALLS calls back to back without synchronising, in interleaved rounds, and
reports the median wall time per call (us): the cost a small model pays per op in eager mode.
Alternatives where importable: PyTorch's own op, Liger-Kernel, quack and FlashAttention 4
(`../shared/tools/gpu-peers.sh` brings the last two onto the GPU machine). Also:
- layers: one call of RMSNorm and of attention peeled layer by layer (the compiled kernel's C
  launcher, our launch(), the Triton launcher function, the op's body, the dispatcher, the
  public function), which says where the time goes;
- bound: two points where the host bounds a real workload: decoding one sequence over a 128k
  cache against SDPA (cuDNN), and RMSNorm at (65536, 1024) eager against its CUDA-graph replay;
- cProfile listings of ours (host_overhead_profile.txt).
Writes host_overhead.json; `python scripts/host_overhead.py --plot RESULTS.json OUT.png` plots one.
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

import torch_flash
from torch_flash.bench._common import env_info, optional_peer, out_dir
from torch_flash.kernels.triton import launch as launch_mod
from torch_flash.ops import _autograd
from torch_flash.ops import cross_entropy as ce_ops

CALLS, ROUNDS = 300, 7
dev, bf16 = "cuda", torch.bfloat16


def _grad(f, *leaves):
    """f's forward with a graph, then the gradients of its outputs into those of leaves it used."""
    def run():
        out = f()
        outs = out if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True)
    return run


def _no_grad(f):
    def run():
        with torch.no_grad():
            return f()
    return run


def _leaf(*shape, dtype=bf16):
    return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=True)


def cases() -> dict[str, dict]:
    n, v = 1024, 4096
    x, r, w, b = _leaf(16, n), _leaf(16, n), _leaf(n), _leaf(n)
    logits = _leaf(16, v)
    logits_peer = logits.detach().clone().requires_grad_()  # Liger writes the gradient into its input
    tgt = torch.randint(0, v, (16,), device=dev)
    q, k, vv = _leaf(1, 8, 128, 64), _leaf(1, 8, 128, 64), _leaf(1, 8, 128, 64)
    q_fa, k_fa, v_fa = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, vv))
    cos, sin = torch_flash.rotary_cos_sin(128, 64, device=dev)
    hf_cos, hf_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    h, lm = _leaf(16, 256), _leaf(1024, 256)
    lm_t = torch.randint(0, 1024, (16,), device=dev)
    qp, kp, vp = _leaf(128, 8, 64), _leaf(128, 8, 64), _leaf(128, 8, 64)  # two packed sequences of 64
    cu = torch.tensor([0, 64, 128], device=dev, dtype=torch.int32)
    qd = torch.randn(1, 8, 1, 64, device=dev, dtype=bf16)
    kc, vc = (torch.randn(1, 2, 256, 64, device=dev, dtype=bf16) for _ in range(2))
    seqlens = torch.full((1,), 200, device=dev, dtype=torch.int32)

    liger = {name: optional_peer(f"liger_kernel.ops.{mod}", name) for mod, name in (
        ("rms_norm", "LigerRMSNormFunction"), ("layer_norm", "LigerLayerNormFunction"),
        ("cross_entropy", "LigerCrossEntropyFunction"), ("rope", "LigerRopeFunction"),
        ("fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction"))}
    quack_rms = optional_peer("quack", "rmsnorm")
    quack_ce = optional_peer("quack", "cross_entropy")
    quack_ln = optional_peer("quack.rmsnorm", "layernorm_fwd")
    quack_rot = optional_peer("quack.rotary", "apply_rotary_emb")
    quack_lce = optional_peer("quack.linear_cross_entropy", "linear_cross_entropy_func")
    fa4 = optional_peer("flash_attn.cute", "flash_attn_func")
    fa4_varlen = optional_peer("flash_attn.cute", "flash_attn_varlen_func")
    fa4_kv = optional_peer("flash_attn.cute", "flash_attn_with_kvcache")
    k_rot = k[:, :2]

    def half_rot(t):
        a, c = t.chunk(2, -1)
        return torch.cat((-c, a), -1)

    lg = liger["LigerRMSNormFunction"]
    fwd = {
        "rms_norm": ((x, w), {
            "torch (F.rms_norm)": lambda: F.rms_norm(x, (n,), w, 1e-6),
            "ours": lambda: torch_flash.rms_norm(x, w, 1e-6),
            "liger": lg and (lambda: lg.apply(x, w, 1e-6)),
            "quack": quack_rms and (lambda: quack_rms(x, w, eps=1e-6)),
        }),
        "add_rms_norm": ((x, r, w), {
            "torch (add + F.rms_norm)": lambda: F.rms_norm(x + r, (n,), w, 1e-6),
            "ours": lambda: torch_flash.add_rms_norm(x, r, w, 1e-6),
            "quack": quack_rms and (lambda: quack_rms(x, w, residual=r, eps=1e-6, prenorm=True)),
        }),
        "layer_norm": ((x, w, b), {
            "torch (F.layer_norm)": lambda: F.layer_norm(x, (n,), w, b, 1e-6),
            "ours": lambda: torch_flash.layer_norm(x, w, b, 1e-6),
            "liger": liger["LigerLayerNormFunction"] and (
                lambda: liger["LigerLayerNormFunction"].apply(x, w, b, 1e-6)),
        }),
        "add_layer_norm": ((x, r, w, b), {
            "torch (add + F.layer_norm)": lambda: F.layer_norm(x + r, (n,), w, b, 1e-6),
            "ours": lambda: torch_flash.add_layer_norm(x, r, w, b, 1e-6),
        }),
        "cross_entropy": ((logits, logits_peer), {
            "torch (F.cross_entropy)": lambda: F.cross_entropy(logits, tgt),
            "ours": lambda: torch_flash.cross_entropy(logits, tgt),
            "liger": liger["LigerCrossEntropyFunction"] and (
                lambda: liger["LigerCrossEntropyFunction"].apply(logits_peer, tgt, None)[0]),
            "quack": quack_ce and (lambda: quack_ce(logits_peer, tgt)),
        }),
        "rotary_qk": ((q, k_rot), {
            "torch (HF apply_rotary_pos_emb)": lambda: (q * hf_cos + half_rot(q) * hf_sin,
                                                         k_rot * hf_cos + half_rot(k_rot) * hf_sin),
            "ours": lambda: torch_flash.rotary_qk(q, k_rot, cos, sin),
            "liger": liger["LigerRopeFunction"] and (
                lambda: liger["LigerRopeFunction"].apply(q, k_rot, hf_cos, hf_sin)),
            "quack (q and k)": quack_rot and (lambda: (quack_rot(q_fa, cos, sin), quack_rot(k_fa, cos, sin))),
        }),
        "attention": ((q, k, vv, q_fa, k_fa, v_fa), {
            "torch (SDPA)": lambda: F.scaled_dot_product_attention(q, k, vv, is_causal=True),
            "ours": lambda: torch_flash.attention(q, k, vv, causal=True),
            "flash-attn-4": fa4 and (lambda: fa4(q_fa, k_fa, v_fa, causal=True)[0]),
        }),
        "attention_varlen": ((qp, kp, vp), {
            "torch (SDPA per sequence)": lambda: torch.cat([F.scaled_dot_product_attention(
                *(t[a:b].transpose(0, 1) for t in (qp, kp, vp)), is_causal=True).transpose(0, 1)
                for a, b in ((0, 64), (64, 128))]),
            "ours": lambda: torch_flash.attention_varlen(qp, kp, vp, cu, cu, 64, 64, causal=True),
            "flash-attn-4": fa4_varlen and (lambda: fa4_varlen(qp, kp, vp, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                              max_seqlen_q=64, max_seqlen_k=64, causal=True)[0]),
        }),
        "linear_cross_entropy": ((h, lm), {
            "torch (F.linear + F.cross_entropy)": lambda: F.cross_entropy(F.linear(h, lm).float(), lm_t),
            "ours": lambda: torch_flash.linear_cross_entropy(h, lm, lm_t),
            "liger": liger["LigerFusedLinearCrossEntropyFunction"] and (
                lambda: liger["LigerFusedLinearCrossEntropyFunction"].apply(h, lm, lm_t)[0]),
            "quack": quack_lce and (lambda: quack_lce(h, lm, None, lm_t)),
        }),
    }
    out = {}
    for op, (leaves, impls) in fwd.items():
        impls = {name: f for name, f in impls.items() if f}
        out[f"{op} fwd"] = {name: _no_grad(f) for name, f in impls.items()}
        out[f"{op} fwd+bwd"] = {name: _grad(f, *leaves) for name, f in impls.items()}
    if quack_ln:  # forward only (no autograd there), fp32 weight and bias only
        w32, b32 = w.detach().float(), b.detach().float()
        out["layer_norm fwd"]["quack"] = _no_grad(lambda: quack_ln(x, w32, b32, 1e-6))
    out["attention_decode fwd"] = {
        "torch (SDPA)": _no_grad(lambda: F.scaled_dot_product_attention(
            qd, kc[:, :, :200], vc[:, :, :200], enable_gqa=True)),
        "ours": _no_grad(lambda: torch_flash.attention_decode(qd, kc, vc, seqlens)),
    }
    if fa4_kv:
        qd_fa, kc_fa, vc_fa = (t.transpose(1, 2).contiguous() for t in (qd, kc, vc))
        out["attention_decode fwd"]["flash-attn-4"] = _no_grad(
            lambda: fa4_kv(qd_fa, kc_fa, vc_fa, cache_seqlens=seqlens))
    return out


def per_call_us(fn, calls: int = CALLS, wait: bool = False) -> float:
    """Wall time per call of `calls` back-to-back calls: the host's alone, or with wait=True
    until the GPU has finished them too (what a user sees where the GPU work is the longer)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if wait:
        torch.cuda.synchronize()
    end = time.perf_counter()
    torch.cuda.synchronize()
    return (end - start) / calls * 1e6


def interleaved(impls: dict, calls: int = CALLS, rounds: int = ROUNDS, wait: bool = False) -> dict[str, float]:
    """Median per-call time of each implementation over interleaved rounds (order rotated); an
    implementation that fails its warm-up calls is left out, with a line saying why."""
    for name, fn in list(impls.items()):
        try:
            for _ in range(3):
                fn()  # compile, autotune, warm caches
        except Exception as e:
            print(f"{name}: left out ({type(e).__name__}: {str(e)[:120]})", flush=True)
            del impls[name]
    samples = {k: [] for k in impls}
    names = list(impls)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in (order if r % 2 == 0 else order[::-1]):
            samples[name].append(per_call_us(impls[name], calls, wait))
    return {k: statistics.median(s) for k, s in samples.items()}


def _recorded_launches(module, fn) -> list[tuple]:
    """The (kernel, grid, args, kwargs) of every launch one call of fn makes through module's
    launch_as."""
    seen, real = [], module.launch_as

    def recording(launcher, kernel, grid, args, kwargs):
        seen.append((kernel, grid, args, kwargs))
        return real(launcher, kernel, grid, args, kwargs)
    module.launch_as = recording
    try:
        with torch.no_grad():
            fn()
    finally:
        module.launch_as = real
    return seen


def layers() -> dict[str, dict[str, float]]:
    """One forward call of RMSNorm (16, 1024) and of causal attention (1, 8, 128, 64), bf16,
    peeled layer by layer (outermost last); each layer's time includes the ones above it."""
    from torch_flash.kernels.triton import attention as attn_k, norm as norm_k

    x, w = torch.randn(16, 1024, device=dev, dtype=bf16), torch.randn(1024, device=dev, dtype=bf16)
    q, k, v = (torch.randn(1, 8, 128, 64, device=dev, dtype=bf16) for _ in range(3))
    points = {
        "rms_norm": (norm_k, lambda: norm_k.norm_fwd(x, w, None, None, eps=1e-6, is_rms=True, weight_offset=0.0,
                                                     cast_before_weight=True, residual_in_fp32=False),
                     lambda: _autograd._BODIES["rms_norm"](x, w, 1e-6),
                     lambda: torch.ops.flash.rms_norm.default(x, w, 1e-6),
                     lambda: torch_flash.rms_norm(x, w, 1e-6)),
        "attention": (attn_k, lambda: attn_k.attention_fwd(q, k, v, None, scale=None, causal=True, window_left=-1,
                                                           window_right=-1, softcap=0.0, dropout_p=0.0,
                                                           dropout_seed=None),
                      lambda: _autograd._BODIES["attention"](q, k, v, causal=True),
                      lambda: torch.ops.flash.attention.default(q, k, v, causal=True),
                      lambda: torch_flash.attention(q, k, v, causal=True)),
    }
    result = {}
    for name, (module, kernel_fn, body, op, public) in points.items():
        with torch.no_grad():
            for _ in range(3):
                public()
        (kernel, grid, args, kwargs), = _recorded_launches(module, _autograd.launching_directly(kernel_fn))
        launcher = launch_mod._LAUNCHERS[launch_mod._key(kernel, torch.cuda.current_device(), args, kwargs)]
        params = launcher.order((*args, *kwargs.values(), *launcher.tail))
        g = grid(dict(zip(launcher.names, params))) if callable(grid) else grid
        g = (*g, 1, 1)[:3]
        stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
        jit = kernel.fn if hasattr(kernel, "best_config") else kernel
        config = kernel.best_config.all_kwargs() if hasattr(kernel, "best_config") else {}
        eager = _autograd.launching_directly  # as the op's body runs them: wrap_triton's hook off
        impls = {
            "1 C launcher of the compiled kernel": lambda: launcher.run(
                *g, stream, launcher.function, launcher.metadata, None, None, None, *params),
            "2 our launch() (key, lookup, argument order)": eager(
                lambda: launch_mod.launch(kernel, grid, *args, **kwargs)),
            "2' Triton's JIT launcher instead (kernel.fn[grid])": lambda: jit[grid](*args, **kwargs, **config),
            "3 the launcher function (outputs, arguments)": eager(kernel_fn),
            "4 the op's body (checks, backend choice)": body,
            "5 torch.ops.flash (dispatcher, Autograd kernel)": op,
            "6 the public function": public,
        }
        result[name] = interleaved({k: _no_grad(f) for k, f in impls.items()}, calls=1000, rounds=5)
        for layer, us in result[name].items():
            print(f"layers {name:10s} {layer:52s} {us:7.1f} us", flush=True)
    return result


class _Identity(torch.autograd.Function):
    """The least a Python autograd rule can cost: what the engine pays to call one."""
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _RmsNormBackwardOnly(torch.autograd.Function):
    """x unchanged, with flash.rms_norm's backward op as its backward: that op's cost inside the
    engine, without the forward's autograd rule."""
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return _autograd.call("rms_norm_backward", g, x, w, 1e-6, 0.0, True)


class _NoTargetCheck(ce_ops.TargetCheck):
    """The loss ops' target check, turned off (what a compiled graph's call does)."""
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "enabled": False})


def _single_threaded(fn):
    """fn with the autograd engine running CUDA backward on the calling thread."""
    def run():
        with torch.autograd.set_multithreading_enabled(False):
            return fn()
    return run


def parts() -> dict[str, dict[str, float]]:
    """Where a forward + backward and a loss forward spend their host time: each piece of the
    call on its own (same shapes as cases()), beside the whole."""
    from torch_flash.kernels.triton import cross_entropy as ce_k

    x, w = _leaf(16, 1024), _leaf(1024)
    g = torch.randn(16, 1024, device=dev, dtype=bf16)
    q, k, v = _leaf(1, 8, 128, 64), _leaf(1, 8, 128, 64), _leaf(1, 8, 128, 64)
    logits = torch.randn(16, 4096, device=dev, dtype=bf16)
    tgt = torch.randint(0, 4096, (16,), device=dev)
    torch_flash.rms_norm(x, w, 1e-6)  # compiles the kernels outside the timing
    out, lse = torch_flash.attention_with_lse(q, k, v, causal=True)
    go = torch.randn_like(out)
    pinned = torch.empty(3, dtype=torch.int64, pin_memory=True)
    plan = ce_k.CeFwd(logits, tgt, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0, reduction="mean")
    summary = _autograd.launching_directly(ce_k.target_summary)(tgt, -100)
    event = torch.cuda.Event()
    event.record()

    def without_target_check():
        real, ce_ops.TargetCheck = ce_ops.TargetCheck, _NoTargetCheck
        try:
            torch_flash.cross_entropy(logits, tgt)
        finally:
            ce_ops.TargetCheck = real

    def event_record():
        torch.cuda.Event().record()

    groups = {
        "rms_norm fwd+bwd": {
            "whole": _grad(lambda: torch_flash.rms_norm(x, w, 1e-6), x, w),
            "forward recording the graph": lambda: torch_flash.rms_norm(x, w, 1e-6),
            "torch.autograd.grad of y * 1 (the engine alone)": _grad(lambda: x * 1.0, x),
            "the backward op, no engine": _no_grad(lambda: _autograd.call(
                "rms_norm_backward", g, x, w, 1e-6, 0.0, True)),
            "torch (F.rms_norm) fwd+bwd": _grad(lambda: F.rms_norm(x, (1024,), w, 1e-6), x, w),
            "grad through a Python autograd.Function (identity)": _grad(lambda: _Identity.apply(x), x),
            "the same, autograd multithreading off": _single_threaded(_grad(lambda: _Identity.apply(x), x)),
            "an identity autograd.Function whose backward runs the backward op": _grad(
                lambda: _RmsNormBackwardOnly.apply(x, w), x, w),
            "whole, autograd multithreading off": _single_threaded(
                _grad(lambda: torch_flash.rms_norm(x, w, 1e-6), x, w)),
        },
        "attention fwd+bwd": {
            "whole": _grad(lambda: torch_flash.attention(q, k, v, causal=True), q, k, v),
            "forward recording the graph": lambda: torch_flash.attention(q, k, v, causal=True),
            "the backward op, no engine": _no_grad(lambda: _autograd.call(
                "attention_backward", go, None, q, k, v, None, out, lse, 0.125, True, -1, -1, 0.0, 0.0,
                None, False, None)),
            "torch (SDPA) fwd+bwd": _grad(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v),
        },
        "cross_entropy fwd": {
            "whole": _no_grad(lambda: torch_flash.cross_entropy(logits, tgt)),
            "without the target check": _no_grad(without_target_check),
            "the kernels (CeFwd plan: two launches)": _autograd.launching_directly(lambda: plan(logits, tgt)),
            "target_summary kernel": _autograd.launching_directly(lambda: ce_k.target_summary(tgt, -100)),
            "pinned copy of the verdict": lambda: pinned.copy_(summary, non_blocking=True),
            "new pinned buffer": lambda: torch.empty(3, dtype=torch.int64, pin_memory=True),
            "torch.cuda.Event().record()": event_record,
            "event.query()": event.query,
            "torch (F.cross_entropy)": _no_grad(lambda: F.cross_entropy(logits, tgt)),
        },
    }
    result = {}
    for name, impls in groups.items():
        result[name] = interleaved(impls, calls=1000, rounds=5)
        for part, us in result[name].items():
            print(f"parts {name:18s} {part:52s} {us:7.1f} us", flush=True)
    return result


def bound() -> dict[str, float]:
    """Where the host bounds real work: decode of one sequence over a 128k cache (32 query, 8 kv
    heads, D 128) against SDPA's cuDNN backend (the q heads of a kv head folded into its query
    length, as torch_flash.bench decode does), per eager call; RMSNorm at (65536, 1024) eager
    against its CUDA-graph replay, in TB/s (x read, y written)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    s = 128 * 1024
    q = torch.randn(1, 32, 1, 128, device=dev, dtype=bf16)
    kc, vc = (torch.randn(1, 8, s, 128, device=dev, dtype=bf16) for _ in range(2))
    seqlens = torch.full((1,), s, device=dev, dtype=torch.int32)
    q_folded = q.reshape(1, 8, 4, 128)  # a kv head's 4 q heads as its queries: GQA without repeated k/v

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q_folded, kc, vc)
    times = interleaved({"ours": _no_grad(lambda: torch_flash.attention_decode(q, kc, vc, seqlens)),
                         "sdpa_cudnn": _no_grad(sdpa)}, calls=200, rounds=5, wait=True)
    out["decode_128k_ours_us"], out["decode_128k_sdpa_cudnn_us"] = times["ours"], times["sdpa_cudnn"]
    out["decode_128k_ours_over_sdpa_cudnn"] = times["sdpa_cudnn"] / times["ours"]

    x = torch.randn(65536, 1024, device=dev, dtype=bf16)
    w = torch.randn(1024, device=dev, dtype=bf16)
    moved = 2 * x.numel() * x.element_size()
    fn = _no_grad(lambda: torch_flash.rms_norm(x, w, 1e-6))
    eager = interleaved({"eager": fn}, calls=200, rounds=5, wait=True)["eager"] * 1e-6
    graph = triton.testing.do_bench_cudagraph(fn, rep=200) * 1e-3
    out["rms_norm_65536x1024_eager_tbs"] = moved / eager / 1e12
    out["rms_norm_65536x1024_graph_tbs"] = moved / graph / 1e12
    out["rms_norm_65536x1024_eager_over_graph"] = graph / eager
    for key, value in out.items():
        print(f"bound {key:40s} {value:8.3f}", flush=True)
    return out


def plot(data: dict, path: str) -> None:
    """Host time per call of every case and implementation (log scale), ours highlighted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in data["rows"]))
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(data["rows"]) + 1))
    y, ticks, labels = 0, [], []
    for case in cases:
        for r in (r for r in data["rows"] if r["case"] == case):
            ax.barh(y, r["us"], color="tab:red" if r["impl"] == "ours" else "tab:gray")
            ax.text(r["us"] * 1.03, y, f"{r['us']:.0f}", va="center", fontsize=7)
            ticks.append(y)
            labels.append(f"{case}: {r['impl']}")
            y += 1
        y += 0.6
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("host time per eager call (us, log scale)")
    ax.set_title(f"Host cost of an eager call, {data['env']['device']}, {data['env']['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(out_dir: str) -> None:
    all_cases = cases()
    rows = []
    for case, impls in all_cases.items():
        for name, us in interleaved(impls).items():
            rows.append({"case": case, "impl": name, "us": us})
            print(f"{case:28s} {name:36s} {us:8.1f} us", flush=True)
    layer_times = layers()
    part_times = parts()
    bounds = bound()

    text = io.StringIO()
    for case in ("rms_norm fwd", "rms_norm fwd+bwd", "cross_entropy fwd", "attention fwd+bwd"):
        fn = all_cases[case]["ours"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(CALLS):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        text.write(f"==== {case}, ours, {CALLS} calls\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    with open(f"{out_dir}/host_overhead_profile.txt", "w") as f:
        f.write(text.getvalue())
    with open(f"{out_dir}/host_overhead.json", "w") as f:
        json.dump({"suite": "host_overhead", "env": env_info(), "calls": CALLS, "rounds": ROUNDS, "layers": layer_times,
                   "parts": part_times, "bound": bounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plot"]:  # --plot RESULTS.json OUT.png, from a committed run
        with open(sys.argv[2]) as f:
            plot(json.load(f), sys.argv[3])
    else:
        main(out_dir(__doc__))
