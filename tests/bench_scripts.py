"""Run a script of bench/ the way a user does, from the repository root, for the bench tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The GPU-only scripts: without CUDA each says so and exits 1 (tests/test_bench_gpu_only.py).
GPU_ONLY = ("covering.py", "first_sight.py", "generate_warm_up.py")


def run_bench(script: str, *args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`env`: variables set on top of this process's environment."""
    return run_script(ROOT / "bench" / script, *args, timeout=timeout, env=env)


def run_script(path: Path, *args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A Python script run to its end like subprocess.run(capture_output=True), but in a session
    of its own: on a timeout (or an interrupt) the script and every process it started, servers
    included, are killed before the error is raised, so a hung bench leaves nothing running."""
    proc = subprocess.Popen([sys.executable, str(path), *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env} if env else None, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as e:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone already
            pass
        out, err = proc.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
