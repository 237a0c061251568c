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
from ._registry import OPS  # noqa: E402
from .ops.rms_norm import add_rms_norm, rms_norm  # noqa: E402

__version__ = "0.1.0"
__all__ = ["OPS", "rms_norm", "add_rms_norm"]
