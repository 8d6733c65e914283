"""Programmatic dependent launch (PDL, Hopper and later) for florist's Triton kernels.

Inside a CUDA graph a kernel that moves a few microseconds of bytes still costs ~5 us, much of
it the gap between one kernel ending and the next one's programs starting. With PDL a kernel
may be launched while its predecessor still runs:

    kernel A:  [gdc_wait | gdc_launch_dependents | ...... work ......]
    kernel B:            launched here ──▶ [gdc_wait ········ | work ...]
                                                  waits until A has finished and its writes are visible

Every florist kernel launched this way starts with `pdl_prologue`: wait for the predecessor
(so it never reads an input before it is written, nor writes a buffer the predecessor may still
read: the caching allocator may hand it memory the predecessor's inputs occupied), then allow
its own successor to launch. A predecessor that is not PDL-aware (cuBLAS, FlashAttention)
simply completes first, as without PDL.

`launch_args(tensor)` gives the kernel arguments: {"PDL": True, "launch_pdl": True} on a
capable device (compute capability >= 9.0, Triton with grid dependency control), else
{"PDL": False}. FLORIST_PDL=0 turns it off (for side-by-side measurements).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no kernels to launch
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: kernels launch as usual
    gdc_wait = gdc_launch_dependents = None

ENABLED = os.environ.get("FLORIST_PDL", "1") != "0"
_OFF = {"PDL": False}
_ON = {"PDL": True, "launch_pdl": True}

_jit = triton.jit if triton is not None else (lambda fn: fn)


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def launch_args(t: torch.Tensor) -> dict:
    if ENABLED and gdc_wait is not None and t.is_cuda and _device_supports(t.device.index if t.device.index is not None else torch.cuda.current_device()):
        return _ON
    return _OFF


@_jit
def pdl_prologue(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
