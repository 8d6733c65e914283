"""Triton kernel compilations in this process, counted, so that a slow step can say whether
kernels compiled during it: florist/engine/graph_runner.py reads the counts around each first
sight of a batch shape and logs them.

Triton calls its compilation listener (`triton.knobs.compilation.listener`) for every kernel it
compiles and every kernel it loads from its disk cache instead, once per kernel and
specialisation per process. `watch()` chains a counter in front of any listener already set.
With a Triton that has no listener, nothing is counted and `watch()` returns False.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_counts = {"compiled": 0, "loaded": 0}
_watching = False


def _counter(previous):
    # NOTE: it runs inside Triton's compile(): whatever Triton passes, it must not raise.
    def listen(**kwargs) -> None:
        with _lock:
            _counts["loaded" if kwargs.get("cache_hit") else "compiled"] += 1
        if previous is not None:
            previous(**kwargs)

    return listen


def watch() -> bool:
    """Start counting (once per process); True when this Triton reports its compilations."""
    global _watching
    with _lock:
        if _watching:
            return True
        try:
            from triton import knobs

            knobs.compilation.listener = _counter(knobs.compilation.listener)
        except (ImportError, AttributeError):
            return False
        _watching = True
        return True


def counts() -> tuple[int, int]:
    """(kernels compiled, kernels loaded from Triton's disk cache) in this process since watch()."""
    with _lock:
        return _counts["compiled"], _counts["loaded"]
