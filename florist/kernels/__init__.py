"""Fused kernels. Each module holds a torch reference (the CPU path and the test oracle) and, where
it pays, a Triton kernel beside the one wrapper that launches it."""

import os

# Triton 3.9 announces that from 3.10 on a multiply and an add are no longer fused into one FMA
# unless asked. Every kernel here was timed, and its rounding checked against its reference, with
# fusion on (the default of every Triton florist has run on), so that default is kept unless the
# environment already names one.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
