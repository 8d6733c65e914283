"""Pull weights into the GPU's L2 cache ahead of the product that reads them.

At a few rows a matrix product reads its weight once and does almost no arithmetic, so its time
is how fast the weight streams in. From HBM that stream is latency-bound for weights of a few MB
(`bench/gemm.py`: ~5 us for Qwen3's 8 MB qkv weight, whose bandwidth floor is 2 us); from L2 it
is shorter. `prefetch_l2(tensors)` launches one small kernel whose threads each issue a Hopper
bulk prefetch (`cp.async.bulk.prefetch.L2.global`, no registers or shared memory held, nothing
written) for a 4 KB slice of the tensors' storage, so the kernel is done as soon as the requests
are issued and the data lands in L2 while other kernels run.

It is only a hint: it changes no value, so it may run on a side stream with no join until the
end of the work. Where it does nothing (no CUDA, no triton, a GPU before sm_90) it is a no-op.

    side.wait_event(before_product_j)            # not earlier: L2 holds ~50 MB
    with torch.cuda.stream(side):
        prefetch_l2([weight_of_product_j_plus_1])
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: prefetching is a no-op
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)

CHUNK_BYTES = 4096  # one thread's bulk prefetch
SLICES_PER_PROGRAM = 128  # one per thread of a 4-warp program: 512 KB a program
MAX_BYTES = 1 << 30  # more than L2 holds many times over (and byte offsets stay int32)


def available(device: torch.device) -> bool:
    """True where prefetch_l2 issues real prefetches (CUDA, triton, sm_90 or newer)."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def prefetch_l2(tensors: list[torch.Tensor]) -> None:
    """Ask L2 to fetch the storage of each tensor (a hint: no value changes; a no-op where
    `available` is False). Each tensor's storage must start 16-byte aligned, which torch's
    allocations do."""
    for t in tensors:
        if not available(t.device):
            return
        nbytes = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
        nbytes -= nbytes % 16  # the bulk prefetch takes multiples of 16 bytes
        if nbytes <= 0 or t.data_ptr() % 16:
            continue
        nbytes = min(nbytes, MAX_BYTES)
        grid = (triton.cdiv(nbytes, CHUNK_BYTES * SLICES_PER_PROGRAM),)
        _prefetch_l2_kernel[grid](t, nbytes, CHUNK=CHUNK_BYTES, SLICES=SLICES_PER_PROGRAM, num_warps=4)


@_jit
def _prefetch_l2_kernel(ptr, nbytes, CHUNK: tl.constexpr, SLICES: tl.constexpr):
    base = ptr.to(tl.pointer_type(tl.uint8))
    start = tl.program_id(0).to(tl.int64) * (CHUNK * SLICES) + tl.arange(0, SLICES).to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - start, 0), CHUNK).to(tl.int32)
    # One bulk prefetch per thread; a slice past the end has size 0 and issues nothing.
    # NOTE: not pure, so it is kept although its (always 0) result is never used.
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + start, size], dtype=tl.int32, is_pure=False, pack=1,
    )
