"""Attention spellings -> flash.attention.

Anchors: softmax over the last dim (math SDPA's `_safe_softmax` included, and core ATen's
decomposition `exp(s - amax(s)) / sum(exp(s - amax(s)))`), and `aten.scaled_dot_product_attention`
or its math kernel `aten._scaled_dot_product_attention_math` (is_causal, attn_mask, scale,
dropout_p and enable_gqa map onto the op's arguments).

From a softmax the walk goes up a chain of elementwise steps to the q-k product:
dtype casts; the scale (`* c`, `/ c`, baddbmm's alpha, or folded into q or k before the
product, as math SDPA's sqrt(scale) into q and k^T; c a constant, or a one-value tensor
read at run time, which goes into q as q * c);
a tanh softcap `c * tanh(s / c)`; additive terms (`+ bias`, `- bias`, baddbmm's
input); masks (`masked_fill(m, v)`, `where(m, s, v)` with v = -inf or a large negative value
such as finfo.min). The product is `q @ k^T`, bmm/baddbmm on merged (B*H, S, D) tensors
(run as B*H heads of one batch, or as (B, H) where the scores or the probabilities are
viewed so: MBart's mask added in a 4-D view, Bloom's ALiBi as baddbmm's input), or an
einsum in any layout; k and v may be repeated for GQA (repeat_kv's expand + reshape,
repeat_interleave over heads, or an expand of one head). Core ATen's matmul (bmm of (B*H, S, D)
views of expanded 4-D tensors) reads as the 4-D tensors themselves.
Down from the softmax: a cast back, copies, dropout, and the product with v.

Masks built inside the graph are read by an index algebra (index.py): a tensor made from
arange, ones/full, triu/tril, comparisons, where/masked_fill and logical ops is a predicate
over the query and key indices. One that provably keeps a band around the bottom-right
diagonal (j - i within fixed offsets of Sk - Sq) becomes `causal` / window arguments and no
tensor. Sums of terms and and-ed keep conditions are split first, so HF's causal & padding
mask becomes causal=True plus the padding piece. A term that is per-head slopes times an
index-only position bias becomes `alibi_slopes` where it provably is the op's ALiBi up to a
constant per query row (alibi.py). Everything else -- masks that arrive as inputs, T5 biases,
ALiBi with positions read from data, a chunked or top-left causal pattern -- becomes
`attn_bias`, which keeps the model's semantics.

Exactness. A rewrite computes what the model computes, to the op's tolerance, on every query
row that sees at least one key: a score hidden with -inf or a value <= -1e4 (finfo.min in
HF models) weighs exp(-1e4 + s) = 0 in fp32 next to any visible score above -9900, so both
fills hide alike. A row that -inf masks hide entirely gives 0 (as SDPA and FlashAttention
do) where the model gives NaN. A finite fill makes the model average v over the keys it
fills on such a row (HF eager, left-padded query rows): where a mask that is not a band
(padding) may hide a whole row, nothing is split and the model's own terms go in as
attn_bias, which flash.attention reads alike (masks.py). A finite fill that overwrites the
scores there (masked_fill(pad, finfo.min)) also cuts the rows' gradient to q and k: where such
masks, of one fill, are all the scores have, the rows they hide entirely are set to v's mean
beside the op (rewrite.py); else attn_bias is the model's scores less q @ k^T, term by term
in its order (overwrites set their fill), and q is set to 0 on the rows where every key the
softmax weighs is overwritten, whose scores then are that bias alone, as in the model (an
ALiBi bias given as an input, DeBERTa's relative bias, then masked_fill(pad, finfo.min)).
PyTorch's fused SDPA kernels (graphs traced below SDPA) are sites left as they are.
Dropout draws its own mask (flash.attention's Philox stream), so training with dropout
matches the model in distribution, not bit for bit.

Modules, each one step: nodes (reading graph values), formulas (keep formulas), index (the
index algebra), windows (band proofs), alibi (ALiBi proofs), operands (the Match and its q, k,
v), match (the walk from a softmax), masks (masks -> window, alibi_slopes or attn_bias), sdpa
(SDPA calls), rewrite (the replacement, and rewrite(), the family's entry point).
"""
from .rewrite import rewrite

__all__ = ["rewrite"]
