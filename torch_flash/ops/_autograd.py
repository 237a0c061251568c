"""How the dispatcher reaches an op's code: the eager fast path, and autograd rules that need
state only a sibling op returns.

Eager path. `torch.library.triton_op` puts three Python layers between the dispatcher and an
op's body on every call: the Autograd kernel (`torch._library.autograd`, which redispatches
even when no gradient is needed), the backend wrapper (`torch._dynamo` disabled, the
`set_wrap_triton_enabled` context manager, an output aliasing check), and the op's
`OpOverloadPacket`. Together 20-25 us a call on a CPU machine, more than the GPU work of a
small op. `triton_op` below is torch's, plus: the body registered straight on the CPU and CUDA
keys (the wrap_triton switch set by hand), and one Autograd kernel that runs the body itself
when no gradient is needed and the call is plain (no tensor subclass, mode, functionalisation
or tracer below Autograd), else hands the call to the autograd rule. Traced calls never meet
this path: fakes, functional and proxied tensors carry keys that send them to torch's own
handling (`plain` below), and under torch.compile the triton op's decomposition runs first.
The public functions go one step further with `call`: where nothing but the Autograd kernel
would act on the call (plain tensors, no mode, no transform, not tracing, no gradient), they
run the body without entering the dispatcher at all, whose C++-to-Python crossing alone costs
about 20 us on the GPU machine's host (docs/perf, "Host cost of an eager call"); a plain call
that records a gradient runs the op's autograd rule directly (_direct_rule).

Autograd via a sibling. `flash.attention` returns `out`, but its backward needs the
log-sum-exp that `flash.attention_with_lse` computes in the same pass; recomputing it would
cost a matmul. `torch.library.register_autograd` only sees an op's own outputs, so
`register_autograd_via` gives the op an autograd.Function of its own: the forward runs the
sibling, keeps its extra state on `ctx`, and returns the public outputs.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import warnings
from typing import Any, Callable

import torch
from torch._library import triton as _library_triton
from torch._library.autograd import make_autograd_impl
from torch._library.custom_ops import CustomOpDef

from .. import _inductor_fixes

# Autograd rules registered through register_autograd_via or by hand, by op name (the registry
# test reads it).
REGISTERED: dict[str, Callable] = {}
# op name -> the body that runs for plain eager calls (triton ops)
_BODIES: dict[str, Callable] = {}
# op name -> positions of the arguments an in-place op writes (their version counters move)
_MUTATED: dict[str, tuple[int, ...]] = {}
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)

_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_BACKEND_KEYS = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
_WRAP_TRITON = _library_triton.wrap_triton_enabled  # the thread-local behind set_wrap_triton_enabled


def plain(keyset: torch._C.DispatchKeySet) -> bool:
    """Whether a call that reached Autograd goes from there straight to its CPU or CUDA kernel:
    no Python key (subclasses, dispatch modes, fake tensors), no pre-dispatch tracer, no
    functorch layer left below."""
    return (keyset & _AFTER_AUTOGRAD).highestPriorityTypeId() in _BACKEND_KEYS


def plain_tensor(t: torch.Tensor) -> bool:
    """A Tensor or Parameter with data (no fake, functional or other subclass, not on meta)."""
    return type(t) in _TENSOR_TYPES and not t.is_meta


def launching_directly(fn: Callable) -> Callable:
    """fn with wrap_triton's tracing hook off, as triton_op's own eager wrapper has it, so that
    its kernels launch as plain Triton calls (the thread-local set by hand: torch's context
    manager costs microseconds a call). Also the body of the custom ops whose kernels the
    compiler must not see (their tensors are always real)."""
    @functools.wraps(fn)
    def body(*args, **kwargs):
        prev = getattr(_WRAP_TRITON, "value", True)
        _WRAP_TRITON.value = False
        try:
            return fn(*args, **kwargs)
        finally:
            _WRAP_TRITON.value = prev
    # custom_op infers the schema from this signature, types resolved in fn's module
    body.__signature__ = inspect.signature(fn, eval_str=True)
    return body


class _KernelsOf(list):
    """torch's scan of a triton op's body for the Triton kernels it calls, whose sources
    AOTAutograd's cache key reads, run when first read instead of when the op is registered:
    the scan imports Inductor and parses the body's source and everything it calls (about 2 s
    of `import torch_flash`), and finds none in these ops, whose bodies launch through
    kernels/triton/launch.py."""

    def __init__(self, scan: Callable, fn: Callable):
        super().__init__()
        self._scan = (scan, fn)

    def __iter__(self):
        if self._scan is not None:
            scan, fn = self._scan
            self._scan = None
            self.extend(scan(fn))
        return super().__iter__()


@contextlib.contextmanager
def _kernel_scan_deferred():
    scan = getattr(_library_triton, "get_inner_triton_kernels", None)  # torch >= 2.13
    if scan is None:
        yield
        return
    _library_triton.get_inner_triton_kernels = lambda fn: _KernelsOf(scan, fn)
    try:
        yield
    finally:
        _library_triton.get_inner_triton_kernels = scan


def register_body(opdef: CustomOpDef, mutated: tuple[int, ...] = ()) -> None:
    """A custom op's body (launching_directly's), run without the dispatcher by call() and
    recorded by the eager fast path (ops/_fast.py), as a triton op's is; mutated: the positions
    of the arguments it writes."""
    _BODIES[opdef._name] = opdef._init_fn
    _MUTATED[opdef._name] = mutated
    _register_autocast_off(opdef)


def triton_op(name: str, *, mutates_args) -> Callable[[Callable], CustomOpDef]:
    """torch.library.triton_op, with the eager fast path (module docstring)."""
    def dec(fn: Callable) -> CustomOpDef:
        with _kernel_scan_deferred():
            opdef = torch.library.triton_op(name, mutates_args=mutates_args)(_fixing_inductor(fn))
        body = launching_directly(fn)
        for key in ("CPU", "CUDA"):
            opdef._lib.impl(opdef._name, body, key)
        _register_autocast_off(opdef)
        _BODIES[opdef._name] = body
        schema = opdef._opoverload._schema
        _MUTATED[opdef._name] = tuple(i for i, a in enumerate(schema.arguments)
                                      if a.alias_info is not None and a.alias_info.is_write)
        _register_autograd_kernel(opdef, make_autograd_impl(opdef._opoverload, opdef))
        return opdef
    return dec


_AUTOCAST_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA))


def _register_autocast_off(opdef: CustomOpDef) -> None:
    """The op's Autocast kernels (dispatched only while autocast is on): the op runs with the
    autocast keys excluded, so that its body's ATen calls (the reference paths, linear
    cross-entropy's matmuls) compute in the dtypes it was given, as its kernels do. call()
    takes the dispatcher then. (A key guard: torch.autocast(enabled=False) costs 10x more.)"""
    op = opdef._opoverload

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            return op(*args, **kwargs)
    for key in ("AutocastCPU", "AutocastCUDA"):
        opdef._lib.impl(opdef._name, kernel, key)


def _fixing_inductor(fn: Callable) -> Callable:
    """fn as torch's triton_op runs it: where a compiler traces the op into its kernels (eager
    calls run `body`), after installing the fix AOTInductor needs (torch_flash/_inductor_fixes.py)."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        _inductor_fixes.apply()
        return fn(*args, **kwargs)
    traced.__signature__ = inspect.signature(fn, eval_str=True)
    return traced


def _register_autograd_kernel(opdef: CustomOpDef, rule: Callable) -> None:
    """Registers the op's Autograd kernel: the body for plain calls without a gradient, else
    rule(keyset, *args, **kwargs) (torch's register_autograd machinery, or one of ours)."""
    body = _BODIES.get(opdef._name)
    if body is None or _MUTATED[opdef._name]:  # in-place ops pass ADInplaceOrView (version counters)
        kernel = rule
    else:
        def kernel(keyset, *args, **kwargs):
            if plain(keyset) and not (torch.is_grad_enabled() and torch._C._any_requires_grad(*args)):
                return body(*args, **kwargs)
            return rule(keyset, *args, **kwargs)
    with warnings.catch_warnings():
        # custom_op installs an Autograd kernel of its own; this one replaces it (torch 2.11
        # refuses the override unless it is asked for explicitly)
        warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
        opdef._lib.impl(opdef._name, kernel, "Autograd", with_keyset=True, allow_override=True)


_NOT_PLAIN, _NO_GRAD, _GRAD = 0, 1, 2


def _classify(args: tuple, kwargs: dict) -> int:
    """_NOT_PLAIN unless the dispatcher would hand this eager call straight to the op's Autograd
    kernel and from there to its body (see `plain`), told from Python: no torch function or
    dispatch mode (make_fx, FakeTensorMode, user modes), no functorch transform (vmap, grad), no
    torch.jit trace, every tensor a plain_tensor. Then _GRAD where a positional tensor needs a
    gradient recorded (as torch's autograd kernel asks), else _NO_GRAD."""
    if (torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack()
            or torch._C._are_functorch_transforms_active() or torch._C._get_tracing_state() is not None):
        return _NOT_PLAIN
    for a in kwargs.values():
        if isinstance(a, torch.Tensor) and not plain_tensor(a):
            return _NOT_PLAIN
    grad = False
    for a in args:
        if isinstance(a, torch.Tensor):
            if not plain_tensor(a):
                return _NOT_PLAIN
            grad = grad or a.requires_grad
    return _GRAD if grad and torch.is_grad_enabled() else _NO_GRAD


def call(op: str, *args, **kwargs):
    """torch.ops.flash.<op>(*args, **kwargs), without the dispatcher where the call is plain
    (_classify): without a gradient the body runs directly, in-place ops then moving their
    written tensors' version counters themselves, as ADInplaceOrView would (written tensors
    must be passed positionally for that); with one, the op's autograd rule runs directly
    (_direct_rule). Ops on the compiled fast path take the dispatcher for CUDA tensors: their
    kernels there are C++ (ops/_fast.py; FAST_FORWARD ops without a gradient only)."""
    if torch.compiler.is_compiling() or torch._C._is_any_autocast_enabled():
        # Dynamo traces the op call, nothing else here; autocast: the op's Autocast kernel
        return getattr(torch.ops.flash, op).default(*args, **kwargs)
    first = args[0] if args else next(iter(kwargs.values()), None)
    cuda = isinstance(first, torch.Tensor) and first.is_cuda
    if cuda:
        if _FAST_PENDING:
            _load_fast()
        overload = FAST.get(op)
        if overload is not None:  # the dispatcher reaches C++ directly
            return overload(*args, **kwargs)
    body, mutated = _BODIES.get(op), _MUTATED.get(op, ())
    kind = _NOT_PLAIN if body is None or (mutated and len(args) <= mutated[-1]) else _classify(args, kwargs)
    if kind == _NO_GRAD:
        forward = FAST_FORWARD.get(op) if cuda else None
        if forward is not None:  # straight to the C++ CUDA kernel
            with torch._C._AutoDispatchBelowADInplaceOrView():
                out = forward(*args, **kwargs)
        else:
            out = body(*args, **kwargs)
        for i in mutated:
            if args[i] is not None:
                torch.autograd.graph.increment_version(args[i])
        return out
    rule = _direct_rule(op) if kind == _GRAD and not mutated else None
    if rule is None:
        return getattr(torch.ops.flash, op).default(*args, **kwargs)
    return rule(*args, **kwargs)


# op name -> its OpOverload, for ops whose CUDA and AutogradCUDA kernels are the compiled fast
# path's (ops/_fast.py): their CUDA calls go straight to the dispatcher
FAST: dict[str, Any] = {}
# the same for ops whose CUDA kernel alone is C++ (their autograd rule stays Python): calls
# without a gradient go to it
FAST_FORWARD: dict[str, Any] = {}
# whether the compiled fast path is still to be loaded (on the first CUDA call)
_FAST_PENDING = True


def _load_fast() -> None:
    global _FAST_PENDING
    _FAST_PENDING = False
    from . import _fast
    _fast.ensure()


# op name -> its autograd rule callable as rule(*args, **kwargs) without the dispatcher, or None
_DIRECT: dict[str, Callable | None] = {}


def _direct_rule(op: str) -> Callable | None:
    """The autograd rule of a plain call that records a gradient: a hand-written one
    (register_autograd_kernel), else an autograd.Function that does what torch's register_autograd
    machinery (torch._library.autograd) does around the body, minus the dispatcher's redispatch
    and its per-call default filling (about 70 us a call on the GPU machine's host)."""
    if op not in _DIRECT:
        _DIRECT[op] = REGISTERED.get(op) or _function_rule(op)
    return _DIRECT[op]


def _function_rule(op: str) -> Callable | None:
    from torch._library.custom_ops import OPDEFS
    opdef = OPDEFS.get(f"flash::{op}")
    if opdef is None or opdef._backward_fn is None:
        return None
    body, backward, setup = _BODIES[op], opdef._backward_fn, opdef._setup_context_fn
    arguments = opdef._opoverload._schema.arguments
    positional = [(a.name, a.default_value if a.has_default_value() else inspect.Parameter.empty)
                  for a in arguments if not a.kwarg_only]
    keyword_only = {a.name: a.default_value for a in arguments if a.kwarg_only}

    class _Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keywords, *args):
            out = body(*args, **keywords)
            if setup is not None:
                extra = {"keyword_only_inputs": keywords} if keyword_only else {}
                setup(ctx=ctx, inputs=args, output=out, **extra)
            return out

        @staticmethod
        def backward(ctx, *grads):
            needs = ctx.needs_input_grad
            ctx.needs_input_grad = needs[1:]  # the rule sees its inputs' flags only
            try:
                result = backward(ctx, *grads)
            finally:
                ctx.needs_input_grad = needs
            return (None, *result) if isinstance(result, tuple) else (None, result)

    def rule(*args, **kwargs):
        given = list(args)
        for name, default in positional[len(args):]:
            if name not in kwargs and default is inspect.Parameter.empty:
                raise TypeError(f"flash.{op}() missing required argument '{name}'")
            given.append(kwargs.get(name, default))
        keywords = {name: kwargs.get(name, default) for name, default in keyword_only.items()}
        return _Function.apply(keywords, *given)
    return rule


def register_autograd_kernel(opdef: CustomOpDef, rule: Callable) -> None:
    """An autograd rule written by hand: rule(*args, **kwargs) runs for every call that the
    eager path (module docstring) does not serve."""
    _register_autograd_kernel(opdef, lambda keyset, *args, **kwargs: rule(*args, **kwargs))
    REGISTERED[opdef._qualname.split("::")[1]] = rule


def register_autograd_via(opdef: CustomOpDef, *, forward: Callable[..., tuple[Any, Any]],
                          setup_context: Callable, backward: Callable, pass_needs_grad: bool = False) -> None:
    """forward(**inputs) -> (output, state); setup_context(ctx, inputs, output, state);
    backward(ctx, *grad_outputs) -> {input name: gradient}. pass_needs_grad: forward(needs_grad,
    **inputs) with the frozenset of input names that need a gradient, for a forward that
    computes gradients itself and should skip the others."""
    register_autograd_kernel(opdef, autograd_rule(opdef, forward=forward, setup_context=setup_context,
                                                  backward=backward, pass_needs_grad=pass_needs_grad))


def autograd_rule(opdef: CustomOpDef, *, forward: Callable[..., tuple[Any, Any]], setup_context: Callable,
                  backward: Callable, pass_needs_grad: bool = False) -> Callable:
    """register_autograd_via's rule, rule(*args, **kwargs), not registered."""
    overload = opdef._opoverload
    # bind by the schema: triton_op's implementation is a (*args, **kwargs) wrapper
    arguments = overload._schema.arguments
    names = [a.name for a in arguments]
    defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}

    class _Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            inputs = dict(zip(names, args))
            if pass_needs_grad:
                needs = frozenset(n for n, need in zip(names, ctx.needs_input_grad) if need)
                output, state = forward(needs, **inputs)
            else:
                output, state = forward(**inputs)
            setup_context(ctx, inputs, output, state)
            return output

        @staticmethod
        def backward(ctx, *grads):
            got = backward(ctx, *grads)
            return tuple(got.get(n) for n in names)

    def rule(*args, **kwargs):
        given = {**dict(zip(names, args)), **kwargs}
        values = [given[n] if n in given else defaults[n] for n in names]
        needs_grad = torch.is_grad_enabled() and any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in values)
        if not needs_grad:
            with torch._C._AutoDispatchBelowAutograd():
                return overload(*args, **kwargs)
        return _Function.apply(*values)

    return rule


# csrc/fast/fast_path.h, Source::Kind
ARG, SAVED, GRAD, GRAD_OR_NONE, DTYPE_OF, NONE, REQUIRES_GRAD, CONST, DEFAULT, NOT_ARG = range(10)


@dataclasses.dataclass(frozen=True)
class Src:
    """Where one argument of a backward op comes from: ARG (the forward's argument `ref`, not a
    tensor), SAVED (the ref-th saved tensor), GRAD / GRAD_OR_NONE (the gradient of the ref-th
    output; an unused output's is zeros / None), DTYPE_OF (the dtype of tensor argument `ref`),
    NONE (None), REQUIRES_GRAD (whether tensor argument `ref` requires a gradient), CONST (the
    integer `ref`), DEFAULT (the called op's default for this argument), NOT_ARG (the negation of
    the forward's bool argument `ref`; backward_args only)."""
    kind: int
    ref: int | str | None = None


@dataclasses.dataclass(frozen=True)
class Spec:
    """An op's autograd rule as data, run by the Python rule (register_autograd_spec) and by the
    C++ node of the eager fast path (csrc/fast/autograd.cpp) alike.

    forward: the op whose call computes the outputs, with the op's arguments by name (a sibling
    that also returns what the backward needs); None: the op itself. outputs: which of its
    returns the op returns. save: what the backward keeps, an argument by name or forward's i-th
    return. backward, backward_args: the backward op and where its arguments come from. grads:
    argument name -> (index of its gradient among backward's returns, name of the argument whose
    dtype it is cast to, or None); arguments that were None get none. python_if: arguments
    that, when true (a name) or equal to a value (a (name, value) pair), send the call to the
    rule register_autograd_spec is given beside the Spec (or the op's own Python rule).
    python_if_grad: tensor arguments that send the call to that same rule where they require a
    gradient that is being recorded (which may refuse it: rotary's tables).
    forward_args: forward's arguments that are not the op's same-named one, by name (REQUIRES_GRAD,
    DEFAULT, ARG of another name). handout: forward's returns that are backward's returns for an
    upstream gradient of one; the first backward without create_graph or retain_graph gives
    them away, each scaled in place by the gradient of output 0 through the op `scale`
    (scale(grad, grad_out)), instead of calling backward (which recomputes). Only the C++ node
    runs handout Specs (register_fast_spec): the op's Python rule does the same itself."""
    backward: str
    backward_args: tuple[Src, ...]
    grads: tuple[tuple[str, int, str | None], ...]
    save: tuple[str | int, ...]
    forward: str | None = None
    outputs: tuple[int, ...] = (0,)
    python_if: tuple[str | tuple[str, Any], ...] = ()
    python_if_grad: tuple[str, ...] = ()
    forward_args: tuple[tuple[str, Src], ...] = ()
    handout: tuple[int, ...] = ()
    scale: str | None = None


# op name -> its Spec (the fast path hands them to C++)
SPECS: dict[str, Spec] = {}


def _schema_names(op: str) -> tuple[list[str], list[str]]:
    """(positional, keyword-only) argument names of flash.<op>."""
    arguments = getattr(torch.ops.flash, op).default._schema.arguments
    return [a.name for a in arguments if not a.kwarg_only], [a.name for a in arguments if a.kwarg_only]


def register_autograd_spec(opdef: CustomOpDef, spec: Spec, otherwise: Callable | None = None) -> None:
    """opdef's autograd rule from its Spec (through register_autograd_via); otherwise: the rule
    (as autograd_rule returns it) of the calls whose spec.python_if arguments are not all false,
    or one of whose spec.python_if_grad arguments requires a gradient that is being recorded."""
    name = opdef._name
    if spec.handout or spec.forward_args:
        raise ValueError(f"flash.{name}: a Spec with a handout or forward_args runs in C++ only (register_fast_spec)")
    forward_names = sum(_schema_names(spec.forward or name), [])
    backward_positional, keyword = _schema_names(spec.backward)
    n_positional = len(backward_positional)

    def forward(**inputs):
        out = call(spec.forward or name, **{n: inputs[n] for n in forward_names})
        outs = out if isinstance(out, tuple) else (out,)
        public = tuple(outs[i] for i in spec.outputs)
        return (public if len(public) > 1 else public[0]), outs

    def setup_context(ctx, inputs, output, outs):
        # an unused output's gradient: zeros for GRAD (made here), None for GRAD_OR_NONE
        ctx.set_materialize_grads(False)
        ctx.outputs = [(outs[i].shape, outs[i].dtype, outs[i].device) for i in spec.outputs]
        ctx.save_for_backward(*(inputs[s] if isinstance(s, str) else outs[s] for s in spec.save))
        ctx.values = {n: v for n, v in inputs.items() if not isinstance(v, torch.Tensor)}
        ctx.dtypes = {n: v.dtype for n, v in inputs.items() if isinstance(v, torch.Tensor)}
        ctx.requires = {n: v.requires_grad for n, v in inputs.items() if isinstance(v, torch.Tensor)}

    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        zeros = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                 for g, (shape, dtype, device) in zip(grads, ctx.outputs)]
        sources = {ARG: ctx.values, SAVED: saved, GRAD: zeros, GRAD_OR_NONE: grads, DTYPE_OF: ctx.dtypes,
                   NONE: {None: None}, REQUIRES_GRAD: collections.defaultdict(bool, ctx.requires),
                   NOT_ARG: {n: not v for n, v in ctx.values.items()}}
        args = [s.ref if s.kind == CONST else sources[s.kind][s.ref] for s in spec.backward_args]
        out = call(spec.backward, *args[:n_positional], **dict(zip(keyword, args[n_positional:])))
        out = out if isinstance(out, tuple) else (out,)
        result = {n: out[i] if cast is None else out[i].to(ctx.dtypes[cast])
                  for n, i, cast in spec.grads if ctx.requires.get(n)}
        return result

    rule = autograd_rule(opdef, forward=forward, setup_context=setup_context, backward=backward)
    if spec.python_if or spec.python_if_grad:
        names = [a.name for a in opdef._opoverload._schema.arguments]
        defaults = {a.name: a.default_value for a in opdef._opoverload._schema.arguments if a.has_default_value()}
        flags = [(names.index(n), n, v) for n, v in python_if_pairs(spec)]
        grad_flags = [(names.index(n), n) for n in spec.python_if_grad]
        spec_rule = rule

        def rule(*args, **kwargs):
            def given(i, n):
                return args[i] if i < len(args) else kwargs.get(n, defaults.get(n))
            flagged = any(given(i, n) == v for i, n, v in flags) or (torch.is_grad_enabled() and any(
                isinstance(t := given(i, n), torch.Tensor) and t.requires_grad for i, n in grad_flags))
            return (otherwise if flagged else spec_rule)(*args, **kwargs)
    register_autograd_kernel(opdef, rule)
    SPECS[name] = spec


def python_if_pairs(spec: Spec) -> list[tuple[str, Any]]:
    """spec.python_if as (argument, value sending the call to Python) pairs."""
    return [(entry, True) if isinstance(entry, str) else entry for entry in spec.python_if]


def register_fast_spec(opdef: CustomOpDef, spec: Spec) -> None:
    """spec as the C++ node of the eager fast path runs it (csrc/fast/autograd.cpp), for an op
    whose Python rule is its own (register_autograd_via) and computes the same: the fast path
    tests compare the two bit for bit."""
    SPECS[opdef._name] = spec


def grad_or_empty(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Custom ops cannot return None: an absent weight or bias gets an empty gradient."""
    return like.new_empty(0) if grad is None else grad
