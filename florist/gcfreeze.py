"""Keep the cyclic garbage collector's full passes off a long-running server's request path.

A process that has loaded a model (torch, transformers, grpc, the engine's modules) tracks some
200,000 container objects; a full (generation 2) collection walks all of them, ~100 ms on the
CPU machine, and it fires every so often while requests allocate. The H200 end-to-end run saw
one such 118 ms request among 200 (docs/benchmarks.md). Objects alive once start-up is done live
for the whole process, so they are moved out of the collector's sight (`gc.freeze`); later
collections only walk what requests allocate. At exit they are handed back to the collector, so
the interpreter's last collection finalizes them as usual: frozen, Triton's compiled-kernel objects
outlived their extension module and nanobind printed hundreds of "leaked" lines at every shutdown.
"""

from __future__ import annotations

import atexit
import gc


def freeze_startup_objects() -> int:
    """Collect once, then freeze every surviving object until exit; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this is called
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()
