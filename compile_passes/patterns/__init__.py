"""Pattern families: each module finds the naive spellings of one op family by anchoring on
its distinctive node and walking outwards, proves the match from shapes and dtypes, and
rewrites it (or reports why not)."""
from . import attention, cross_entropy, layer_norm, rms_norm, rotary

# family name -> rewrite(gm, report) functions, applied in this order
FAMILIES = {
    "attention": (attention.rewrite,),
    "norm": (layer_norm.rewrite, rms_norm.rewrite),
    "loss": (cross_entropy.rewrite,),
    "rotary": (rotary.rewrite,),
}
