"""torch_flash.context_parallel_attention (ring attention) over CPU processes (torch.multiprocessing
+ gloo) on the ops' reference path: rings of 3 ranks (the world), 2 (a subgroup: global ranks
differ from group ranks) and 1, both layouts, causal and not, GQA / MQA, Dv != D, the lse as an
output; forward and dq, dk, dv against single-process torch_flash.attention over the whole
sequence in float64. Also the shard / unshard helpers and the module wrapper, and the flash
compile pass under PyTorch's own context parallelism (it leaves PyTorch's SDPA alone).

One spawn of three processes runs every case (starting them costs most of the time) and saves
what each rank got; the tests put the shards back together here and compare.
"""

import pytest
import torch
import torch.distributed as dist

from torch_flash.context_parallel import sequence_positions
from _utils import TOL, assert_rel_close, rel_err, run_gloo_ranks

# one spawn per run: under pytest-xdist (--dist loadgroup) this file's tests run in one worker
pytestmark = pytest.mark.xdist_group("context_parallel")

WORLD = 3
FP64, FP32, BF16 = torch.float64, torch.float32, torch.bfloat16
B, D, S_LOCAL = 2, 8, 6  # zigzag chunks of 3 tokens


def _cases():
    """name -> (ring size, layout, causal, dtype, Hq, Hkv, Dv, scale, return_lse). Rings of 2 are
    global ranks 0 and 1, the ring of 1 global rank 2."""
    cases = {}
    for w in (3, 2):
        cases.update({
            f"zigzag-causal-gqa-fp64-w{w}": (w, "zigzag", True, FP64, 4, 2, D, None, False),
            f"zigzag-mqa-fp32-w{w}": (w, "zigzag", False, FP32, 4, 1, D, None, False),
            f"contiguous-causal-gqa-fp32-w{w}": (w, "contiguous", True, FP32, 4, 2, D, None, False),
            f"contiguous-dv-scale-fp64-w{w}": (w, "contiguous", False, FP64, 2, 2, 6, 0.3, False),
            f"zigzag-causal-lse-fp32-w{w}": (w, "zigzag", True, FP32, 4, 2, D, None, True),
        })
    # bf16: the bar, at most 2x the error of single-process bf16 attention
    cases["zigzag-causal-gqa-bf16-w3"] = (3, "zigzag", True, BF16, 4, 2, D, None, False)
    cases["zigzag-causal-gqa-fp64-w1"] = (1, "zigzag", True, FP64, 4, 2, D, None, False)
    return cases


def _inputs(name, case):
    """The whole sequence's q, k, v and upstream gradients (out, lse), the same in every process."""
    w, _, _, dtype, hq, hkv, dv, _, _ = case
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    s = w * S_LOCAL

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=FP64).to(dtype)
    return randn(B, hq, s, D), randn(B, hkv, s, D), randn(B, hkv, s, dv), randn(B, hq, s, dv), randn(B, hq, s)


def _run_case(name, case, group):
    """This rank's (out, lse or None, dq, dk, dv) of its tokens, and the whole out unsharded."""
    from torch_flash.context_parallel import context_parallel_attention, shard_sequence, unshard_sequence

    _, layout, causal, _, _, _, _, scale, return_lse = case
    q, k, v, g_out, g_lse = (shard_sequence(t, group, layout=layout) for t in _inputs(name, case))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    res = context_parallel_attention(q, k, v, group, causal=causal, scale=scale, layout=layout,
                                     return_lse=return_lse)
    out, lse = res if return_lse else (res, None)
    loss = (out * g_out).sum() + (0 if lse is None else (lse * g_lse).sum())
    loss.backward()
    detach = None if lse is None else lse.detach()
    return (out.detach(), detach, q.grad, k.grad, v.grad), unshard_sequence(out.detach(), group, layout=layout)


def _extras(group):
    """The module wrapper against the function, and the error on an odd causal zigzag slice."""
    from torch_flash.context_parallel import context_parallel_attention
    from torch_flash.nn import ContextParallelAttention

    g = torch.Generator().manual_seed(dist.get_rank(group))
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g, dtype=FP64) for _ in range(3))
    module = ContextParallelAttention(group, causal=True)
    same = torch.equal(module(q, k, v), context_parallel_attention(q, k, v, group, causal=True))
    try:
        context_parallel_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3], group, causal=True)
        error = None
    except ValueError as e:
        error = str(e)
    return same, error


def _rank_results(rank):
    # every rank creates every group, in the same order
    groups = {3: dist.group.WORLD, 2: dist.new_group([0, 1]), 1: dist.new_group([2])}
    members = {3: (0, 1, 2), 2: (0, 1), 1: (2,)}
    results = {name: _run_case(name, case, groups[case[0]])
               for name, case in _cases().items() if rank in members[case[0]]}
    results["extras"] = _extras(groups[3])
    return results


@pytest.fixture(scope="module")
def results():
    return run_gloo_ranks(_rank_results, WORLD)


def _reference(name, case, dtype=FP64):
    """(out, lse, dq, dk, dv) of torch_flash.attention(_with_lse) over the whole sequence, in
    dtype (float64: the reference; the case's dtype: single-process attention)."""
    import torch_flash

    _, _, causal, _, _, _, _, scale, return_lse = case
    q, k, v, g_out, g_lse = (t.to(dtype) for t in _inputs(name, case))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = torch_flash.attention_with_lse(q, k, v, scale=scale, causal=causal)
    loss = (out * g_out).sum() + ((lse * g_lse).sum() if return_lse else 0)
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("name", list(_cases()))
def test_matches_single_process(results, name):
    case = _cases()[name]
    w, layout, _, dtype, _, _, _, _, return_lse = case
    ranks = {3: (0, 1, 2), 2: (0, 1), 1: (2,)}[w]
    exact = _reference(name, case)
    single_bf16 = _reference(name, case, BF16) if dtype == BF16 else None
    s = w * S_LOCAL
    for i, what in enumerate(("out", "lse", "dq", "dk", "dv")):
        if what == "lse" and not return_lse:
            continue
        locals_ = [results[r][name][0][i] for r in ranks]
        whole = torch.empty(exact[i].shape, dtype=locals_[0].dtype)
        for group_rank, local in enumerate(locals_):
            whole.index_copy_(2, sequence_positions(s, w, group_rank, layout), local)
        assert whole.dtype == (dtype if what != "lse" or dtype == FP64 else FP32)
        err = assert_rel_close(whole, exact[i], TOL[dtype], what=what)
        if dtype == BF16:
            single = rel_err(single_bf16[i], exact[i])
            assert err <= 2 * single, f"{what}: relative error {err:.3e} > 2x single-process bf16's {single:.3e}"
    for r in ranks:  # unshard_sequence gives every rank the whole output, in sequence order
        assert_rel_close(results[r][name][1], exact[0], TOL[dtype], what=f"unsharded out on rank {r}")


def _local_sdpa_handler(mesh):
    """A DTensor handler for CPU SDPA's ops, standing in for PyTorch context parallelism's
    own (CUDA kernels only: on CPU its DTensors reach aten._scaled_dot_product_flash_attention
    _for_cpu, which has no sharding rule). It attends within each rank's shard, not round a
    ring: the test is of the compile pass around the call, not of PyTorch's ring."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.utils._pytree import tree_map

    def handler(op, args, kwargs):
        local = tree_map(lambda a: a._local_tensor if isinstance(a, DTensor) else a, (args, kwargs))
        out = op(*local[0], **local[1])
        return tree_map(lambda o: DTensor.from_local(o, mesh, [Shard(2)], run_check=False)
                        if isinstance(o, torch.Tensor) else o, out)
    return handler


def _pytorch_context_parallel(rank):
    """A block with SDPA under torch.distributed.tensor.experimental.context_parallel, eager
    and compiled with the flash backend: (counters, torch_flash warnings, loss and gradients
    of each)."""
    import warnings

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import context_parallel

    import torch_flash

    mesh = init_device_mesh("cpu", (2,))
    aten = torch.ops.aten
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in (aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_flash_attention_for_cpu_backward.default):
        handlers[op] = _local_sdpa_handler(mesh)
    torch.manual_seed(0)
    proj, norm = torch.nn.Linear(8, 24), torch.nn.LayerNorm(8)
    x = torch.randn(2, 8, 8)

    def block(x):
        b, s, _ = x.shape
        q, k, v = proj(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # PyTorch's: DTensors inside
        return (norm(x + out.transpose(1, 2).reshape(b, s, 8)) * x).sum()

    # the flash backend's rewrite, then AOTAutograd without Inductor's code generation (a
    # minute of the two shared cores otherwise): what is under test is the rewrite
    flash = torch_flash.backend(inner=torch._dynamo.lookup_backend("aot_eager"))
    results = []
    torch_flash.counters.clear()
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for fn in (block, torch.compile(block, backend=flash)):
            loss = fn(x)
            grads = torch.autograd.grad(loss, [proj.weight, norm.weight])
            results.append((loss.detach(), *grads))
    ours = [str(w.message) for w in caught if "torch_flash" in str(w.message)]
    return dict(torch_flash.counters), ours, results


def test_compile_pass_leaves_pytorch_context_parallel_sdpa():
    """Under PyTorch's context_parallel, SDPA's operands are sequence-sharded DTensors and the
    call is PyTorch's: the flash backend keeps it whole (no flash.attention, which knows
    nothing of the sharding), rewrites the rest of the graph (the LayerNorm), warns of nothing,
    and computes what eager does."""
    for counters, warned, ((loss, *grads), (c_loss, *c_grads)) in run_gloo_ranks(_pytorch_context_parallel, 2):
        # x + out, then LayerNorm: flash.add_layer_norm
        assert "flash.attention" not in counters and counters.get("flash.add_layer_norm", 0) == 1, counters
        assert not warned, warned
        assert_rel_close(c_loss, loss, 1e-5, what="loss")
        for g, c in zip(grads, c_grads):
            assert_rel_close(c, g, 1e-5, what="gradient")


def test_module_and_errors(results):
    for rank in range(WORLD):
        same, error = results[rank]["extras"]
        assert same, f"rank {rank}: ContextParallelAttention differs from context_parallel_attention"
        assert error is not None and "causal zigzag needs an even S_local" in error, error


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_sequence_positions_partition(layout):
    """Every position held by exactly one rank; zigzag rank r holds chunks r and 2W - 1 - r."""
    pos = torch.cat([sequence_positions(24, 3, r, layout) for r in range(3)])
    assert torch.equal(pos.sort().values, torch.arange(24))
    if layout == "zigzag":
        assert sequence_positions(24, 3, 1, layout).tolist() == [4, 5, 6, 7, 16, 17, 18, 19]


def test_nn_module():
    """torch_flash.nn.ContextParallelAttention: the ring as a module, without parameters (a
    model's state dict is the same with it), imported on first use."""
    import torch_flash.nn
    from torch_flash import context_parallel

    module = torch_flash.nn.ContextParallelAttention(causal=True, layout="contiguous")
    assert type(module) is context_parallel.ContextParallelAttention
    assert not list(module.parameters()) and not module.state_dict()
    assert "layout='contiguous'" in repr(module)
    with pytest.raises(ValueError, match="layout must be one of"):
        torch_flash.nn.ContextParallelAttention(layout="ring")
    with pytest.raises(AttributeError):
        torch_flash.nn.NoSuchModule


def test_argument_errors():
    from torch_flash.context_parallel import context_parallel_attention
    with pytest.raises(ValueError, match="does not split into 6 equal parts"):
        sequence_positions(8, 3, 0, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        sequence_positions(8, 2, 0, "ring")
    if not dist.is_initialized():
        q = torch.randn(1, 1, 2, 4)
        with pytest.raises(ValueError, match="torch.distributed is not initialised"):
            context_parallel_attention(q, q, q)
