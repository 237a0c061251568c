"""flash_attn.losses: drop-ins for FlashAttention's losses (cross_entropy)."""
