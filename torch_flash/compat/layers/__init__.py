"""flash_attn.layers: drop-ins for FlashAttention's layers (rotary)."""
