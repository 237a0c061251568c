"""launch(kernel, grid, *args, **kwargs): every Triton launch of the ops goes through here.

Traced (torch.compile, export: wrap_triton's hook on) it is wrap_triton(kernel)[grid](...), so
that the compiler sees the kernel and tunes it itself. Eager, an autotuned kernel launches its
chosen config through its bare JITFunction: Triton's Autotuner.run re-derives the tuning key
on every call (a dict of all arguments, each checked against a list of names), which cost 18 us
of host time per launch on the H100 machine (44 us against 26 for the bare launch,
scripts/host_overhead.py), more than the kernels take at small shapes. The first launch for a
key goes through the autotuner, which benchmarks the configs or takes a single one; later ones
replay its choice. Every config computes the same result, so the key only has to be as fine
as the autotuner's: its key arguments and the dtypes of the tensor arguments.
"""
from __future__ import annotations

import torch
from torch._library.triton import is_wrap_triton_enabled
from triton.runtime.autotuner import Autotuner

# (kernel, key values..., tensor dtypes...) -> the chosen config's launch kwargs
_CHOSEN: dict[tuple, dict] = {}
# kernel -> [(position, name)] of its autotuning key arguments
_KEY_SLOTS: dict[Autotuner, list[tuple[int, str]]] = {}


def _key_slots(kernel: Autotuner) -> list[tuple[int, str]]:
    slots = _KEY_SLOTS.get(kernel)
    if slots is None:
        slots = _KEY_SLOTS[kernel] = [(kernel.arg_names.index(k), k) for k in kernel.keys]
    return slots


def launch(kernel, grid, *args, **kwargs) -> None:
    if is_wrap_triton_enabled():
        torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
        return
    if not isinstance(kernel, Autotuner):
        kernel[grid](*args, **kwargs)
        return
    n = len(args)
    key = (kernel, *(args[i] if i < n else kwargs.get(name) for i, name in _key_slots(kernel)),
           *(a.dtype for a in args if isinstance(a, torch.Tensor)),
           *(a.dtype for a in kwargs.values() if isinstance(a, torch.Tensor)))
    config = _CHOSEN.get(key)
    if config is None:
        kernel[grid](*args, **kwargs)
        _CHOSEN[key] = kernel.best_config.all_kwargs()
        return
    kernel.fn[grid](*args, **kwargs, **config)


# Host-side grid and block arithmetic: newer Triton makes triton.cdiv and
# triton.next_power_of_2 constexpr functions, whose argument unwrapping costs microseconds
# per call.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()
