"""flash.rotary and friends: rotary position embedding (RoPE), schemas, dispatch, autograd,
public functions.

x (B, H, S, D) with any strides and a contiguous last dim (FlashAttention's (B, S, H, D) is
its .transpose(1, 2) view), or (total, H, D) packed with cu_seqlens (B + 1,). cos/sin are
(S_ro, rd / 2) tables indexed by position, or (B or 1, S, rd / 2) already gathered per
token; rd = 2 * cos.shape[-1] <= D and dims past rd pass through (partial rotary). See
torch_flash/reference/rotary.py for the formula.

Ops: flash.rotary (x) and flash.rotary_qk (q and k of their own head counts, one kernel
launch), and their in-place forms flash.rotary_ / flash.rotary_qk_ (declared mutations,
no outputs). The rotation is orthogonal, so each backward is the same rotation by the
opposite angle (flash.rotary_backward, flash.rotary_qk_backward: conjugate flipped), and a
backward op's own gradient is itself with conjugate flipped back. The in-place ops are
differentiable too (see _register_inplace_autograd).
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import Tensor
from torch._C._autograd import CreationMeta
from torch._subclasses.fake_tensor import is_fake


from .. import _dispatch
from ..reference import rotary as ref
from ._autograd import (ARG, GRAD, NOT_ARG, SAVED, Spec, Src, call, register_autograd_kernel,
                        register_autograd_spec, triton_op)
from ._checks import (INDEX_DTYPES, check, check_last_dim_contiguous, check_positive_float,
                      check_same_device, check_tensor)
from ._plans import Plans


def check_table(op: str, cos, sin, head_dim, names=("cos", "sin")) -> None:
    """cos/sin tables of the same shape and dtype whose rotary dim fits in head_dim."""
    for name, t in zip(names, (cos, sin)):
        check_tensor(op, name, t, ndim=(2, 3))
    check(cos.shape == sin.shape, op,
          f"{names[0]} shape {tuple(cos.shape)} differs from {names[1]} shape {tuple(sin.shape)}")
    check(cos.dtype == sin.dtype, op, f"{names[0]} dtype {cos.dtype} differs from {names[1]} dtype {sin.dtype}")
    check(cos.shape[-1] > 0, op, f"{names[0]} must have rotary_dim // 2 > 0 columns, got shape {tuple(cos.shape)}")
    check(2 * cos.shape[-1] <= head_dim, op,
          f"rotary_dim {2 * cos.shape[-1]} (2 * {names[0]}.shape[-1]) exceeds the head dim {head_dim}")


def check_args(op: str, x, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens, name: str = "x") -> None:
    """x (named `name` in the messages) is the input, or the gradient of a backward op."""
    packed = cu_seqlens is not None
    check_tensor(op, name, x, ndim=3 if packed else 4)
    check_last_dim_contiguous(op, **{name: x})
    check_table(op, cos, sin, x.shape[-1])
    check(seqlen_offset >= 0, op, f"seqlen_offset must be >= 0, got {seqlen_offset}")
    if packed:
        check_tensor(op, "cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES)
        check(cu_seqlens.shape[0] >= 1, op, "cu_seqlens must have batch + 1 >= 1 entries, got 0")
        batch = cu_seqlens.shape[0] - 1
    else:
        batch = x.shape[0]
    if seqlen_offsets is not None:
        check_tensor(op, "seqlen_offsets", seqlen_offsets, ndim=1, dtypes=INDEX_DTYPES)
        check(seqlen_offsets.shape[0] == batch, op,
              f"seqlen_offsets has {seqlen_offsets.shape[0]} entries, expected batch size {batch}")
    if cos.dim() == 3:
        check(not packed, op, "cos/sin gathered per token (3-D) need x of shape (B, H, S, D), not packed")
        check(seqlen_offset == 0 and seqlen_offsets is None, op,
              "cos/sin gathered per token (3-D) take no seqlen_offset/seqlen_offsets")
        check(cos.shape[0] in (1, batch) and cos.shape[1] == x.shape[2], op,
              f"cos/sin of shape {tuple(cos.shape)} must be (B or 1, S, rotary_dim // 2) "
              f"for {name} of shape {tuple(x.shape)}")
    elif not packed:
        check(x.shape[2] + seqlen_offset <= cos.shape[0], op,
              f"cos/sin have {cos.shape[0]} positions, fewer than seqlen {x.shape[2]} + "
              f"seqlen_offset {seqlen_offset}")
    check_same_device(op, **{name: x}, cos=cos, sin=sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens)


def check_qk_args(op: str, q, k, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens,
                  names: tuple[str, str] = ("q", "k")) -> None:
    """check_args for q, and k of q's shape but for the head count (dim 1), dtype and device."""
    qn, kn = names
    check_args(op, q, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens, qn)
    check_tensor(op, kn, k, ndim=q.dim())
    check_last_dim_contiguous(op, **{kn: k})
    check(k.shape[:1] + k.shape[2:] == q.shape[:1] + q.shape[2:], op,
          f"{kn} shape {tuple(k.shape)} must equal {qn} shape {tuple(q.shape)} but for the heads (dim 1)")
    check(k.dtype == q.dtype, op, f"{kn} dtype {k.dtype} differs from {qn} dtype {q.dtype}")
    check_same_device(op, **{qn: q, kn: k})


def values_known(t) -> bool:
    """Whether t holds real values: not a fake tensor of a trace (torch.compile runs a
    triton_op's implementation on fake tensors) nor a meta tensor."""
    return not is_fake(t) and t.device.type != "meta"


def check_data(op: str, x, cos, seqlen_offset, seqlen_offsets, cu_seqlens) -> None:
    """The checks that read index values: eager calls with the index tensors on the CPU, as
    attention_varlen's and attention_decode's (a trace has no values; reading GPU ones would
    stall the host; the kernel rotates a token whose position misses the table to NaN)."""
    if not values_known(x) or x.device.type != "cpu":
        return
    if cu_seqlens is not None:
        cu = cu_seqlens.long()
        check(cu[0].item() == 0 and bool((cu.diff() >= 0).all()) and cu[-1].item() == x.shape[0], op,
              f"cu_seqlens must start at 0, not decrease and end at total tokens {x.shape[0]}, "
              f"got {cu_seqlens.tolist()}")
    if seqlen_offsets is not None:
        check(bool((seqlen_offsets >= 0).all()), op,
              f"seqlen_offsets must be >= 0, got {seqlen_offsets.tolist()}")
    if cos.dim() == 2 and (seqlen_offsets is not None or cu_seqlens is not None) and x.numel():
        last = ref.positions(x, seqlen_offset, seqlen_offsets, cu_seqlens).max().item()
        check(last < cos.shape[0], op,
              f"cos/sin have {cos.shape[0]} positions, but a token sits at position {last}")


def _rows_overlap(a: Tensor, b: Tensor, width: int) -> bool:
    """Whether the first `width` elements of a row of a and of a row of b (what an in-place
    rotation reads and writes) share memory. Exact, from shapes and strides alone (no device
    work), for views of one buffer with the same strides: q and k of a fused qkv projection may
    be written in place, two overlapping head ranges may not. Other layouts that meet in one
    buffer count as overlapping."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (lo_a, hi_a), (lo_b, hi_b) = (
        (t.storage_offset(), t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape[:-1], t.stride())) + width)
        for t in (a, b))
    if hi_a <= lo_b or hi_b <= lo_a:
        return False
    if a.stride() != b.stride() or a.dim() != b.dim():
        return True
    # Rows start at offset + sum(i_k * s_k). They meet where some index difference d (d_k in
    # (-nb_k, na_k)) gives sum(d_k * s_k) within width of b's offset minus a's: enumerate d over
    # all dims but the longest, and solve that one's range of d in closed form.
    dims = list(zip(a.shape[:-1], b.shape[:-1], a.stride()[:-1]))
    longest = max(range(len(dims)), key=lambda i: dims[i][0] + dims[i][1])
    combos = 1
    for i, (na, nb, _) in enumerate(dims):
        combos *= 1 if i == longest else na + nb - 1
    if combos > 2**20:
        return True
    rest = torch.zeros((), dtype=torch.long)
    for i, (na, nb, st) in enumerate(dims):
        if i != longest:
            rest = rest[..., None] + torch.arange(1 - nb, na) * st
    need = b.storage_offset() - a.storage_offset() - rest.flatten()  # d_longest * s within width of this
    na, nb, st = dims[longest]
    if st == 0:
        return bool((need.abs() < width).any())
    low = torch.clamp(-torch.div(width - 1 - need, st, rounding_mode="floor"), min=1 - nb)  # ceil((need-w+1)/s)
    high = torch.clamp(torch.div(need + width - 1, st, rounding_mode="floor"), max=na - 1)
    return bool((low <= high).any())


def check_inplace_args(op: str, tensors: dict, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens) -> None:
    """The tensors an in-place op writes, {"x": x} or {"q": q, "k": k}: check_args or
    check_qk_args; and in eager calls (as check_data) writable (not inference tensors outside
    inference mode), with no element shared within one (an expanded view) or between two
    (q is k, or overlapping views), so that no refusal comes after q is written."""
    xs = list(tensors.values())
    if len(xs) == 1:
        check_args(op, xs[0], cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens, *tensors)
    else:
        check_qk_args(op, *xs, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens, tuple(tensors))
    if not values_known(xs[0]):
        return
    for name, t in tensors.items():
        check(not t.is_inference() or torch.is_inference_mode_enabled(), op,
              f"{name} is an inference tensor, writable in place only under torch.inference_mode(); "
              f"rotate a copy, or use inplace=False")
        check(torch._debug_has_internal_overlap(t) != 1, op,
              f"{name} has elements that share memory (strides {t.stride()}); in place needs distinct ones")
    if len(xs) == 2:
        check(not _rows_overlap(*xs, 2 * cos.shape[-1]), op,
              "{} and {} share memory (the same tensor, or overlapping views); in place needs distinct "
              "ones".format(*tensors))


# signature -> the Triton kernel's Rotate plan, or None (the reference path)
PLANS = Plans()


def _checked() -> None:
    """The check of a caller that checked already."""


def _rotate(op: str, check: Callable[[], None], xs: tuple[Tensor, ...], inplace: bool, cos, sin,
            seqlen_offsets, cu_seqlens, interleaved, seqlen_offset, conjugate) -> tuple[Tensor, ...]:
    """Rotate x, or q and k, into new tensors of their layouts, or in place; the Triton kernel
    takes all of them in one launch. check() runs the op's argument checks, which with the
    choice of path are made once per signature of real inputs (ops/_plans.py); the checks that
    read index values run every time."""
    flags = dict(interleaved=interleaved, seqlen_offset=seqlen_offset, seqlen_offsets=seqlen_offsets,
                 cu_seqlens=cu_seqlens, conjugate=conjugate)

    def make():
        check()
        def serves():
            from ..kernels.triton.rotary import rotary_supports
            return all(rotary_supports(x, cos, sin) for x in xs)
        if _dispatch.select(op, xs[0], triton=serves) != "triton":
            return None
        from ..kernels.triton.rotary import Rotate
        like = xs if inplace else tuple(torch.empty_like(x, device="meta") for x in xs)  # outs' layouts
        return Rotate(tuple(zip(xs, like)), cos, sin, **flags)
    plan = PLANS.get(op, (*xs, inplace, cos, sin, *flags.values()), make)
    check_data(op, xs[0], cos, seqlen_offset, seqlen_offsets, cu_seqlens)
    # new tensors in x's own layout (as empty_like), so the fake can promise it
    outs = xs if inplace else tuple(torch.empty_like(x) for x in xs)
    if plan is not None:
        plan(tuple(zip(xs, outs)), cos, sin, seqlen_offsets, cu_seqlens)
        return outs
    for x, out in zip(xs, outs):
        if inplace:
            ref.rotary_(x, cos, sin, **flags)
        else:
            out.copy_(ref.rotary(x, cos, sin, **flags))
    return outs


@triton_op("flash::rotary", mutates_args=())
def _rotary(x: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets: Optional[Tensor] = None,
            cu_seqlens: Optional[Tensor] = None, *, interleaved: bool = False, seqlen_offset: int = 0,
            conjugate: bool = False) -> Tensor:
    return _rotate("rotary", lambda: check_args("rotary", x, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens),
                   (x,), False, cos, sin, seqlen_offsets, cu_seqlens, interleaved, seqlen_offset,
                   conjugate)[0]


def grad_rows(grad):
    """grad, or its copy where its last dim is not contiguous (the expanded gradient of a sum()):
    the backward ops take a gradient of any strides."""
    return grad if grad.dim() == 0 or grad.stride(-1) == 1 else grad.contiguous()  # 0-d: check_args refuses


@triton_op("flash::rotary_backward", mutates_args=())
def _rotary_backward(grad: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets: Optional[Tensor] = None,
                     cu_seqlens: Optional[Tensor] = None, *, interleaved: bool = False,
                     seqlen_offset: int = 0, conjugate: bool = False) -> Tensor:
    """Gradient of flash.rotary (and flash.rotary_) with the same flags: the rotation by the
    opposite angle; grad of any strides (see grad_rows)."""
    grad = grad_rows(grad)

    def check():
        check_args("rotary_backward", grad, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens, "grad")
    return _rotate("rotary_backward", check, (grad,), False, cos, sin, seqlen_offsets, cu_seqlens, interleaved,
                   seqlen_offset, not conjugate)[0]


@triton_op("flash::rotary_qk", mutates_args=())
def _rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets: Optional[Tensor] = None,
               cu_seqlens: Optional[Tensor] = None, *, interleaved: bool = False, seqlen_offset: int = 0,
               conjugate: bool = False) -> tuple[Tensor, Tensor]:
    """flash.rotary of q and of k (its own head count), in one kernel launch."""
    def check():
        check_qk_args("rotary_qk", q, k, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens)
    return _rotate("rotary_qk", check, (q, k), False, cos, sin, seqlen_offsets, cu_seqlens, interleaved,
                   seqlen_offset, conjugate)


@triton_op("flash::rotary_qk_backward", mutates_args=())
def _rotary_qk_backward(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor,
                        seqlen_offsets: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None, *,
                        interleaved: bool = False, seqlen_offset: int = 0,
                        conjugate: bool = False) -> tuple[Tensor, Tensor]:
    """Gradients of flash.rotary_qk (and flash.rotary_qk_) with the same flags, in one launch;
    gradients of any strides (see grad_rows)."""
    grad_q, grad_k = grad_rows(grad_q), grad_rows(grad_k)

    def check():
        check_qk_args("rotary_qk_backward", grad_q, grad_k, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens,
                      ("grad_q", "grad_k"))
    return _rotate("rotary_qk_backward", check, (grad_q, grad_k), False, cos, sin, seqlen_offsets, cu_seqlens,
                   interleaved, seqlen_offset, not conjugate)


@triton_op("flash::rotary_", mutates_args=("x",))
def _rotary_inplace(x: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets: Optional[Tensor] = None,
                    cu_seqlens: Optional[Tensor] = None, *, interleaved: bool = False, seqlen_offset: int = 0,
                    conjugate: bool = False) -> None:
    """flash.rotary into x's own storage; dims past the rotary dim are not written."""
    # in place: checks of the tensors' storage, which their signature does not hold, every call
    check_inplace_args("rotary_", {"x": x}, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens)
    _rotate("rotary_", _checked, (x,), True, cos, sin, seqlen_offsets, cu_seqlens, interleaved, seqlen_offset,
            conjugate)


@triton_op("flash::rotary_qk_", mutates_args=("q", "k"))
def _rotary_qk_inplace(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets: Optional[Tensor] = None,
                       cu_seqlens: Optional[Tensor] = None, *, interleaved: bool = False,
                       seqlen_offset: int = 0, conjugate: bool = False) -> None:
    """flash.rotary_qk into q's and k's own storage, in one launch."""
    check_inplace_args("rotary_qk_", {"q": q, "k": k}, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens)
    _rotate("rotary_qk_", _checked, (q, k), True, cos, sin, seqlen_offsets, cu_seqlens, interleaved, seqlen_offset,
            conjugate)


# ---- autograd. The rotation is orthogonal: each op's gradient is the rotation of the incoming
# gradients by the opposite angle, with the op's other flags; only the tables are saved.

def check_tables_no_grad(op: str, cos, sin) -> None:
    """The tables get no gradient (as in FlashAttention): refuse tables that require one
    rather than leave it silently unset."""
    check(not (cos.requires_grad or sin.requires_grad), op,
          "cos/sin require grad, but no gradient flows to the tables; pass them detached "
          "(computed under torch.no_grad(), as models do)")


def _tables_refused(op: str) -> Callable:
    """The autograd rule of the calls whose cos or sin requires a gradient being recorded (the
    Specs' python_if_grad): refused."""
    names = [a.name for a in getattr(torch.ops.flash, op).default._schema.arguments]

    def rule(*args, **kwargs):
        given = {**dict(zip(names, args)), **kwargs}
        check_tables_no_grad(op, given["cos"], given["sin"])  # raises: only such calls come here
    return rule


# (op, its differentiable inputs, its backward op, where that op's conjugate comes from): the
# forward ops' gradients are the backward ops with the same flags, a backward op's is itself
# with conjugate flipped back (the forward's rotation), which takes gradients of any strides
for _op, _inputs, _grad_op, _conjugate in ((_rotary, ("x",), "rotary_backward", ARG),
                                           (_rotary_backward, ("grad",), "rotary_backward", NOT_ARG),
                                           (_rotary_qk, ("q", "k"), "rotary_qk_backward", ARG),
                                           (_rotary_qk_backward, ("grad_q", "grad_k"), "rotary_qk_backward", NOT_ARG)):
    register_autograd_spec(_op, Spec(
        outputs=tuple(range(len(_inputs))),
        save=("cos", "sin", "seqlen_offsets", "cu_seqlens"),
        backward=_grad_op,
        backward_args=(*(Src(GRAD, i) for i in range(len(_inputs))), *(Src(SAVED, i) for i in range(4)),
                       Src(ARG, "interleaved"), Src(ARG, "seqlen_offset"), Src(_conjugate, "conjugate")),
        grads=tuple((name, i, None) for i, name in enumerate(_inputs)),
        python_if_grad=("cos", "sin")), otherwise=_tables_refused(_op._name))


def _register_inplace_autograd(opdef, functional: str) -> None:
    """The Autograd kernel of an in-place op (register_autograd takes functional ops only).
    Without a gradient to record it runs the op's kernel. With one, it rotates by the functional
    op and copies the result into the rotary dims: autograd records the copy on the tensors and
    on the views they may be (q and k of one qkv projection, which a Function marking both dirty
    could not return), and the gradient is the functional op's, the conjugate rotation of the
    incoming one."""
    schema = opdef._opoverload._schema
    names = [a.name for a in schema.arguments]
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    op_name = opdef._qualname.split("::")[1]

    def autograd_kernel(*args, **kwargs):
        given = {**defaults, **dict(zip(names, args)), **kwargs}
        tensors = {n: given.pop(n) for n in mutated}
        xs = list(tensors.values())
        if torch.is_grad_enabled():  # before the kernel path, which would drop their graph
            check_tables_no_grad(op_name, given["cos"], given["sin"])
        if not (torch.is_grad_enabled() and any(x.requires_grad for x in xs)):
            with torch._C._AutoDispatchBelowAutograd():
                return opdef._opoverload(*args, **kwargs)
        # everything the op itself would refuse, refused under this op's name before any write
        check_inplace_args(op_name, tensors, given["cos"], given["sin"], given["seqlen_offset"],
                           given["seqlen_offsets"], given["cu_seqlens"])
        check_data(op_name, xs[0], given["cos"], given["seqlen_offset"], given["seqlen_offsets"],
                   given["cu_seqlens"])
        for name, x in tensors.items():
            base = x._base if x._is_view() else x
            check(not (base.is_leaf and base.requires_grad), op_name,
                  f"{name} is a leaf tensor (or a view of one) that requires grad; rotate a copy, "
                  f"or use inplace=False")
            # autograd refuses to write such views only at the copy below, after q is written
            check(not x._is_view() or torch._C._autograd._get_creation_meta(x) == CreationMeta.DEFAULT, op_name,
                  f"{name} is a view autograd cannot write in place (an output of split, chunk or unbind, "
                  f"or a view made under no_grad); rotate a copy, or use inplace=False")
        rd = 2 * given["cos"].shape[-1]
        rotated = getattr(torch.ops.flash, functional)(*(x[..., :rd] for x in xs), **given)
        for x, r in zip(xs, rotated if isinstance(rotated, tuple) else (rotated,)):
            x[..., :rd].copy_(r)

    register_autograd_kernel(opdef, autograd_kernel)


_register_inplace_autograd(_rotary_inplace, "rotary")
_register_inplace_autograd(_rotary_qk_inplace, "rotary_qk")


# ---- public functions

def _offset_kwargs(seqlen_offsets: Union[int, Tensor]) -> dict:
    """The op's spelling of seqlen_offsets: an int, or a (B,) tensor."""
    if isinstance(seqlen_offsets, Tensor):
        return {"seqlen_offsets": seqlen_offsets}
    return {"seqlen_offset": seqlen_offsets}


def rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False,
           seqlen_offsets: Union[int, Tensor] = 0, cu_seqlens: Optional[Tensor] = None,
           inplace: bool = False) -> Tensor:
    """Rotary position embedding of x, returned in x's dtype and layout.

    x: (B, H, S, D) (any strides, contiguous last dim), or (total, H, D) packed with
    cu_seqlens (B + 1,) int32. cos/sin: (S_ro, rotary_dim // 2) tables (see rotary_cos_sin),
    or (B or 1, S, rotary_dim // 2) already gathered per token (no offsets then). Token s
    of sequence b sits at position s + seqlen_offsets (an int, or a (B,) int tensor: one
    offset per sequence, as in KV-cache decoding). interleaved=False rotates the halves
    of the first rotary_dim dims (GPT-NeoX, LLaMA), True the pairs (x[2i], x[2i+1]) (GPT-J);
    dims past rotary_dim pass through. inplace=True rotates x's own storage (flash.rotary_;
    dims past rotary_dim are not written) and returns x. Differentiable in x, in place too
    (but not on a leaf that requires grad, as for any in-place op).
    """
    kw = dict(interleaved=interleaved, cu_seqlens=cu_seqlens, **_offset_kwargs(seqlen_offsets))
    if inplace:
        call("rotary_", x, cos, sin, **kw)
        return x
    return call("rotary", x, cos, sin, **kw)


def rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False,
              seqlen_offsets: Union[int, Tensor] = 0, cu_seqlens: Optional[Tensor] = None,
              inplace: bool = False) -> tuple[Tensor, Tensor]:
    """rotary of q and k in one kernel launch (forward and backward): (q_out, k_out).

    q (B, Hq, S, D) and k (B, Hkv, S, D) (or (total, Hq, D) and (total, Hkv, D) with
    cu_seqlens) share every dim but the heads (GQA/MQA), and their dtype; options as rotary.
    inplace=True rotates both in their own storage (flash.rotary_qk_) and returns (q, k).
    """
    kw = dict(interleaved=interleaved, cu_seqlens=cu_seqlens, **_offset_kwargs(seqlen_offsets))
    if inplace:
        call("rotary_qk_", q, k, cos, sin, **kw)
        return q, k
    return call("rotary_qk", q, k, cos, sin, **kw)


def rotary_cos_sin(seqlen: int, rotary_dim: int, base: float = 10000.0, device=None,
                   dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """(cos, sin) tables of shape (seqlen, rotary_dim // 2) for positions 0..seqlen-1:
    angle pos * base ** (-2i / rotary_dim), computed in fp32 (fp64 for fp64) as HF does."""
    op = "rotary_cos_sin"
    check(rotary_dim > 0 and rotary_dim % 2 == 0, op, f"rotary_dim must be even and > 0, got {rotary_dim}")
    check(seqlen >= 0, op, f"seqlen must be >= 0, got {seqlen}")
    check_positive_float(op, "base", base)
    check(dtype.is_floating_point, op, f"dtype must be floating point, got {dtype}")
    return ref.rotary_cos_sin(seqlen, rotary_dim, base, device, dtype)
