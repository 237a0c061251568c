"""flash_attn.ops.triton: drop-ins for FlashAttention's Triton ops (layer_norm)."""
