"""Code shared by the tests, the demo and the benchmarks: a LLaMA-style model written the way
model code spells it (`llama`). Not part of the public API."""
