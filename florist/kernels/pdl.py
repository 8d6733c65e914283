"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels of a prefill layer
(the norms, QK-norm + rotary, the short attention, SwiGLU, the skinny product; BERT's embeddings
+ LayerNorm, the exact GELU and mean pooling).

Inside a CUDA graph a kernel that moves a few microseconds of bytes still costs ~4-5 us; part of
it is the gap between one kernel's last programs exiting and the next kernel's first programs
starting. A kernel launched with PDL may be launched while its predecessor's last programs are
still finishing; it waits (`griddepcontrol.wait`, first thing in the kernel) until the predecessor
has completed and its writes are visible, so it never reads an input early nor writes memory the
predecessor may still read (the caching allocator may hand it such memory):

    kernel A:  [.............. work ..............]                      (programs exit)
    kernel B:                         launched ──▶ [wait ······| work ...]

Measured on the H200 (docs/benchmarks.md, "Programmatic dependent launch"): the Qwen3-0.6B
batch-1 step at 128 / 512 tokens takes ~5 % / ~2 % less device time (10-17 % less round trip on
another machine). Letting the successor launch earlier still (`griddepcontrol.launch_dependents`
right after the wait), with or without products asking L2 for their weight before they wait, was
slower or no better, and was dropped.

FLORIST_PDL picks the mode: `wait` (the default) as above; `off` launches every kernel as before
(for side-by-side measurements); `late` and `late-loops` also let the successor launch before the
kernel ends (`pdl_trigger`): a kernel with a main loop (the products, the short attention, mean
pooling) after its loop, and under `late` a one-pass kernel (the norms, rotary, the activations)
right after its wait. Neither is the default: against `wait` on one H200 (docs/benchmarks.md,
"The successor let in before the loop's epilogue") `late-loops` took 0.010-0.017 ms off the
Qwen3 1 x 128 step and nothing at 512, `late` 0.021 ms off at 512 and added 0.007 ms at 128, both
far below the 0.05-0.09 ms they were built to buy. Picking one of them by the launch's rows was
tried and dropped: on an H100 the gains and losses alternated from one graph bucket to the next
(docs/benchmarks.md, "Each mode by the launch's rows"), and so was letting in only the products
after an RMSNorm, to ask L2 for their weight while it runs ("Products let in after their norm,
asking L2 for their weight": slower, the early launch alone too). The PDL modes apply on devices
of compute capability >= 9.0 with a Triton that has grid dependency control. Only the edges into
these kernels change: a kernel launched without PDL (a cuBLAS or cuDNN product, a copy) still starts
after its predecessor has completed, as before, and must: the cuBLAS kernels of the Qwen3 step's
products hold no `griddepcontrol.wait` (docs/benchmarks.md, "What PDL does not reach").

`launch_args(tensor)` gives a kernel's keyword arguments: {"PDL": True, "launch_pdl": True} for a
CUDA tensor where PDL applies (PDL 2 under `late`, 3 under `late-loops`), else {"PDL": False};
each kernel starts with `pdl.pdl_wait(PDL)` and calls `pdl.pdl_trigger(PDL)` where its successor
may launch.
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
    gdc_launch_dependents = gdc_wait = None

MODES = ("off", "wait", "late", "late-loops")


def _mode_from_env() -> str:
    name = os.environ.get("FLORIST_PDL", "wait").strip().lower()
    if name not in MODES:
        raise ValueError(f"FLORIST_PDL={name!r}: expected one of {', '.join(MODES)}")
    return name


MODE = _mode_from_env()

_jit = triton.jit if triton is not None else (lambda fn: fn)


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


_ON = {"PDL": True, "launch_pdl": True}
# PDL = 2 / 3: the kernel also lets its successor launch early (`pdl_trigger`)
_LATE_BY_MODE = {"late": {"PDL": 2, "launch_pdl": True}, "late-loops": {"PDL": 3, "launch_pdl": True}}
_OFF = {"PDL": False}


def launch_args(t: torch.Tensor) -> dict:
    """The launch's keyword arguments (shared dicts: spread them, never change them)."""
    if MODE != "off" and gdc_wait is not None and t.is_cuda and _device_supports(t.device.index if t.device.index is not None else torch.cuda.current_device()):
        return _LATE_BY_MODE.get(MODE, _ON)
    return _OFF


@_jit
def pdl_wait(PDL: tl.constexpr):
    """Under PDL: wait until the predecessor has completed and its writes are visible."""
    if PDL:
        gdc_wait()


@_jit
def pdl_trigger(PDL: tl.constexpr, ONE_PASS: tl.constexpr = False):
    """The successor may launch once every program of this kernel has passed this point or exited;
    its programs then sit in their `pdl_wait` until this kernel has completed. A kernel with a main
    loop (a product's K loop, attention's keys) calls it after the loop, a one-pass kernel (a norm,
    rotary, an activation) with ONE_PASS right after its wait. Under FLORIST_PDL=late both do,
    under late-loops only the former; elsewhere it is a no-op, and the successor launches as this
    kernel's programs exit."""
    if PDL == 2 or (PDL == 3 and not ONE_PASS):
        gdc_launch_dependents()
