"""Fused kernels. Each module holds a torch reference (the CPU path and the test oracle) and, where
it pays, a Triton kernel beside the one wrapper that launches it."""
