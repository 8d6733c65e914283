"""The lazy first-sight / capture / replay cycle the three CUDA graph runners share
(florist/engine/lazy_graphs.py), on the CPU: CUDA's graph primitives are replaced by stand-ins that
record what was asked and reserve 2 MiB per capture, so the cycle, its logs and its memory
accounting are checked without a GPU (capture and replay themselves: tests/test_gpu.py and
tests/test_gpu_generation.py)."""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest
import torch

from florist.engine.batch import HostBatch
from florist.engine.generation.batch import pack_prefill
from florist.engine.generation.decode_graphs import DecodeGraphRunner
from florist.engine.generation.prefill_graphs import PrefillGraphRunner
from florist.engine.graph_runner import CAPTURE_LOG, FIRST_SIGHT_LOG, GraphRunner, bucket
from florist.engine.staging import InputStaging

MIB = 2**20


class FakeGraph:
    def __init__(self):
        self.replays = 0

    def pool(self):
        return "the pool"

    def replay(self):
        self.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's graph primitives as stand-ins; `reserved` grows by 2 MiB per capture."""
    state = {"reserved": 100 * MIB, "pools": [], "capturing": False}

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        state["pools"].append(pool)
        state["streams"].append(stream)
        state["modes"].append(capture_error_mode)
        state["reserved"] += 2 * MIB
        state["capturing"] = True
        try:
            yield
        finally:
            state["capturing"] = False

    class FakeStream:
        def __init__(self, device=None):
            self.device = device

    state["streams"], state["modes"] = [], []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    return state


def messages(caplog, start: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]


def test_decode_graphs_log_first_sights_and_captures_and_count_their_memory(fake_cuda, caplog):
    calls = []

    def forward(packed, rows, max_context_len):
        calls.append((rows, max_context_len))
        return packed[:rows].long() + 1

    runner = DecodeGraphRunner(forward, torch.device("cpu"), max_num_seqs=8, max_len=64)
    inputs = torch.arange(3 * 4 + 1, dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger="florist.engine.generation.decode_graphs"):
        first, read = runner.run(inputs, 4)  # first sight: eager
        assert read is inputs and torch.equal(first, inputs[:4].long() + 1) and not runner.graphs
        captured, read = runner.run(inputs, 4)  # second sight: captured, then replayed
        entry = runner.graphs[4]
        assert read is entry.static_input and read is not inputs and captured is entry.output and entry.graph.replays == 1
        assert runner.run(entry.static_input, 4)[0] is entry.output and entry.graph.replays == 2  # pipelined: inputs already there
        runner.run(torch.arange(3 * 2 + 1, dtype=torch.int32), 2)
    assert calls == [(4, 64), (4, 64), (2, 64)]  # graphs and first sights both at max_len: one shape per bucket
    first_sights = messages(caplog, "ran a first-sight decode eagerly for ")
    assert [m.split(":")[0] for m in first_sights] == ["ran a first-sight decode eagerly for 4 rows", "ran a first-sight decode eagerly for 2 rows"]
    assert all("Triton kernels compiled" in m for m in first_sights)
    capture = messages(caplog, "captured a decode CUDA graph")
    assert len(capture) == 1 and capture[0].startswith("captured a decode CUDA graph for 4 rows in ") and capture[0].endswith("(1 decode graphs, 2 MiB)")
    stats = runner.stats()
    assert stats["decode_graphs"] == [4] and stats["decode_graph_memory_bytes"] == 2 * MIB
    assert stats["decode_capture_seconds"] >= 0 and stats["decode_first_sight_seconds"] >= 0 and stats["buckets"] == [1, 2, 4, 8]


def test_prefill_graphs_log_first_sights_and_captures_and_count_their_memory(fake_cuda, caplog):
    keys = []

    def forward(static, key):
        keys.append(key)
        return torch.zeros(key[1], dtype=torch.int64)

    runner = PrefillGraphRunner(forward, InputStaging(torch.device("cpu")), max_tokens=512, max_len=256, scratch_slot=4)
    packed = pack_prefill([[1, 2, 3], [4, 5]], [0, 1], 256)
    with caplog.at_level(logging.INFO, logger="florist.engine.generation.prefill_graphs"):
        for _ in range(3):  # first sight, capture (and replay), replay
            runner.run(packed, 5, 2, (3, 2))
        packed = pack_prefill([[7] * 100], [2], 256)
        for _ in range(2):
            runner.run(packed, 100, 1, (100,))
    assert keys == [(64, 4, 64, False)] * 2 + [(128, 2, 128, False)] * 2
    first_sights = messages(caplog, "ran a first-sight prefill eagerly for ")
    assert [m.split(":")[0] for m in first_sights] == ["ran a first-sight prefill eagerly for 64 tokens, up to 3 prompts, longest 64",
                                                      "ran a first-sight prefill eagerly for 128 tokens, up to 1 prompts, longest 128"]
    captures = messages(caplog, "captured a prefill CUDA graph for ")
    assert len(captures) == 2 and captures[1].endswith("(2 prefill graphs, 4 MiB)")
    assert runner.graphs[(64, 4, 64, False)].graph.replays == 2
    assert fake_cuda["pools"] == [None, "the pool"]  # one pool for all of this runner's graphs
    # and one capture stream, made on the runner's own device (not torch's process-wide default)
    assert fake_cuda["streams"][0] is fake_cuda["streams"][1] and fake_cuda["streams"][0].device == torch.device("cpu")
    stats = runner.stats()
    assert stats["prefill_graphs"] == [(64, 4, 64, False), (128, 2, 128, False)] and stats["prefill_graph_memory_bytes"] == 4 * MIB
    assert {"prefill_capture_seconds", "prefill_first_sight_seconds", "max_tokens"} <= set(stats)


def test_embedding_graphs_keep_their_log_lines_and_stats(fake_cuda, caplog):
    """The embedding runner on the shared cycle: the lines bench/serve.py reads, the same stats keys."""
    def forward(batch):
        return torch.zeros(batch.cu_seqlens.shape[0] - 1, 3)

    runner = GraphRunner(forward, torch.device("cpu"), max_tokens=1024, with_token_types=False)
    host = HostBatch.from_sequences([np.arange(1, 41, dtype=np.int32), np.arange(1, 8, dtype=np.int32)])
    with caplog.at_level(logging.INFO, logger="florist.engine.graph_runner"):
        outs = [runner.run(host) for _ in range(3)]
    assert all(o.shape == (2, 3) for o in outs)
    assert runner.graphs[bucket(host)].graph.replays == 2
    assert messages(caplog, FIRST_SIGHT_LOG.split(" for ")[0])[0].startswith(
        "ran a first-sight batch eagerly for 64 tokens, up to 3 sequences, longest 64: launched in ")
    captures = messages(caplog, CAPTURE_LOG.split(" for ")[0])
    assert len(captures) == 1 and captures[0].endswith("(1 graphs, 2 MiB)")
    stats = runner.stats()
    assert set(stats) == {"graphs", "graph_memory_bytes", "capture_seconds", "first_sight_seconds", "max_tokens", "covered_replays",
                          "split_min_tokens"}
    assert stats["graphs"] == 1 and stats["graph_memory_bytes"] == 2 * MIB


def test_a_new_bucket_is_covered_by_a_captured_graph_a_bounded_number_of_times(fake_cuda):
    """A batch whose bucket has no graph replays a captured graph that covers it (its padding
    spread over dummy sequences), `rent` times, then goes through its own first sight and capture."""
    runs = []

    def forward(batch):
        runs.append((batch.num_tokens, batch.num_seqs, batch.max_seqlen))
        return torch.zeros(batch.num_seqs, 3)

    runner = GraphRunner(forward, torch.device("cpu"), max_tokens=4096, with_token_types=False, rent=2)
    big = HostBatch.from_sequences([np.arange(1, 121, dtype=np.int32)] * 4)  # 480 tokens: bucket (512, 8, 128)
    small = HostBatch.from_sequences([np.arange(1, 101, dtype=np.int32)] * 3)  # 300 tokens: bucket (320, 4, 128)
    for _ in range(2):
        runner.run(big)  # first sight, capture
    cover = runner.graphs[(512, 8, 128, False)]
    assert cover.graph.replays == 1 and runs == [(512, 8, 128)] * 2
    for replays in (2, 3):
        out = runner.run(small)
        assert out.shape == (3, 3) and cover.graph.replays == replays and runner.covered_replays == replays - 1
        # the cover's static input holds the small batch: 212 padding tokens in two dummies of <= 128
        cu = cover.static_input[-9:].tolist()
        assert cu == [0, 100, 200, 300, 428, 512, 512, 512, 512]
        assert cover.static_input[2 * 512 + 300 : 3 * 512].tolist() == [3] * 128 + [4] * 84  # dummies' sequence ids
    assert runs == [(512, 8, 128)] * 2  # nothing ran but the cover's replays
    runner.run(small)  # rent spent: its own first sight
    runner.run(small)  # and its capture
    assert runs[2:] == [(320, 4, 128)] * 2 and (320, 4, 128, False) in runner.graphs
    assert runner.stats()["covered_replays"] == 2 and cover.graph.replays == 3
    # a bucket nothing covers (more tokens than any graph) is not rented
    runner.run(HostBatch.from_sequences([np.arange(1, 601, dtype=np.int32)]))
    assert runs[-1] == (640, 2, 640) and runner.covered_replays == 2


def test_rent_zero_never_covers(fake_cuda):
    runner = GraphRunner(lambda b: torch.zeros(b.num_seqs, 3), torch.device("cpu"), max_tokens=4096, with_token_types=False, rent=0)
    for _ in range(2):
        runner.run(HostBatch.from_sequences([np.arange(1, 121, dtype=np.int32)] * 4))
    runner.run(HostBatch.from_sequences([np.arange(1, 101, dtype=np.int32)] * 3))
    assert runner.covered_replays == 0 and runner.seen == {(512, 8, 128, False), (320, 4, 128, False)}


def test_every_capture_prepares_its_thread_first(fake_cuda, monkeypatch):
    """cuBLAS makes a thread's handle on its first call, which fails inside a capture: a bucket
    first seen on one thread (a server's warm-up) and captured on another (its generation thread)
    gets that thread's handles made before the capture begins (prepare_thread, on the GPU)."""
    import threading

    from florist.engine import lazy_graphs

    prepared = []
    monkeypatch.setattr(lazy_graphs, "prepare_thread", lambda device: prepared.append((threading.current_thread().name, device, fake_cuda["capturing"])))
    runner = DecodeGraphRunner(lambda packed, rows, max_len: packed[:rows].long(), torch.device("cpu"), max_num_seqs=8, max_len=64)
    runner.run(torch.arange(13, dtype=torch.int32), 4)  # first sight, on this thread
    worker = threading.Thread(target=lambda: runner.run(torch.arange(13, dtype=torch.int32), 4), name="other")
    worker.start()
    worker.join()
    assert prepared == [("other", torch.device("cpu"), False)] and set(runner.graphs) == {4}


def test_captures_leave_other_threads_free(fake_cuda):
    """A server's worker thread may wait on a batch's event while the loop captures: torch's
    default ("global") capture mode would fail the capture for it, so captures are thread-local
    (lazy_graphs' docstring; tests/test_gpu.py runs the overlap on a GPU)."""
    runner = DecodeGraphRunner(lambda packed, rows, max_len: packed[:rows].long(), torch.device("cpu"), max_num_seqs=8, max_len=64)
    for _ in range(3):  # first sight, capture, replay
        runner.run(torch.arange(13, dtype=torch.int32), 4)
    assert fake_cuda["modes"] == ["thread_local"]


def test_prepare_thread_does_nothing_off_the_gpu():
    from florist.engine.lazy_graphs import prepare_thread

    prepare_thread(torch.device("cpu"))  # no CUDA call: this machine may have none
