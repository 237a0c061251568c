"""Launch variants of the cross-entropy kernel (torch_flash/kernels/triton/cross_entropy.py, Knobs):
a persistent grid (each program loops over rows that many apart) and pipeline stages leave every
element's arithmetic as it is, so loss, lse and gradient equal the default launch's bitwise; and
the configurations scripts/sweep_cross_entropy.py times build and run.

On CPU the kernels run under TRITON_INTERPRET=1 (which ignores warps and stages) on tiny shapes.
"""
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from torch_flash import _dispatch  # noqa: E402
from torch_flash.kernels.triton import cross_entropy as K  # noqa: E402
from torch_flash.reference import cross_entropy as ce_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 64
OPTIONS = {
    "plain": ce_ref.LossOptions(),
    "all": ce_ref.LossOptions(ignore_index=7, label_smoothing=0.2, z_loss=1e-3, softcap=8.0),
}
# programs: fewer than the rows and not dividing them, one, more than the rows; stages on top
KNOBS = [K.Knobs(programs=3), K.Knobs(programs=1), K.Knobs(programs=64), K.Knobs(num_stages=3, programs=4)]


def _kw(opts, reduction):
    return dict(opts._asdict(), reduction=reduction)


def _inputs(rows, n_cols, opts, dtype=torch.bfloat16):
    """Logits and targets with about a third of the rows ignore_index (never the first)."""
    x = (torch.randn(rows, n_cols, device=DEV) * 3).to(dtype)
    t = torch.randint(0, n_cols, (rows,), device=DEV)
    ignored = torch.rand(rows, device=DEV) < 0.3
    ignored[0] = False
    return x, t.masked_fill(ignored, opts.ignore_index)


def _equal(got, expect, what):
    for i, (a, b) in enumerate(zip(got, expect)):
        assert torch.equal(a, b), f"{what}: output {i} differs from the default launch's"


@pytest.mark.parametrize("rows,n_cols,opts,reduction", [(10, 200, "all", "mean"), (7, 130, "plain", "sum"),
                                                        (5, 64, "all", "none")])
def test_persistent_grid_is_the_default_bitwise(rows, n_cols, opts, reduction):
    """ce_fwd (gradient into a new buffer and over the logits), ce_bwd (into a new tensor and in
    place) and CeFwd with each of KNOBS: bitwise the default launch's loss, lse, gradient and
    target summary."""
    opts = OPTIONS[opts]
    kw = _kw(opts, reduction)
    x, t = _inputs(rows, n_cols, opts)
    g = torch.randn(t.shape if reduction == "none" else (), device=DEV)

    def outputs(knobs):
        loss, lse, grad = K.ce_fwd(x, t, grad_logits_out=torch.full_like(x, float("nan")), block=BLOCK,
                                   knobs=knobs, **kw)
        y = x.clone()
        in_place = K.ce_fwd(y, t, grad_logits_out=y, block=BLOCK, knobs=knobs, **kw)
        dx = K.ce_bwd(g, x, t, lse, out=torch.full_like(x, float("nan")), block=BLOCK, knobs=knobs, **kw)
        z = x.clone()
        K.ce_bwd(g, z, t, lse, out=z, block=BLOCK, knobs=knobs, **kw)
        return [loss, lse, grad, *in_place[:2], y, dx, z, *K.CeFwd(x, t, **kw, block=BLOCK, knobs=knobs)(x, t)]

    expect = outputs(K.Knobs())
    assert not expect[2].isnan().any() and (expect[2][t == opts.ignore_index] == 0).all()
    for knobs in KNOBS:
        _equal(outputs(knobs), expect, str(knobs))


def test_l2_programs(monkeypatch):
    """Rows in flight fill the fraction of L2 asked for, at least one a SM, at most the rows; off
    the GPU one a SM."""
    cpu = torch.device("cpu")
    sms = _dispatch.sm_count(cpu)
    assert K.l2_programs(1000, 4096, cpu, 1.0) == sms and K.l2_programs(3, 4096, cpu, 1.0) == 3

    class Props:
        L2_cache_size = 50 * 2**20
        multi_processor_count = 132
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    h200, row = torch.device("cuda"), 128256 * 2
    assert K.l2_programs(8192, row, h200, 1.0) == 50 * 2**20 // row == 204
    assert K.l2_programs(8192, row, h200, 0.5) == 132  # 102 would leave SMs idle
    assert K.l2_programs(100, row, h200, 1.0) == 100


def _sweep():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("sweep_cross_entropy",
                                                  os.path.join(root, "scripts", "sweep_cross_entropy.py"))
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep


def test_sweep_grid_builds_and_runs():
    """The sweep's configurations: distinct names, today's launch first in each group, Knobs for
    any shape; each one's call (and the op's default and fastest pair) runs on a tiny problem and
    matches the default (V = 200 fits every block, so the arithmetic is the same)."""
    sweep = _sweep()
    groups = sweep.grid()
    assert set(groups) == {"fwd", "bwd", "fused"}
    opts = ce_ref.LossOptions()
    x, t = _inputs(9, 200, opts)  # more rows than the interpreter's persistent grids of 8
    t[t == opts.ignore_index] = 3  # the sweep's targets are all valid
    for group, cfgs in groups.items():
        names = [c.name for c in cfgs]
        assert names[0] == "default" and len(set(names)) == len(names), group
        for c in cfgs:
            knobs = c.knobs(9, 400, torch.device(DEV))
            assert (knobs.programs is None) == (c.per_sm is None and c.l2_fraction is None)
        diffs = sweep.check(group, cfgs, x, t)
        assert all(d == 0 for d in diffs.values()), diffs
    pair = (groups["fwd"][-1], groups["bwd"][-1])
    assert sweep.check("op", [(groups["fwd"][0], groups["bwd"][0]), pair], x, t)[sweep.name(pair)] == 0


def test_sweep_runs_a_shape(monkeypatch):
    """The sweep's run over one shape with two configurations a group (the interpreter's smoke
    timings): a row with a time for each, the op's default and fastest pairs and a stand-in for
    quack (torch's loss, without its inplace_backward), JSON-ready."""
    import json
    import sys
    import types

    import torch.nn.functional as F

    sweep = _sweep()
    full = sweep.grid()
    monkeypatch.setattr(sweep, "grid", lambda: {g: [cs[0], cs[-1]] for g, cs in full.items()})
    monkeypatch.setitem(sys.modules, "quack", types.SimpleNamespace(cross_entropy=lambda x, t: F.cross_entropy(x, t)))
    rows = []
    sweep.run_shape(9, 200, 1, rows, torch.device(DEV))
    json.dumps(rows)
    timed = [(r["group"], r["config"]) for r in rows if r["group"] != "copy" and r["ms"] is not None]
    assert len(timed) == len(rows) - 1 and rows[0]["group"] == "copy"
    for g, cs in full.items():
        assert (g, "default") in timed and (g, cs[-1].name) in timed
    assert ("op", "default + default") in timed and ("op", "quack") in timed
    assert all(r["max_rel_diff_vs_default"] == 0 for r in rows if r.get("timing") == "graph")


@pytest.mark.cuda
@pytest.mark.parametrize("n_cols", [32000, 128256])
def test_cuda_knobs_are_the_default_bitwise(n_cols):
    """At real vocabulary sizes with the launch rule's block and warps: a persistent grid (by
    l2_programs and per SM) and pipeline stages give the default's loss, lse and gradient bitwise."""
    opts, dev = OPTIONS["all"], torch.device(DEV)
    x, t = _inputs(3 * _dispatch.sm_count(dev) + 5, n_cols, opts)
    kw = _kw(opts, "mean")

    def outputs(knobs):
        y = x.clone()
        loss, lse, _ = K.ce_fwd(y, t, grad_logits_out=y, knobs=knobs, **kw)
        dx = K.ce_bwd(torch.ones((), device=DEV), x, t, lse, knobs=knobs, **kw)
        return [loss, lse, y, dx, *K.CeFwd(x, t, **kw, knobs=knobs)(x, t)]

    expect = outputs(K.Knobs())
    for knobs in (K.Knobs(programs=K.l2_programs(x.shape[0], n_cols * 2, dev, 0.5)),
                  K.Knobs(programs=2 * _dispatch.sm_count(dev)), K.Knobs(num_stages=3),
                  K.Knobs(num_stages=2, programs=7)):
        _equal(outputs(knobs), expect, str(knobs))
