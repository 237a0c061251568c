"""Scalar helpers shared by the Triton kernels."""
import triton
import triton.language as tl


@triton.jit
def fp32(x):
    """x as an fp32 scalar. Triton's launcher types a Python float argument fp32, but Inductor,
    when it inlines a torch.library.triton_op into a compiled graph (torch 2.11), passes it as
    fp64 (pytorch/pytorch#190340): the arithmetic it enters would run in fp64 and tl.dot would
    reject its fp64 accumulator. Kernels convert their float arguments once, on entry."""
    return tl.full([], x, tl.float32)
