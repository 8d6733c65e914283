"""The processes behind `florist serve`: engine replicas and gateway workers.

    florist serve ─┬─ engine replica 0   florist engine-server --port 0 --device cuda:0   (127.0.0.1 only)
                   ├─ engine replica 1   ...                                --device cuda:1
                   └─ gateway worker(s)  the HTTP port; one worker runs inside the serve process

With --tensor-parallel-size N (causal LMs) each replica takes N GPUs: `--device cuda` with
CUDA_VISIBLE_DEVICES set to its group, so its ranks are cuda:0..N-1 of what it sees.

Engines start in parallel; each prints "listening on HOST:PORT" once serving, which is how its
OS-chosen port is learnt. An engine that exits unexpectedly is restarted on the same port (with
back-off), so the gateways' balancers probe it back in. Children get SIGTERM if the serve
process dies (Linux PR_SET_PDEATHSIG), so no replica outlives it; an engine replica is therefore
started as `python -m florist.gateway.processes ARGS`, `florist engine-server ARGS` behind that.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time

log = logging.getLogger("florist.serve")

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """(In a child.) Get SIGTERM when the parent process dies; exit now if it already has.

    NOTE: Linux sends the signal when the parent *thread* that forked the child exits, so
    children are only ever started from the serve process's main thread.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):  # pragma: no cover
            return
    if parent_pid is not None and os.getppid() != parent_pid:
        sys.exit(1)


class EngineProcess:
    """One `florist engine-server`; `ready` is set once it listens, `address` says where."""

    def __init__(self, index: int, engine_args: list[str], device: str, env: dict[str, str]):
        self.index, self.engine_args, self.device, self.env = index, engine_args, device, env
        self.port = 0
        self.address: str | None = None
        self.proc: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.restarts, self.started_at, self.restart_at = 0, 0.0, None

    def start(self) -> None:
        # `florist engine-server` through this module's __main__, which first asks to die with us.
        # (Not a preexec_fn: that forces fork() in a process whose gRPC threads are running.)
        device, env = replica_device(self.device, self.env)
        cmd = [sys.executable, "-m", "florist.gateway.processes", *self.engine_args, "--device", device, "--host", "127.0.0.1", "--port", str(self.port)]
        self.ready.clear()
        self.started_at = time.monotonic()
        env = dict(env, FLORIST_PARENT_PID=str(os.getpid()))
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read_stdout, args=(self.proc,), name=f"engine-{self.index}-stdout", daemon=True).start()

    def _read_stdout(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if not self.ready.is_set() and "listening on " in line:
                self.address = line.split("listening on ", 1)[1].split(",")[0].strip()
                self.port = int(self.address.rsplit(":", 1)[1])
                self.ready.set()
            sys.stdout.write(f"[engine {self.index}] {line}")
            sys.stdout.flush()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.1):
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine replica {self.index} ({self.device}) exited with code {self.proc.returncode} before serving; its errors are above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine replica {self.index} ({self.device}) did not start within {timeout_s:.0f} s")

    def check(self) -> None:
        """Restart the engine if it died (after 1, 2, 4 ... 30 s; the count resets after a minute up)."""
        if self.proc is None or self.proc.poll() is None:
            return
        now = time.monotonic()
        if self.restart_at is None:
            if now - self.started_at > 60:
                self.restarts = 0
            self.restart_at = now + min(30.0, 2.0 ** self.restarts)
            log.warning("engine replica %d (pid %d, %s) exited with code %s; restarting it on port %d in %.0f s",
                        self.index, self.proc.pid, self.device, self.proc.returncode, self.port, self.restart_at - now)
        elif now >= self.restart_at:
            self.restarts += 1
            self.restart_at = None
            self.start()

    def stop(self, timeout_s: float = 15.0) -> None:
        terminate([self.proc] if self.proc else [], timeout_s)


def terminate(procs, timeout_s: float) -> None:
    """SIGTERM, wait, then SIGKILL what is left. `procs`: Popen or multiprocessing.Process."""
    alive = [p for p in procs if _alive(p)]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in alive:
        _wait(p, max(0.0, deadline - time.monotonic()))
        if _alive(p):
            log.warning("pid %d did not stop within %.0f s; killing it", p.pid, timeout_s)
            p.kill()
            _wait(p, 5.0)


def _alive(p) -> bool:
    return p.poll() is None if isinstance(p, subprocess.Popen) else p.is_alive()


def _wait(p, timeout_s: float) -> None:
    if isinstance(p, subprocess.Popen):
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    else:
        p.join(timeout_s)


def plan_devices(device: str | None, replicas: int | None, tensor_parallel: int = 1) -> list[str]:
    """Where each engine replica runs: one per GPU by default, one on the CPU without GPUs. With
    tensor parallelism each replica takes `tensor_parallel` GPUs, written "cuda:0,1" (its ranks)."""
    if tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1; got {tensor_parallel}")
    if device is None or device == "cuda":
        gpus = _cuda_count()
        if device == "cuda" and gpus == 0:
            raise ValueError("--device cuda, but no CUDA device is visible; use --device cpu")
        if gpus == 0:
            return ["cpu"] * (replicas or 1)
        devices = [f"cuda:{i}" for i in range(gpus)]
        if tensor_parallel == 1:
            return [devices[i % gpus] for i in range(replicas or gpus)]
    else:
        devices = [d.strip() for d in device.split(",") if d.strip()]
    if tensor_parallel == 1 or devices == ["cpu"] * len(devices):
        n = replicas or len(devices)
        return [devices[i % len(devices)] for i in range(n)]  # ranks on the CPU share it (gloo)
    if any(not d.startswith("cuda:") for d in devices):
        raise ValueError(f"--tensor-parallel-size {tensor_parallel} takes GPUs (cuda:N) or the CPU, not a mix: {','.join(devices)}")
    n = replicas or len(devices) // tensor_parallel
    if n < 1 or n * tensor_parallel > len(devices):
        raise ValueError(f"{replicas or 1} replica(s) at --tensor-parallel-size {tensor_parallel} need {max(n, 1) * tensor_parallel} GPUs; "
                         f"{len(devices)} given ({','.join(devices)})")
    return ["cuda:" + ",".join(d.split(":", 1)[1] for d in devices[i * tensor_parallel:(i + 1) * tensor_parallel]) for i in range(n)]


def replica_device(placement: str, env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """-> (the engine's --device, its environment) for a placement of plan_devices. A GPU group
    ("cuda:2,3") is made the replica's whole view of the GPUs (CUDA_VISIBLE_DEVICES), so its
    tensor-parallel ranks take cuda:0..N-1 of it; indices are read through this process's own
    CUDA_VISIBLE_DEVICES, if any."""
    if not placement.startswith("cuda:") or "," not in placement:
        return placement, env
    ours = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    picked = [int(i) for i in placement.split(":", 1)[1].split(",")]
    visible = [ours[i] for i in picked] if ours else [str(i) for i in picked]
    return "cuda", dict(env, CUDA_VISIBLE_DEVICES=",".join(visible))


def _cuda_count() -> int:
    import torch  # only here: the gateway itself never needs torch

    return torch.cuda.device_count()


def engine_env(devices: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    cpu_replicas = devices.count("cpu")
    if cpu_replicas > 1 and "OMP_NUM_THREADS" not in env:
        # NOTE: replicas sharing the cores each with all of them only contend.
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // cpu_replicas))
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # the engines keep their own registries
    return env


if __name__ == "__main__":  # an engine replica of `florist serve`: `florist engine-server ARGS` that dies with its parent
    die_with_parent(int(os.environ.pop("FLORIST_PARENT_PID", os.getppid())))
    from florist.server.cli import main

    sys.exit(main(sys.argv[1:]))
