"""The user-facing entry points of the compile pass: the `flash` Dynamo backend,
enable()/disable() for plain torch.compile, rewrite() for exported programs and
pre-dispatch graphs, and explain()."""
from __future__ import annotations

import copy
import functools
import operator
import sys
import time
import warnings
from collections import Counter
from typing import Callable, Iterable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from . import rewrite_graph
from .graph import lifted_values
from .patterns import FAMILIES
from .report import Report

# Matches per op over every graph compiled in this process (`flash.<op>` -> count).
COUNTERS: Counter = Counter()


def _predispatch(gm: fx.GraphModule) -> fx.GraphModule:
    """Re-trace a Dynamo graph to pre-dispatch ATen IR under Dynamo's own fake values, so
    symbolic sizes stay the ones Dynamo guards on. The mode comes from the values: the
    TracingContext a backend runs in holds a different FakeTensorMode (same ShapeEnv)."""
    from torch._subclasses.fake_tensor import FakeTensor

    fake_args = [n.meta["example_value"] for n in gm.graph.find_nodes(op="placeholder")]
    mode = next(a.fake_mode for a in fake_args if isinstance(a, FakeTensor))
    # running through an Interpreter under preserve_node_meta carries each node's stack
    # trace onto the ATen nodes it becomes (explain() reports source lines from it)
    with mode, torch.fx.traceback.preserve_node_meta():
        pgm = make_fx(lambda *args: _Retracer(gm).run(*args), pre_dispatch=True)(*fake_args)
    # the patterns read requires_grad off Dynamo's values (make_fx's own drop it): a table
    # that needs a gradient must not be folded into an op that gives it none
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), pgm.graph.find_nodes(op="placeholder")):
        new.meta.setdefault("example_value", old.meta["example_value"])
    return pgm


# Higher-order ops of a Dynamo graph that _predispatch keeps whole instead of tracing into.
# autograd_function_apply is a custom torch.autograd.Function (its forward and backward as
# subgraphs): traced into, only its forward is left, under the _set_grad_enabled(False)
# Dynamo wraps it in, so AOTAutograd differentiates nothing through it (and never runs the
# user's backward): every parameter below the Function got no gradient (HF Bloom's GeLU).
_OPAQUE_HOPS = (torch.ops.higher_order.autograd_function_apply,)


class _Retracer(fx.Interpreter):
    """Runs a Dynamo graph under make_fx, recording each node in ATen ops, except the
    higher-order ops of _OPAQUE_HOPS: each is recorded as one node, with the same subgraphs,
    which AOTAutograd later traces as Dynamo's own graphs have it (forward and the user's
    backward); and the checkpointed and nested regions, as _record_checkpoint and
    _inline_region say."""

    def run_node(self, n: fx.Node):
        if (n.op == "call_function" and n.target in _OPAQUE_HOPS) or (n.op in _CALLS and _on_dtensors(n)):
            record = functools.partial(_record_whole, n)
        elif n.op == "call_function" and n.target is _CHECKPOINT:
            record = _record_checkpoint
        elif n.op == "call_function" and n.target is _NESTED_REGION:
            record = _inline_region
        else:
            return super().run_node(n)
        with self._set_current_node(n):
            return record(*self.fetch_args_kwargs_from_env(n))


_CALLS = ("call_function", "call_method")


def _on_dtensors(n: fx.Node) -> bool:
    """Whether call n makes or takes a DTensor (torch.distributed.tensor): PyTorch's context
    parallelism turns SDPA's operands into sequence-sharded DTensors (DTensor.from_local in
    its F.scaled_dot_product_attention wrapper or module hooks) and runs its own ring on them;
    tensor parallelism shards them by heads. Such calls stay whole in the retrace, as Dynamo
    recorded them: no pattern reads into them (an SDPA there is PyTorch's, never rewritten
    into a flash op that knows nothing of the sharding), and the rest of the graph is
    rewritten as usual."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    values = [n.meta.get("example_value")] + [a.meta.get("example_value") for a in n.all_input_nodes]
    return any(isinstance(v, DTensor) for v in tree_leaves(values))


def _record_whole(n: fx.Node, args: tuple, kwargs: dict):
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, track_tensor_tree
    from torch.utils._pytree import tree_map

    def call():
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        return n.target(*args, **kwargs)

    mode = get_proxy_mode()
    if mode is None:
        return call()
    # the values, on the fake inputs, with nothing recorded: no proxy mode and no pre-dispatch
    # function mode (it would record the subgraph's _set_grad_enabled calls)
    with disable_proxy_modes_tracing(), torch._C.DisableTorchFunction():
        out = call()
    tracer = mode.tracer
    for arg_node, arg in zip(n.args, args):
        if isinstance(arg, torch.nn.Module):  # a subgraph: an attribute of the traced module
            name = arg_node.target if isinstance(arg_node, fx.Node) and arg_node.op == "get_attr" else "subgraph"
            base, i = name, 0
            while getattr(tracer.root, name, arg) is not arg:
                name, i = f"{base}_{i}", i + 1
            tracer.root.register_module(name, arg)
    proxy_args, proxy_kwargs = tree_map(tracer.unwrap_proxy, (args, kwargs))
    proxy = tracer.create_proxy(n.op, n.target, proxy_args, proxy_kwargs)
    return track_tensor_tree(out, proxy, constant=None, tracer=tracer)


# torch.utils.checkpoint under Dynamo: one node running its region's subgraph (graph.WRAPS)
_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
# torch.compiler.nested_compile_region: a subgraph compiled once for its calls; retraced whole,
# Inductor failed on the pre-dispatch subgraph ("both a fallback and a decomp", torch 2.13)
_NESTED_REGION = torch.ops.higher_order.invoke_subgraph


def _inline_region(args: tuple, kwargs: dict):
    """A nested compile region (subgraph, identifier, *operands) recorded inline, where the
    patterns see its ops (its one-compile saving is lost; its results are the same)."""
    return _Retracer(args[0]).run(*args[2:])


def _record_checkpoint(args: tuple, kwargs: dict):
    """A checkpointed region recorded as one node whose subgraph is retraced to pre-dispatch
    ATen (rewrite_graph then rewrites inside it, and AOTAutograd recomputes its flash ops in
    the backward as it did the model's). torch's own pre-dispatch rule for the op fails on a
    region without a context_fn (KeyError '_checkpoint_context_fn', torch 2.13)."""
    from torch._higher_order_ops.utils import reenter_make_fx
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, track_tensor_tree
    from torch.utils._pytree import tree_map

    body, operands = args[0], args[1:]
    mode = get_proxy_mode()
    if mode is None:
        return _CHECKPOINT(*args, **kwargs)
    with disable_proxy_modes_tracing(), torch._C.DisableTorchFunction():
        out = fx.Interpreter(body).run(*operands)  # the values, on the fake inputs
    body_aten = reenter_make_fx(_Retracer(body).run)(*operands)
    if "_checkpoint_context_fn" in body.meta:  # selective checkpointing's policy
        body_aten.meta["_checkpoint_context_fn"] = body.meta["_checkpoint_context_fn"]
    tracer = mode.tracer
    name = tracer.get_fresh_qualname("wrap_body")
    tracer.root.register_module(name, body_aten)
    proxy_args, proxy_kwargs = tree_map(tracer.unwrap_proxy, (operands, kwargs))
    proxy = tracer.create_proxy("call_function", _CHECKPOINT, (tracer.unwrap_proxy(body_aten), *proxy_args),
                                proxy_kwargs)
    return track_tensor_tree(out, proxy, constant=None, tracer=tracer)


# A graph whose rewrite takes longer says so on stderr (sites found, time).
PROGRESS_AFTER_S = 2.0


def _rewrite_dynamo_graph(gm: fx.GraphModule, families,
                          into: Report | None = None) -> tuple[fx.GraphModule, Report]:
    start = time.perf_counter()
    pgm = _predispatch(gm)
    report = rewrite_graph(pgm, families)
    elapsed = time.perf_counter() - start
    if elapsed >= PROGRESS_AFTER_S:
        done = sum(s.rewritten for s in report.sites)
        print(f"torch_flash: {done} of {len(report.sites)} sites rewritten in a graph of "
              f"{len(gm.graph.nodes)} nodes ({elapsed:.1f} s); Inductor compiles next", file=sys.stderr, flush=True)
    COUNTERS.update(report.counters())
    if into is not None:
        into.extend(report)
    return pgm, report


def backend(ops: Iterable[str] | None = None, inner: Callable | None = None,
            report: Report | None = None) -> Callable:
    """A Dynamo backend that rewrites into flash ops, then compiles with `inner`
    (Inductor's compile_fx by default). ops: families to use (default all: see FAMILIES).
    report: collects the sites of every graph it compiles (what explain() shows).

        torch.compile(model, backend=torch_flash.backend(ops=["attention"]))
    """
    families = list(FAMILIES) if ops is None else list(ops)
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"torch_flash.backend: unknown op families {sorted(unknown)}; known: {sorted(FAMILIES)}")

    def compile_flash(gm: fx.GraphModule, example_inputs):
        compiler = inner or _compile_fx_predispatch
        try:
            pgm, _ = _rewrite_dynamo_graph(gm, families, report)
            return compiler(pgm, example_inputs)
        except torch._dynamo.exc.RestartAnalysis:
            raise  # Dynamo retraces (e.g. with float inputs specialised): not a failure
        except Exception as e:  # never fail a user's compile because of the rewrite
            warnings.warn(f"torch_flash: the rewritten graph failed to compile ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); using the unmodified graph")
            return compiler(gm, example_inputs)

    return compile_flash


def _compile_fx_predispatch(gm: fx.GraphModule, example_inputs):
    """Inductor on a pre-dispatch ATen graph, without Inductor's pre-grad passes. Its default
    ones expect Torch IR (measured: on ATen graphs they dropped the gradients flowing through
    flash.attention); those of is_predispatch split and merge cat / split / linear patterns
    none of these graphs has, with shape propagation after each: 4.6 s of a 2-layer HF LLaMA's
    41 s in compile_fx on CPU, for nothing. A pre-grad custom pass does not run either."""
    import torch._inductor.config as config
    from torch._inductor.compile_fx import compile_fx

    # config_patches, not config.patch alone: they also hold when the backward is compiled
    patches = {"use_pre_grad_passes": False,
               "post_grad_custom_post_pass": _post_grad_pass(config.post_grad_custom_post_pass)}
    return compile_fx(gm, example_inputs, config_patches=patches)


def _post_grad_pass(current):
    """current (Inductor's post-grad custom pass) with the flash backend's after it."""
    from .post_grad import FlashPostGradPass

    return current if isinstance(current, FlashPostGradPass) else FlashPostGradPass(current)


class _PreGradPass:
    """Inductor pre-grad custom pass: the same rewrite for plain torch.compile(model)."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, graph: fx.Graph) -> None:
        if self.previous is not None:
            self.previous(graph)
        gm = graph.owning_module
        try:
            pgm, _ = _rewrite_dynamo_graph(gm, None)
        except Exception as e:
            warnings.warn(f"torch_flash: rewrite skipped ({type(e).__name__}: {e})")
            return
        # later stages read Dynamo's per-input bookkeeping off the placeholders
        for old, new in zip(gm.graph.find_nodes(op="placeholder"), pgm.graph.find_nodes(op="placeholder")):
            if hasattr(old, "_dynamo_source"):
                new._dynamo_source = old._dynamo_source
            new.meta = {**old.meta, **new.meta}
        # what the new graph reads off its module (a kept subgraph, a constant) must be on gm
        for node in pgm.graph.find_nodes(op="get_attr"):
            if not _has_attr(gm, node.target):
                fx.graph_module._copy_attr(pgm, gm, node.target)
        gm.graph = pgm.graph
        gm.recompile()


def _has_attr(module: torch.nn.Module, target: str) -> bool:
    try:
        operator.attrgetter(target)(module)
    except AttributeError:
        return False
    return True


def enable() -> None:
    """Make a plain `torch.compile(model)` (Inductor) rewrite into flash ops too, and run the
    flash backend's post-grad pass."""
    import torch._inductor.config as config

    if not isinstance(config.pre_grad_custom_pass, _PreGradPass):
        config.pre_grad_custom_pass = _PreGradPass(config.pre_grad_custom_pass)
    config.post_grad_custom_post_pass = _post_grad_pass(config.post_grad_custom_post_pass)


def disable() -> None:
    """Undo enable()."""
    import torch._inductor.config as config
    from .post_grad import FlashPostGradPass

    if isinstance(config.pre_grad_custom_pass, _PreGradPass):
        config.pre_grad_custom_pass = config.pre_grad_custom_pass.previous
    if isinstance(config.post_grad_custom_post_pass, FlashPostGradPass):
        config.post_grad_custom_post_pass = config.post_grad_custom_post_pass.previous


def rewrite(obj, ops: Iterable[str] | None = None):
    """Rewrite an ExportedProgram (returns a new one that validates, runs, saves and loads)
    or a pre-dispatch GraphModule (rewritten in place and returned)."""
    if isinstance(obj, torch.export.ExportedProgram):
        ep, report = _rewrite_program(obj, ops)
        COUNTERS.update(report.counters())
        # replaced output nodes have new names: keep the signature in step with the graph
        outputs = next(iter(ep.graph.find_nodes(op="output"))).args[0]
        for spec, node in zip(ep.graph_signature.output_specs, outputs):
            if isinstance(node, fx.Node) and hasattr(spec.arg, "name"):
                spec.arg.name = node.name
        return ep
    if isinstance(obj, fx.GraphModule):
        report = rewrite_graph(obj, ops)
        COUNTERS.update(report.counters())
        return obj
    raise TypeError(f"torch_flash.rewrite: expected an ExportedProgram or GraphModule, got {type(obj).__name__}")


def _rewrite_program(ep: torch.export.ExportedProgram, ops) -> tuple[torch.export.ExportedProgram, Report]:
    """A copy of ep, rewritten, and its report; lifted constants are read as their values."""
    ep = _copy(ep)
    with lifted_values(ep):
        return ep, rewrite_graph(ep.graph_module, ops)


def _copy(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    with warnings.catch_warnings():
        # torch's own deepcopy of an ExportedProgram warns about its pytree internals (2.13)
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        return copy.deepcopy(ep)


def explain(model: Callable | torch.export.ExportedProgram, *args, **kwargs) -> Report:
    """Every candidate site of `model(*args, **kwargs)`: rewritten (to which op) or not, and why.
    Runs the model once through Dynamo without changing it. An ExportedProgram (as `rewrite`
    takes) is read from its graph, with no inputs."""
    if isinstance(model, torch.export.ExportedProgram):
        if args or kwargs:
            raise TypeError("torch_flash.explain: an ExportedProgram is explained from its graph; pass no inputs")
        return _rewrite_program(model, None)[1]
    report = Report()

    def record(gm, example_inputs):
        report.extend(rewrite_graph(_predispatch(gm), None))
        return gm.forward

    torch.compile(model, backend=record)(*args, **kwargs)
    return report


def flash(gm: fx.GraphModule, example_inputs):
    """The `flash` backend of torch.compile(model, backend="flash"): all op families, then
    Inductor. Dynamo finds it through the `torch_dynamo_backends` entry point (pyproject)."""
    return _default_backend()(gm, example_inputs)


@functools.cache
def _default_backend() -> Callable:
    return backend()
