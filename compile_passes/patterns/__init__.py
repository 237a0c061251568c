"""Pattern families: each module finds the naive spellings of one op family by anchoring on
its distinctive node and walking outwards, proves the match from shapes and dtypes, and
rewrites it (or reports why not)."""
from . import attention, rms_norm

# family name -> rewrite(gm, report) functions, applied in this order
FAMILIES = {
    "attention": (attention.rewrite,),
    "norm": (rms_norm.rewrite,),
}
