"""florist.kernels.compile_watch: Triton's compilation listener, counted (the first-sight log line
reports it); the listener is chained, not replaced."""

from __future__ import annotations

import pytest


def test_counts_compiles_and_cache_loads_and_calls_the_previous_listener(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    import florist.kernels.compile_watch as watch

    monkeypatch.setattr(watch, "_watching", False)
    monkeypatch.setattr(watch, "_counts", {"compiled": 0, "loaded": 0})
    seen = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: seen.append((kw["cache_hit"], kw["src"])))
    assert watch.watch() and watch.watch()  # the second call changes nothing
    listener = knobs.compilation.listener
    for hit, src in ((False, "a"), (True, "b"), (False, "c")):  # as triton.compiler.compile calls it
        listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=hit)
    assert watch.counts() == (2, 1)
    assert seen == [(False, "a"), (True, "b"), (False, "c")]


def test_without_a_listener_in_triton_nothing_is_counted(monkeypatch):
    import sys
    import types

    import florist.kernels.compile_watch as watch

    monkeypatch.setattr(watch, "_watching", False)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__name__="triton"))  # a Triton without knobs
    monkeypatch.setitem(sys.modules, "triton.knobs", None)
    assert watch.watch() is False
