"""launch(kernel, grid, *args, **kwargs): every Triton launch of the ops goes through here.

Traced (torch.compile, export: wrap_triton's hook on) it is wrap_triton(kernel)[grid](...), so
that the compiler sees the kernel and tunes it itself.

Eager, a launch whose arguments were seen before goes straight to the compiled kernel's C
launcher. Triton's own entry point (JITFunction.run, and Autotuner.run before it) rebinds the
arguments, re-derives the specialisation and the tuning key, and looks the compiled kernel up on
every call, which costs more host time than the kernel takes at small shapes (docs/perf.md,
"Host cost of an eager call"). Here the first launch for a key goes through Triton (compiling
and autotuning as usual); its compiled kernel, chosen config and argument order are kept under
a key that determines everything Triton specialises on, so that later launches with the same
key take the same kernel:
- the kernel, the current CUDA device (Triton compiles per device), the keyword names;
- every argument that is not a tensor (ints, floats, flags, constexprs) by value: finer than
  Triton's specialisation (ints by divisibility by 16 and equality to 1), and than the
  autotuner's key (key arguments and dtypes);
- every tensor by dtype and 16-byte alignment, which is all Triton reads of a tensor argument.
Kernels run by the interpreter (TRITON_INTERPRET=1) and launches while a Triton launch hook is
set (profilers) take Triton's path every time. An op's plan that keeps the launcher launch()
returned passes it back through launch_as and skips the key as well.
"""
from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch._library.triton import is_wrap_triton_enabled
from triton import knobs
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

# kernels with many shapes (varlen lengths, decode caches) would otherwise grow it forever
MAX_LAUNCHERS = 4096
# key -> _Launcher
_LAUNCHERS: dict[tuple, "_Launcher"] = {}
# the recording of ops/_fast.py while it records a call, else None
RECORDING = None
# bytes of a kernel argument of each scalar Triton signature type (pointers: 8)
ARG_BYTES = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4, "i64": 8, "u64": 8,
             "fp32": 4, "f32": 4, "fp64": 8}


class Abi(NamedTuple):
    """How the CUDA driver launches a compiled kernel (for ops/_fast.py's recipes): its function,
    block and shared memory, its parameters in order as (position among the kernel's arguments,
    Triton type), and how many scratch pointers Triton appends (passed as null)."""
    function: int
    threads: int
    shared: int
    params: tuple[tuple[int, str], ...]
    scratch: int


def _abi(names: list[str], compiled) -> Abi | None:
    """compiled's Abi where a plain cuLaunchKernel launches it (one CTA per cluster, not
    cooperative, no programmatic dependent launch, no tensor descriptors), else None."""
    md = compiled.metadata
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if (not isinstance(signature, dict) or getattr(md, "num_ctas", 1) != 1
            or getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False)):
        return None
    params = []
    for i, name in enumerate(names):
        ty = signature.get(name, "constexpr")
        if ty == "constexpr":
            continue
        if not isinstance(ty, str) or not (ty.startswith("*") or ty in ARG_BYTES):
            return None
        params.append((i, ty))
    scratch = hasattr(md, "global_scratch_size") + hasattr(md, "profile_scratch_size")
    return Abi(compiled.function, 32 * md.num_warps, md.shared, tuple(params), scratch)


class _Launcher:
    """A compiled kernel and how to call its C launcher from launch()'s arguments."""
    __slots__ = ("run", "function", "metadata", "order", "tail", "names", "device", "abi")

    def __init__(self, kernel, compiled, device: int, n_args: int, kwargs: dict, config: dict):
        fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
        names = fn.arg_names
        given = [*names[:n_args], *kwargs]
        # the config's meta-parameters, then the defaults of parameters nobody passed
        self.tail = tuple(config[n] if n in config else fn.params[i].default
                          for i, n in enumerate(names) if n not in given)
        given += [n for n in names if n not in given]
        # Triton's launcher takes every parameter in order, constexprs too (ignored)
        self.order = operator.itemgetter(*(given.index(n) for n in names))
        self.names, self.device = names, device
        self.function, self.metadata = compiled.function, compiled.packed_metadata
        self.run = run = compiled.run
        self.abi = None
        if (getattr(run, "global_scratch_size", None) == 0 and getattr(run, "profile_scratch_size", None) == 0
                and hasattr(run, "launch")):
            self.abi = _abi(names, compiled)
            # Triton 3.6's CudaLauncher.__call__ only adds its scratch buffers (none here) and
            # cooperative/PDL flags before the C launch: call that directly
            flags = (run.launch_cooperative_grid, run.launch_pdl, None, None)
            c_launch = run.launch

            def direct(gx, gy, gz, stream, function, *rest):
                c_launch(gx, gy, gz, stream, function, *flags, *rest)
            self.run = direct

    def __call__(self, grid, device: int, args: tuple, kwargs: dict) -> None:
        params = self.order((*args, *kwargs.values(), *self.tail))
        if not isinstance(params, tuple):  # itemgetter of one index
            params = (params,)
        if callable(grid):
            grid = grid(dict(zip(self.names, params)))
        gx, gy, gz = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
        if RECORDING is not None:
            RECORDING.launched(self, (gx, gy, gz), params)
        self.run(gx, gy, gz, torch._C._cuda_getCurrentRawStream(device), self.function, self.metadata,
                 None, None, None, *params)


def _key(kernel, device: int, args: tuple, kwargs: dict) -> tuple:
    return (kernel, device, tuple(kwargs),
            *[(a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor) else a
              for a in (*args, *kwargs.values())])


def _compiled_by_triton(kernel) -> bool:
    """A compiled kernel (not the interpreter's) and no launch hook to call (Triton 3.6 keeps
    the hooks in a HookChain, earlier versions in an optional callable)."""
    fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
    hooks = knobs.runtime.launch_enter_hook
    return isinstance(fn, JITFunction) and not (hooks is not None and getattr(hooks, "calls", True))


def launch(kernel, grid, *args, **kwargs) -> _Launcher | None:
    """Launches kernel[grid](*args, **kwargs); returns the compiled kernel's launcher where it
    went through one (for launch_as), else None."""
    if is_wrap_triton_enabled():
        torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
        return None
    if not _compiled_by_triton(kernel):
        if RECORDING is not None:
            RECORDING.compiled()
        kernel[grid](*args, **kwargs)
        return None
    device = torch.cuda.current_device()
    key = _key(kernel, device, args, kwargs)
    launcher = _LAUNCHERS.get(key)
    if launcher is not None:
        launcher(grid, device, args, kwargs)
        return launcher
    if RECORDING is not None:
        RECORDING.compiled()
    compiled = kernel[grid](*args, **kwargs)
    config = kernel.best_config.all_kwargs() if isinstance(kernel, Autotuner) else {}
    if len(_LAUNCHERS) >= MAX_LAUNCHERS:
        _LAUNCHERS.clear()
    launcher = _LAUNCHERS[key] = _Launcher(kernel, compiled, device, len(args), kwargs, config)
    return launcher


def launch_as(launcher: _Launcher | None, kernel, grid, args: tuple, kwargs: dict) -> _Launcher | None:
    """launch(kernel, grid, *args, **kwargs) for a caller that keeps, per signature of its inputs,
    the launcher that launch returned: passed back, it skips the key. The caller vouches that
    the key would be the same: every non-tensor argument and every tensor's dtype and 16-byte
    alignment follow from that signature (an op's plan, e.g. norm.NormFwd). Returns the launcher
    to keep."""
    if launcher is None or is_wrap_triton_enabled() or launcher.device != torch.cuda.current_device():
        return launch(kernel, grid, *args, **kwargs)
    launcher(grid, launcher.device, args, kwargs)
    return launcher


# Host-side grid and block arithmetic: newer Triton makes triton.cdiv and
# triton.next_power_of_2 constexpr functions, whose argument unwrapping costs microseconds
# per call.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()
