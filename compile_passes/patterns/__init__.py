"""Pattern families: each module finds the naive spellings of one op family by anchoring on
its distinctive node and walking outwards, proves the match from shapes and dtypes, and
rewrites it (or reports why not)."""
from . import attention, cross_entropy, layer_norm, rms_norm, rotary

# family name -> rewrite(gm, report) functions, applied in this order: rotary before attention,
# whose q and k it may turn from autocast's fp32 into the half dtype of v (see _shared.retype)
FAMILIES = {
    "rotary": (rotary.rewrite,),
    "attention": (attention.rewrite,),
    "norm": (layer_norm.rewrite, rms_norm.rewrite),
    "loss": (cross_entropy.rewrite,),
}
