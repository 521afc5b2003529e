"""Kernels for the V4 hot paths: each op has a plain-torch reference and, where it pays, a Triton
kernel checked against it. The model reaches them only through `rackserve.kernels.dispatch`."""
