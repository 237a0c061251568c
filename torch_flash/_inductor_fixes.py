"""A fix to Inductor that AOTInductor packages of the flash ops need on the torch versions
this project supports (2.11 on the GPU image, 2.13 here).

AOTInductor's C++ wrapper names each size/stride array it passes (`int_array_N`) and caches
the name per destination buffer, keyed on `id()` of the buffer's `writeline` (torch 2.11) or
of the buffer itself (2.13). A view argument of a user-defined Triton kernel (which is what a
`triton_op` becomes in a compiled graph) writes through a short-lived buffer; CPython reuses
its address, so a later lookup for another buffer hits that entry and gets a name whose
declaration it cannot see, and the package fails to build with "'int_array_6' was not
declared in this scope". Upstream fixes that by not caching for such buffers
(pytorch/pytorch#193621, #193628; not in 2.14.1 either, checked). Here every request declares
its own array, as those fixes do for the transient buffers: one more line of generated C++ per
request, never a missing declaration.

Applied when a compiler first traces a flash op into its kernels (ops/_autograd.py), not at
import: a plain `import torch_flash` leaves Inductor as it is.
"""
import functools

import torch
from torch.torch_version import TorchVersion


def _declare_each(self, int_array, writeline, known_statically=False, graph=None):
    return self._codegen_int_array_var_impl(int_array, writeline, known_statically)


@functools.cache
def apply() -> None:
    """Install the fix on the torch releases known to need it (once)."""
    if TorchVersion(torch.__version__) >= (2, 15):
        return
    try:
        from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    except ImportError:  # a torch without Inductor's C++ wrapper: nothing to fix
        return
    if hasattr(CppWrapperCpu, "_codegen_int_array_var_impl"):
        CppWrapperCpu.codegen_int_array_var = _declare_each
