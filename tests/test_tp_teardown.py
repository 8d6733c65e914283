"""Tearing a tensor-parallel engine down in the order NCCL needs (checked on the CPU with stand-ins).

Under NCCL leaving the group is collective, and CUDA graphs that captured its collectives must be
gone first: on H200s, rank 0 joining its workers before leaving hung both ranks, and leaving while
decode graphs were alive hung them too."""

from __future__ import annotations

import pytest

import florist.engine.generation.tp as tp
from florist.engine.generation.generator import Generator


class FakeProc:
    def __init__(self, log: list, alive: bool = True):
        self.log, self.alive, self.name, self.exitcode = log, alive, "florist-tp-rank1", None

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout=None) -> None:
        self.log.append("join")
        self.alive = False

    def terminate(self) -> None:
        self.log.append("terminate")


class FakeChannel:
    def __init__(self, log: list):
        self.log = log

    def send(self, kind, packed, num_tokens=0, num_seqs=0) -> None:
        self.log.append("stop" if kind == tp.STOP else f"step {kind}")


def workers(log: list, alive: bool = True) -> tp.TensorParallelWorkers:
    w = tp.TensorParallelWorkers.__new__(tp.TensorParallelWorkers)  # no processes, no group
    w.procs, w.channel, w.closed = [FakeProc(log, alive)], FakeChannel(log), False
    return w


def test_rank0_leaves_the_group_with_its_workers_then_joins_them(monkeypatch):
    log: list = []
    monkeypatch.setattr(tp, "destroy_tensor_parallel", lambda abort=False: log.append(f"leave abort={abort}"))
    w = workers(log)
    w.close()
    w.close()  # a second close does nothing
    assert log == ["stop", "leave abort=False", "join"]


def test_a_dead_worker_makes_rank0_abort_instead_of_waiting_for_it(monkeypatch):
    log: list = []
    monkeypatch.setattr(tp, "destroy_tensor_parallel", lambda abort=False: log.append(f"leave abort={abort}"))
    workers(log, alive=False).close()
    assert log == ["leave abort=True", "join"]


def test_graphs_go_before_the_group_on_rank0_and_on_the_workers(monkeypatch):
    log: list = []

    class Runner:
        def release_graphs(self):
            log.append("release graphs")

    gen = Generator.__new__(Generator)
    gen.runner, gen.tp = Runner(), workers(log)
    monkeypatch.setattr(tp, "destroy_tensor_parallel", lambda abort=False: log.append("leave"))
    gen.close()
    assert log == ["release graphs", "stop", "leave", "join"]

    # A worker: STOP arrives, its graphs go, then it leaves the group.
    log.clear()

    class Channel:
        def __init__(self):
            self.sent = [(tp.STOP, None, 0, 0)]

        def recv(self):
            return self.sent.pop()

        def all_ok(self, ok):
            return ok

    monkeypatch.setattr(tp, "init_tensor_parallel", lambda *a, **k: None)
    monkeypatch.setattr(tp, "StepChannel", Channel)
    import florist.engine.generation.runner as runner_mod
    import florist.engine.model_dir as model_dir_mod

    monkeypatch.setattr(model_dir_mod, "read_model_dir", lambda *a, **k: None)
    monkeypatch.setattr(runner_mod, "GenerationRunner", lambda *a, **k: Runner())
    monkeypatch.setattr(tp, "destroy_tensor_parallel", lambda abort=False: log.append(f"leave abort={abort}"))
    tp.worker_main(1, 2, 0, {"device_type": "cpu", "model_path": "unused"})
    assert log == ["release graphs", "leave abort=False"]

    # Rank 0 dies: the next broadcast breaks, and the worker leaves without waiting for anyone.
    log.clear()

    class Broken(Channel):
        def recv(self):
            raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(tp, "StepChannel", Broken)
    with pytest.raises(RuntimeError, match="closed by peer"):
        tp.worker_main(1, 2, 0, {"device_type": "cpu", "model_path": "unused"})
    assert log == ["leave abort=True"]
