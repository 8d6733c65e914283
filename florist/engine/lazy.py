"""LazyTensor: a result that is still being computed on the device.

    step()  ──launch forward──▶ [device output] ──async copy──▶ [pinned host buffer] ──▶ event
                                                                         ▲
                                                 ready() polls the event │ wait()/numpy() blocks

The caller decides when to wait; nothing here synchronises the whole device.
"""

from __future__ import annotations

import numpy as np
import torch


class LazyTensor:
    def __init__(self, host: torch.Tensor, event: "torch.cuda.Event | None" = None, rows: int | None = None):
        self._host, self._event = host, event
        self._rows = host.shape[0] if rows is None else rows

    @classmethod
    def from_device(cls, out: torch.Tensor, rows: int | None = None) -> "LazyTensor":
        """Queue the device-to-host copy of `out` on the current stream and record an event."""
        if out.device.type != "cuda":
            return cls(out, None, rows)
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, event, rows)

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host[: self._rows]

    def numpy(self) -> np.ndarray:
        return self.wait().numpy()
