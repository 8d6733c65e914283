"""Tensor-parallel generation: rank 0 is the calling process, ranks 1..N-1 are spawned workers.

    caller (rank 0)                                       worker process (rank r)
    TensorParallelWorkers(...)  ──spawn──────────────────▶ worker_main(r, ...)
    init_tensor_parallel(0)  ◀── tcp://127.0.0.1:PORT ──▶ init_tensor_parallel(r)   (NCCL | gloo)
    StepChannel (a gloo group: host bytes)                 StepChannel
    GenerationRunner (loads its weight shards)             GenerationRunner
    ready(ok)  ◀──────────── all ranks agree ────────────▶ ready(ok)
    each step: send(kind, packed, T, B) ──broadcast──────▶ recv() -> runner.execute(...)
    close(): send(STOP), leave the group ────────────────▶ leave the group (at once: collective under NCCL)

The step inputs are the packed int32 buffers of generation/batch.py (token ids, positions, slots),
so every rank runs the same step; the model's collectives then keep the ranks' activations equal.
A pipelined decode step (generator.py) is a header alone, kind ADVANCE: each rank advances its
own last decode buffer from its own next ids, which are the same on every rank (the greedy pick
is computed from gathered values), so the ranks still run identical steps in the same order.
NOTE: one tensor-parallel engine per process (torch.distributed has one default group).
"""

from __future__ import annotations

import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from florist.distributed import destroy_tensor_parallel, init_tensor_parallel

STOP = 0
_HEADER = 4  # kind, number of int32 values, num_tokens, num_seqs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


class StepChannel:
    """Rank 0 -> all ranks: one header and one int32 buffer per step, over gloo on the host (under
    NCCL a separate gloo group, so no step input makes a trip through a GPU)."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        self.header = torch.zeros(_HEADER, dtype=torch.int32)
        self._header_np = self.header.numpy()

    def send(self, kind: int, packed: np.ndarray | None, num_tokens: int = 0, num_seqs: int = 0) -> None:
        size = 0 if packed is None else packed.size
        self._header_np[:] = (kind, size, num_tokens, num_seqs)
        dist.broadcast(self.header, src=0, group=self.group)
        if size:
            dist.broadcast(torch.from_numpy(np.ascontiguousarray(packed, dtype=np.int32)), src=0, group=self.group)

    def recv(self) -> tuple[int, np.ndarray | None, int, int]:
        dist.broadcast(self.header, src=0, group=self.group)
        kind, size, num_tokens, num_seqs = self.header.tolist()
        if not size:
            return kind, None, num_tokens, num_seqs
        buf = torch.empty(size, dtype=torch.int32)
        dist.broadcast(buf, src=0, group=self.group)
        return kind, buf.numpy(), num_tokens, num_seqs

    def all_ok(self, ok: bool) -> bool:
        """True when every rank says ok (start-up: a rank that failed to load tells the others)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())


def rank_device(device_type: str) -> torch.device:
    """The device of this rank: init_tensor_parallel made cuda:(rank % count) current."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def worker_main(rank: int, world_size: int, port: int, runner_args: dict) -> None:
    """Ranks 1..N-1: build this rank's runner, then run every step rank 0 sends until STOP."""
    from florist.engine.generation.runner import GenerationRunner
    from florist.engine.model_dir import read_model_dir

    device_type = runner_args.pop("device_type")
    if device_type == "cpu":
        torch.set_num_threads(1)  # N ranks share the host's cores
    init_tensor_parallel(rank, world_size, init_method=f"tcp://127.0.0.1:{port}", backend=backend_for(device_type))
    channel = StepChannel()
    together = True  # leaves the group when rank 0 does (collective under NCCL)
    try:
        runner = None
        try:
            model_dir = read_model_dir(runner_args.pop("model_path"), "generate")
            runner = GenerationRunner(model_dir, rank_device(device_type), **runner_args)
        finally:
            ok = channel.all_ok(runner is not None)
        if not ok:
            return
        while True:
            try:
                kind, packed, num_tokens, num_seqs = channel.recv()
                if kind != STOP:
                    runner.execute(kind, packed, num_tokens, num_seqs)
            except BaseException:
                # Rank 0 is gone (the broadcast broke) or this rank failed mid-step: nobody will
                # leave the group with this rank, so it must not wait for them.
                together = False
                raise
            if kind == STOP:
                runner.release_graphs()  # before the group goes: they hold its collectives
                return
    finally:
        destroy_tensor_parallel(abort=not together)


class TensorParallelWorkers:
    """Rank 0's handle on the other ranks: starts them, joins the group, sends each step."""

    def __init__(self, world_size: int, device_type: str, runner_args: dict):
        if device_type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"tensor parallel size {world_size} needs {world_size} GPUs; {torch.cuda.device_count()} are visible")
        port = free_port()
        ctx = mp.get_context("spawn")
        args = dict(runner_args, device_type=device_type)
        self.procs = [ctx.Process(target=worker_main, args=(r, world_size, port, dict(args)), daemon=True, name=f"florist-tp-rank{r}")
                      for r in range(1, world_size)]
        for p in self.procs:
            p.start()
        init_tensor_parallel(0, world_size, init_method=f"tcp://127.0.0.1:{port}", backend=backend_for(device_type))
        self.channel = StepChannel()
        self.device = rank_device(device_type)
        self.closed = False

    def ready(self, ok: bool) -> None:
        """After rank 0 built its runner (ok) or failed (not ok): every rank must have succeeded."""
        all_ok = self.channel.all_ok(ok)
        if not all_ok:
            self.close(send_stop=False)  # the workers have left their loop already
        if ok and not all_ok:
            raise RuntimeError("a tensor-parallel worker failed to load the model; its error is printed above")

    def send(self, kind: int, packed: np.ndarray, num_tokens: int, num_seqs: int) -> None:
        # NOTE: a dead worker would leave the broadcast (and then the model's collectives) waiting
        # forever; checking between steps costs a waitpid per worker.
        for p in self.procs:
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel worker {p.name} exited (code {p.exitcode}); restart the engine")
        self.channel.send(kind, packed, num_tokens, num_seqs)

    def close(self, send_stop: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        alive = all(p.is_alive() for p in self.procs)
        if send_stop and alive:
            self.channel.send(STOP, None)
        # The workers leave the group as soon as they stop, and under NCCL leaving is collective:
        # rank 0 leaves now, with them, and joins them after (the other way round both wait forever).
        destroy_tensor_parallel(abort=not alive)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
