"""torch-flash: FlashAttention-class fused kernels as `torch.library` ops in the `flash`
namespace, and a compile pass that puts them into unmodified models.

`import torch_flash` registers every op (torch.ops.flash.*), its fake and autograd rule.
"""
from . import ops  # registers the ops
from . import meta_kernels  # registers their fakes
from ._dispatch import use_backend
from ._registry import OPS
from .compile_passes.backend import COUNTERS as counters
from .compile_passes.backend import backend, disable, enable, explain, rewrite
from . import compat, data, nn
from .ops.attention import attention, attention_with_lse
from .ops.attention_decode import attention_decode
from .ops.attention_varlen import attention_varlen
from .ops.cross_entropy import cross_entropy, synchronize
from .ops.layer_norm import add_layer_norm, layer_norm
from .ops.linear_cross_entropy import linear_cross_entropy
from .ops.rms_norm import add_rms_norm, rms_norm
from .ops.rotary import rotary, rotary_cos_sin, rotary_qk

__version__ = "0.1.0"
__all__ = [
    "OPS", "use_backend", "backend", "enable", "disable", "rewrite", "explain", "counters",
    "attention", "attention_with_lse", "attention_varlen", "attention_decode", "context_parallel_attention", "rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm",
    "cross_entropy", "linear_cross_entropy", "synchronize", "rotary", "rotary_cos_sin", "rotary_qk", "compat", "data", "nn",
]



def __getattr__(name: str):
    # imported on first use: the ring's eager-only wrapper imports Dynamo (about 1 s)
    if name == "context_parallel_attention":
        from .context_parallel import context_parallel_attention
        return context_parallel_attention
    raise AttributeError(f"module 'torch_flash' has no attribute {name!r}")


# last: its CUDA kernels register for the op schemas defined above
from . import _extension  # noqa: E402

_extension.load()
