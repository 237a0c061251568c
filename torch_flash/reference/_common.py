"""Helpers shared by the plain-PyTorch references."""
import torch


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """fp32 for half inputs, fp64 stays fp64 (gradcheck)."""
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d)
    return out


def reduce_leading(t: torch.Tensor, n: int) -> torch.Tensor:
    """Sum a (..., n) tensor over all leading dims: the weight/bias gradient of a row-wise op."""
    return t.reshape(-1, n).sum(0)
