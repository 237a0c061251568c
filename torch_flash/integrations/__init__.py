"""Integrations of torch-flash with other libraries (imported on demand, never by `import torch_flash`).

- `torch_flash.integrations.transformers`: `attn_implementation="torch_flash"` in Hugging Face
  transformers models (call its `register()` first), and `use_linear_cross_entropy(model)`, a
  causal LM's training loss without its logits.
"""
