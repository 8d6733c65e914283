"""Splitting a request's sequences into chunks for the engine replicas (pure; no I/O).

    lens   5 9 3 | 7 7 | 2 8 4 1      one request, 9 sequences
    chunks [0,3)   [3,5)  [5,9)       contiguous, in order: results are concatenated back

A chunk holds at most `max_seqs` sequences and `max_tokens` tokens (one over-long sequence is a
chunk of its own). Within those bounds a request is cut into `min_parts` chunks of about equal
token counts, so a large request keeps every healthy replica busy; a small one stays whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def split(lens: Sequence[int], *, max_seqs: int, max_tokens: int, min_parts: int = 1) -> list[tuple[int, int]]:
    """-> [(start, stop)] covering range(len(lens)) in order, each non-empty."""
    n, total = len(lens), sum(lens)
    if n == 0:
        return []
    parts = min(n, max(min_parts, math.ceil(total / max_tokens), math.ceil(n / max_seqs)))
    target = total / parts
    bounds: list[tuple[int, int]] = []
    start = done = in_chunk = 0
    for i, length in enumerate(lens):
        cuts = len(bounds) + 1
        full = in_chunk + length > max_tokens or i - start >= max_seqs
        # Cut where the cumulative token count crosses the next multiple of `target` (at the
        # sequence's midpoint), or when each remaining sequence must start a chunk of its own.
        due = done + length / 2 > target * cuts or n - i <= parts - cuts
        if i > start and (full or due):
            bounds.append((start, i))
            start, in_chunk = i, 0
        done += length
        in_chunk += length
    bounds.append((start, n))
    return bounds


def parts_for(total_tokens: int, healthy_replicas: int, min_chunk_tokens: int) -> int:
    """How many chunks a request should at least become: one per healthy replica, but never
    chunks smaller than `min_chunk_tokens` (below that a device is not busier for the split,
    and each chunk costs an RPC)."""
    return max(1, min(healthy_replicas, total_tokens // max(1, min_chunk_tokens)))
