"""The op registry is complete: every op has its schema, fake, autograd rule, backward op,
reference and opcheck samples; and every registered `flash` op is in the table."""
import importlib

import pytest
import torch
from torch._library.custom_ops import OPDEFS

import torch_flash
from torch_flash._registry import OPS, backward_ops
from torch_flash.ops import _autograd
from _utils import samples_of

def _opdef(name):
    qual = f"flash::{name}"
    assert qual in OPDEFS, f"{qual} is not registered"
    return OPDEFS[qual]


def _fake_from_meta_kernels(name):
    fake = _opdef(name)._abstract_fn
    return fake is not None and fake.__module__.startswith("torch_flash.meta_kernels")


@pytest.mark.parametrize("entry", OPS, ids=lambda e: e.name)
def test_op_is_complete(entry):
    opdef = _opdef(entry.name)
    assert hasattr(torch.ops.flash, entry.name)
    assert _fake_from_meta_kernels(entry.name), f"flash::{entry.name} has no fake in meta_kernels/{entry.stem}.py"
    if entry.backward is None:
        assert opdef._backward_fn is None and entry.name not in _autograd.REGISTERED
    else:
        assert opdef._backward_fn is not None or entry.name in _autograd.REGISTERED, \
            f"flash::{entry.name} has no autograd rule"
        assert _fake_from_meta_kernels(entry.backward), f"flash::{entry.backward} has no fake"
    ref = importlib.import_module(f"torch_flash.reference.{entry.stem}")
    assert callable(getattr(ref, entry.name, None)), \
        f"torch_flash.reference.{entry.stem} has no reference function {entry.name}"
    mutated = {a.name for a in opdef._opoverload._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write}
    assert mutated == set(entry.mutates)
    samples = getattr(samples_of(entry.stem), "OPCHECK_SAMPLES", {})
    for op in (entry.name, entry.backward):
        if op is not None:
            assert op in samples and list(samples[op]()), f"{entry.stem}: no opcheck samples for {op}"


def test_no_unlisted_ops():
    listed = {e.name for e in OPS} | {name for name, _ in backward_ops()}
    registered = {q.split("::")[1] for q in OPDEFS if q.startswith("flash::")}
    assert registered == listed


def test_public_functions():
    for e in (e for e in OPS if e.public):
        fn = getattr(torch_flash, e.name, None)
        assert callable(fn) and fn.__doc__, f"torch_flash.{e.name} missing or undocumented"


@pytest.mark.parametrize("op", sorted(_autograd.SPECS))
def test_spec_matches_the_schemas(op):
    """An op's autograd Spec (run by the Python rule and by the fast path's C++ node) names its
    arguments, its forward's returns and every argument of its backward op."""
    from torch_flash.ops import _fast

    spec = _autograd.SPECS[op]
    schema = getattr(torch.ops.flash, op).default._schema
    names = [a.name for a in schema.arguments]
    forward = getattr(torch.ops.flash, spec.forward or op).default._schema
    backward = getattr(torch.ops.flash, spec.backward).default._schema
    extra = dict(spec.forward_args)
    for a in forward.arguments:  # the op's argument, a named source, or the forward's default
        assert a.name in names or a.name in extra or a.has_default_value(), a.name
    for name, s in extra.items():
        assert s.kind in (_autograd.ARG, _autograd.REQUIRES_GRAD, _autograd.DEFAULT)
        assert s.kind == _autograd.DEFAULT or s.ref in names
    assert len(spec.outputs) == len(schema.returns) and max(spec.outputs) < len(forward.returns)
    assert len(spec.backward_args) == len(backward.arguments)
    for s in spec.save:
        assert s in names if isinstance(s, str) else s < len(forward.returns)
    for name, ret, cast in spec.grads:
        assert name in names and ret < len(backward.returns) and (cast is None or cast in names)
    for name in spec.python_if_grad:
        assert name in names
    for s in spec.backward_args:
        if s.kind in (_autograd.ARG, _autograd.NOT_ARG, _autograd.DTYPE_OF, _autograd.REQUIRES_GRAD):
            assert s.ref in names
        elif s.kind == _autograd.SAVED:
            assert s.ref < len(spec.save)
        elif s.kind in (_autograd.GRAD, _autograd.GRAD_OR_NONE):
            assert s.ref < len(spec.outputs)
        elif s.kind == _autograd.CONST:
            assert isinstance(s.ref, int)
    for s, a in zip(spec.backward_args, backward.arguments):
        assert s.kind != _autograd.DEFAULT or a.has_default_value(), a.name
    kinds = {a.name: a.type.kind() for a in schema.arguments}
    for name, value in _autograd.python_if_pairs(spec):
        assert kinds.get(name) == {bool: "BoolType", str: "StringType"}[type(value)]
    if spec.handout:  # the forward's gradients, one per backward return, and the op scaling them
        assert len(spec.handout) == len(backward.returns) and max(spec.handout) < len(forward.returns)
        scale = getattr(torch.ops.flash, spec.scale).default._schema
        assert len(scale.arguments) == 2 and scale.arguments[0].alias_info.is_write
    converted = _fast._spec_tuple(op)  # what the C++ node is given
    assert len(converted[1]) == len(forward.arguments) and len(converted[6]) == len(names)


def test_sanitizer_cases_reach_every_op():
    """scripts/sanitize_cases.py (what scripts/sanitize.sh runs under compute-sanitizer) finds a
    sample for every op and backward op and runs it (here on CPU, as a smoke run)."""
    import os
    import runpy
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "sanitize_cases.py")
    script = runpy.run_path(path, run_name="sanitize_cases")
    assert script["main"](["--device", "cpu"]) == 0
