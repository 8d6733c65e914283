"""Zeroed int32 counters for kernels whose programs count themselves in and let the last one
finish the work (decode attention's merge, the product + add + RMSNorm's norm).

Such a kernel atomically increments counter[i] once per program of group i; the program that
sees the final count does the group's finishing work and stores 0 back, so every launch leaves
the counters as it found them. One buffer per device serves every launch and CUDA graph of a
kernel: launches on one stream never overlap.
"""

from __future__ import annotations

import torch


class LaunchCounters:
    def __init__(self, kernel: str, minimum: int = 1024):
        self.kernel, self.minimum = kernel, minimum
        self.by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        """At least n zeroed counters on `device` (grown, never shrunk)."""
        have = self.by_device.get(device)
        if have is None or have.numel() < n:
            # NOTE: allocated on first use, which is an eager step: the engine's graphs are
            # captured on a bucket's second sight (engine/graph_runner.py,
            # engine/generation/decode_graphs.py), and capture must not allocate state it keeps.
            assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), (
                f"{self.kernel}'s counters must exist before graph capture: run the step eagerly once first"
            )
            have = torch.zeros(max(n, self.minimum), dtype=torch.int32, device=device)
            self.by_device[device] = have
        return have
