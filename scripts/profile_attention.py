"""What limits the Triton attention kernels on the GPU, measured: the autotuned config of each
kernel, its registers / spills / shared memory, whether its PTX uses Hopper's wgmma, and (run
under ncu with --profile-from-start off) one profiled forward and backward of ours and of
SDPA-cuDNN at the standard grid's D=128, S=16k point. --sm90: the Hopper CUDA forward of
torch_flash._C and cuDNN's forward instead; --sm90-bwd: its Hopper backward and FlashAttention
4's backward (where importable; cuDNN's otherwise).
Usage: ncu --profile-from-start off [sections] python scripts/profile_attention.py [--causal]
           [--sm90 | --sm90-bwd]
"""
import sys

import torch

import torch_flash  # noqa: F401
from torch_flash.kernels.triton import attention as A
from torch_flash.kernels.triton import attention_backward as AB


def compiled_kernels(tuned):
    """The CompiledKernel objects of an autotune(jit) kernel."""
    fn = tuned.fn
    for cache in getattr(fn, "device_caches", {}).values():
        table = cache[0] if isinstance(cache, tuple) else cache
        yield from table.values()


def describe(name, tuned):
    best = tuned.best_config
    print(f"{name}: best config {best}")
    for k in compiled_kernels(tuned):
        ptx = k.asm.get("ptx", "")
        print(f"  compiled: regs {k.n_regs} spills {k.n_spills} shared {k.metadata.shared} B "
              f"warps {k.metadata.num_warps} stages {k.metadata.num_stages} "
              f"wgmma in ptx: {ptx.count('wgmma.mma_async')} mma.sync: {ptx.count('mma.sync')}")


def main_sm90(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def ours():
        return torch.ops.flash.attention_fwd_sm90(q, k, v, q.shape[-1] ** -0.5, causal)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    ours(), cudnn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    ours(), cudnn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main_sm90_bwd(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    scale = q.shape[-1] ** -0.5
    out, lse = torch.ops.flash.attention_fwd_sm90(q, k, v, scale, causal)
    do = torch.randn_like(out)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    try:
        from flash_attn.cute import flash_attn_func
        peer = flash_attn_func(*(t.transpose(1, 2) for t in leaves), causal=causal)
        peer = (peer[0] if isinstance(peer, tuple) else peer).transpose(1, 2)
    except ImportError:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            peer = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)

    def both():
        torch.ops.flash.attention_bwd_sm90(do, q, k, v, out, lse, scale, causal)
        torch.autograd.grad(peer, leaves, do, retain_graph=True)

    both()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    both()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main(causal, sm90, sm90_bwd=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, h, s, d = 2, 16, 16384, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    if sm90:
        return main_sm90(q, k, v, causal)
    if sm90_bwd:
        return main_sm90_bwd(q, k, v, causal)
    flags = dict(scale=None, causal=causal, window_left=-1, window_right=-1, softcap=0.0,
                 dropout_p=0.0, dropout_seed=None)
    out, lse = A.attention_fwd(q, k, v, None, **flags)  # autotunes
    do = torch.randn_like(out)
    AB.attention_bwd(do, None, q, k, v, None, out, lse, **flags, bias_requires_grad=False,
                     deterministic=True)
    for name, tuned in zip(("forward", "dK/dV", "dQ"), (A._KERNELS["d128"], *AB._KERNELS["d128"])):
        describe(name, tuned)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
        torch.autograd.grad(ref, leaves, do, retain_graph=True)
    torch.cuda.synchronize()

    torch.cuda.cudart().cudaProfilerStart()
    A.attention_fwd(q, k, v, None, **flags)
    AB.attention_bwd(do, None, q, k, v, None, out, lse, **flags, bias_requires_grad=False,
                     deterministic=True)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
        torch.autograd.grad(ref, leaves, do)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main("--causal" in sys.argv, "--sm90" in sys.argv, "--sm90-bwd" in sys.argv)
