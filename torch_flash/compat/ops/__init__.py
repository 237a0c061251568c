"""flash_attn.ops: drop-ins for FlashAttention's fused ops (torch_flash.compat.ops.triton)."""
