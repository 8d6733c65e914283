"""Host <-> device traffic of steps through pinned buffers reused every step (generation and the
embedding engine's CUDA graphs).

    step inputs  packed int32 (numpy) ──memcpy──▶ pinned buffer ──async copy──▶ device buffer
    next ids     device int64 [rows] ──async copy──▶ pinned ring buffer ──event──▶ host list

No step allocates pinned memory (`pin_memory()` per step costs more than a batch-1 decode step's
host work). Reuse is guarded by CUDA events, so a pinned buffer is rewritten only after the copy
that read it (inputs), or after the host read it (next ids):

    InputStaging    a ring of buffers (one for generation); before refilling one, wait for the
                    event recorded after the last copy out of it (for generation that copy
                    preceded the step whose ids the host has since read; for embedding batches it
                    is `ring` batches old), so the wait returns at once
    TokenReadback   a ring of two: pipelined decode has at most two steps unread, the one being
                    read and the one launched just before reading it (generator.py); a buffer is
                    reused two reads later

On the CPU there is nothing to copy and nothing to wait for: packed inputs are used in place and
next ids are read as they are, so the same calls run the same logic synchronously.

The copies and the events after them are queued by the CUDA driver directly (`_Driver`,
`cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` / `cuEventRecord` through ctypes) on the current stream,
not by `Tensor.copy_` and `Event.record`: on the H200 host those took 11.8 us per input copy
(3.5 for the copy, 5.4 for the event record, most of it finding the current stream), the driver
calls 3.9 us, and a batch-1 step's round trip went 8-17 us down (docs/benchmarks.md, "The
replay's host path"). Both buffers live as long as the staging object, and the ring's events
already guard their reuse, so nothing is lost by bypassing torch's pinned-memory allocator,
whose own events only guard blocks it hands out again. Where the driver library cannot be loaded
(or FLORIST_RAW_COPIES=0) torch's calls run, with the same effect.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from florist.config import int_from_env

RAW_COPIES = int_from_env("FLORIST_RAW_COPIES", 1) != 0


class _Driver:
    """The three CUDA driver calls the staging copies make, through ctypes (~1 us each)."""

    def __init__(self, lib: ctypes.CDLL):
        u64, ptr, size = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
        self.htod = lib.cuMemcpyHtoDAsync_v2
        self.htod.argtypes, self.htod.restype = [u64, ptr, size, ptr], ctypes.c_int
        self.dtoh = lib.cuMemcpyDtoHAsync_v2
        self.dtoh.argtypes, self.dtoh.restype = [ptr, u64, size, ptr], ctypes.c_int
        self.record = lib.cuEventRecord
        self.record.argtypes, self.record.restype = [ptr, ptr], ctypes.c_int
        self.stream = torch._C._cuda_getCurrentRawStream


@functools.lru_cache(maxsize=1)
def _driver() -> _Driver | None:
    """The driver calls, or None (torch's calls then): switched off, a ROCm build, or no
    libcuda / no raw-stream accessor in this torch."""
    if not RAW_COPIES or torch.version.hip is not None or not hasattr(torch._C, "_cuda_getCurrentRawStream"):
        return None
    try:
        return _Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


def _raw_copy(driver: _Driver, copy, dst: int, src: int, nbytes: int, event: torch.cuda.Event, device: torch.device) -> bool:
    """One driver copy (`copy`: driver.htod or driver.dtoh), then `event`, on the current stream of
    `device`; False if the driver turned the copy down (e.g. no CUDA context made current on this
    thread yet: a thread whose first CUDA call this is), and nothing was queued. Torch creates an
    event on its first record, so that record goes through torch."""
    stream = driver.stream(device.index)
    if copy(dst, src, nbytes, stream) != 0:
        return False
    handle = event.cuda_event
    if not handle or driver.record(handle, stream) != 0:
        event.record()
    return True


def copy_to_device(dst: torch.Tensor, src: torch.Tensor, event: torch.cuda.Event) -> None:
    """dst <- src (pinned host, same bytes), then `event`, queued on the current stream. The
    caller keeps src alive and unchanged until the event has passed."""
    assert dst.dtype == src.dtype and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous()
    driver = _driver()
    if driver is None or not _raw_copy(driver, driver.htod, dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), event, dst.device):
        dst.copy_(src, non_blocking=True)  # torch's calls, which also report any error
        event.record()


def copy_to_host(dst: torch.Tensor, src: torch.Tensor, event: torch.cuda.Event) -> None:
    """dst (pinned host) <- src (device, same bytes), then `event`, queued on the current
    stream. The caller keeps dst alive until the event has passed."""
    assert dst.dtype == src.dtype and dst.shape == src.shape and dst.is_contiguous()
    driver = _driver()
    if (driver is None or not src.is_contiguous()
            or not _raw_copy(driver, driver.dtoh, dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), event, src.device)):
        dst.copy_(src, non_blocking=True)
        event.record()


class InputStaging:
    """Packed int32 step inputs -> the device, through a ring of reused pinned buffers.

    `ring` bounds how many copies may be in flight at once without a host wait: generation
    reads every step before packing the next (ring 1 suffices); the embedding engine keeps two
    batches in flight, and its callers may launch a third before reading the first (ring 4)."""

    def __init__(self, device: torch.device, ring: int = 1):
        self.device, self.ring = device, ring
        self._pinned: list[torch.Tensor | None] = [None] * ring
        self._pinned_np: list[np.ndarray | None] = [None] * ring
        # recorded after the last copy out of each buffer
        self._copied: list[torch.cuda.Event | None] = [None] * ring
        self._slot = 0
        self._filled = 0

    def buffer(self, n: int) -> np.ndarray:
        """A host buffer of n int32 to fill, then pass to `send(n)`; on CUDA it is the next
        pinned buffer of the ring, once the copy that last read it is done."""
        if self.device.type != "cuda":
            self._cpu = np.empty(n, dtype=np.int32)
            return self._cpu
        i = self._slot = (self._slot + 1) % self.ring
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # NOTE: host wait; returns at once (see the class docstring)
        if self._pinned[i] is None or self._pinned[i].numel() < n:
            size = max(n, 2 * (0 if self._pinned[i] is None else self._pinned[i].numel()))
            self._pinned[i] = torch.empty(size, dtype=torch.int32, pin_memory=True)
            self._pinned_np[i] = self._pinned[i].numpy()
            self._copied[i] = torch.cuda.Event()
        self._filled = n
        return self._pinned_np[i][:n]

    def send(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The buffer just filled, on the device (into `out` when given, e.g. a CUDA graph's
        static input); the copy is queued on the current stream, not waited on."""
        n = self._filled
        if self.device.type != "cuda":
            src = torch.from_numpy(self._cpu)
            return src if out is None else out.copy_(src)
        i = self._slot
        if out is None:
            out = torch.empty(n, dtype=torch.int32, device=self.device)
        copy_to_device(out, self._pinned[i][:n], self._copied[i])
        return out

    def to_device(self, packed: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """`packed` on the device (into `out` when given); queued, not waited on."""
        self.buffer(packed.size)[:] = packed
        return self.send(out)


class PendingTokens:
    """Next ids of a launched step: `tolist()` waits for that step only (its event), not for
    the steps launched after it."""

    __slots__ = ("_host", "_event")

    def __init__(self, host: torch.Tensor, event: "torch.cuda.Event | None"):
        self._host, self._event = host, event

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


class TokenReadback:
    """Device next ids -> host, queued right after the step that writes them (see the module
    docstring for why a ring of two suffices)."""

    RING = 2

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * self.RING
        self._events = [torch.cuda.Event() for _ in range(self.RING)] if device.type == "cuda" else []
        self._next = 0

    def start(self, ids: torch.Tensor, num_seqs: int) -> PendingTokens:
        if ids.device.type != "cuda":
            return PendingTokens(ids[:num_seqs], None)
        i, self._next = self._next, (self._next + 1) % self.RING
        buf = self._buffers[i]
        if buf is None or buf.numel() < num_seqs or buf.dtype != ids.dtype:
            buf = self._buffers[i] = torch.empty(max(num_seqs, 8), dtype=ids.dtype, pin_memory=True)
        host = buf[:num_seqs]
        copy_to_host(host, ids[:num_seqs], self._events[i])
        return PendingTokens(host, self._events[i])
