"""`florist` commands in subprocesses for the gateway tests: start, read what they print, stop."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Engine servers put their local sockets here, not in the user's runtime directory, and a test
# that kills one leaves its socket here.
RUNTIME_DIR = tempfile.mkdtemp(prefix="florist-test-run-")
atexit.register(shutil.rmtree, RUNTIME_DIR, ignore_errors=True)


class FloristProcess:
    """`python -m florist.cli ARGS`; every output line (stdout and stderr) is kept in `lines`.
    `launcher`: the command before ARGS, if not `python -m florist.cli` (one that ends by calling
    florist.cli's main with ARGS, e.g. bench/phases.py's stamped server)."""

    def __init__(self, *args: str, env: dict | None = None, launcher: list[str] | None = None):
        self.args = args
        full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), XDG_RUNTIME_DIR=RUNTIME_DIR,
                        **(env or {}))
        self.proc = subprocess.Popen([*(launcher or [sys.executable, "-m", "florist.cli"]), *args], cwd=ROOT, env=full_env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while time.monotonic() < deadline:
            for line in self.lines[seen:]:
                m = re.search(pattern, line)
                if m:
                    return m
            seen = len(self.lines)
            if self.proc.poll() is not None and seen == len(self.lines):
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"`florist {' '.join(self.args)}` did not print {pattern!r} (exit {self.proc.poll()}):\n{self.output()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode


def serve(*args: str, env: dict | None = None, launcher: list[str] | None = None) -> tuple[FloristProcess, str]:
    """`florist serve --port 0 ARGS` -> (process, base URL) once it serves."""
    p = FloristProcess("serve", "--port", "0", *args, env=env, launcher=launcher)
    return p, p.wait_for(r"on (http://[\d.]+:\d+)").group(1)


def engine_servers(n: int, *args: str, port: int = 0) -> list[tuple[FloristProcess, str]]:
    """n `florist engine-server`s on the CPU, started together -> [(process, host:port)] once they listen."""
    procs = [FloristProcess("engine-server", "--port", str(port), "--device", "cpu", *args, env={"OMP_NUM_THREADS": "1"}) for _ in range(n)]
    return [(p, p.wait_for(r"listening on ([\d.]+:\d+)").group(1)) for p in procs]
