"""torch-flash: FlashAttention-class fused kernels as `torch.library` ops in the `flash`
namespace, and a compile pass that puts them into unmodified models.

`import torch_flash` registers every op (torch.ops.flash.*), its fake and autograd rule.
"""
import os as _os

# A source checkout keeps meta_kernels/ and compile_passes/ beside torch_flash/ (DESIGN.md
# "Layout"); installs map them inside the package. Let a checkout on sys.path (python -m
# torch_flash from the repo root) resolve torch_flash.meta_kernels the same way.
_root = _os.path.dirname(__path__[0])
if (_os.path.isfile(_os.path.join(_root, "meta_kernels", "__init__.py"))
        and not _os.path.isdir(_os.path.join(__path__[0], "meta_kernels"))):
    __path__.append(_root)

from . import ops  # noqa: E402  (registers the ops)
from . import meta_kernels  # noqa: E402  (registers their fakes)
from . import _inductor_fixes  # noqa: E402
from ._dispatch import use_backend  # noqa: E402
from ._registry import OPS  # noqa: E402
from .compile_passes.backend import COUNTERS as counters  # noqa: E402
from .compile_passes.backend import backend, disable, enable, explain, rewrite  # noqa: E402
from . import compat, data, nn  # noqa: E402
from .ops.attention import attention, attention_with_lse  # noqa: E402
from .ops.attention_decode import attention_decode  # noqa: E402
from .ops.attention_varlen import attention_varlen  # noqa: E402
from .ops.cross_entropy import cross_entropy  # noqa: E402
from .ops.layer_norm import add_layer_norm, layer_norm  # noqa: E402
from .ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from .ops.rms_norm import add_rms_norm, rms_norm  # noqa: E402
from .ops.rotary import rotary, rotary_cos_sin, rotary_qk  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "OPS", "use_backend", "backend", "enable", "disable", "rewrite", "explain", "counters",
    "attention", "attention_with_lse", "attention_varlen", "attention_decode", "rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm",
    "cross_entropy", "linear_cross_entropy", "rotary", "rotary_cos_sin", "rotary_qk", "compat", "data", "nn",
]

_inductor_fixes.apply()  # AOTInductor packages of the flash ops build on torch 2.11-2.14

# last: its CUDA kernels register for the op schemas defined above
from . import _extension  # noqa: E402

_extension.load()
