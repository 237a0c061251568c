"""Plain-PyTorch references, one module per op stem: the ground truth of the tests, the
CPU path of the ops, and the formulas the compile-pass patterns look for."""
