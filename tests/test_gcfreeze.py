"""Servers freeze their start-up objects so full GC passes stay off the request path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (freezing is process-wide: not in the test process); it must succeed."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_freeze_moves_survivors_out_of_the_collectors_sight():
    code = (
        "import gc, torch\n"
        "from florist.gcfreeze import freeze_startup_objects\n"
        "before = len(gc.get_objects())\n"
        "n = freeze_startup_objects()\n"
        "assert n > 1000 and len(gc.get_objects()) < before // 10, (n, before, len(gc.get_objects()))\n"
        "garbage = [[] for _ in range(3)]; garbage[0].append(garbage)  # a new cycle is still collected\n"
        "del garbage\n"
        "assert gc.collect() >= 1\n"
    )
    run_python(code)


def test_frozen_objects_are_finalized_at_exit():
    """The interpreter's last collection still reaches start-up objects (a cycle with a finalizer
    here; Triton's kernel objects in a server, which otherwise set off nanobind's leak report)."""
    code = (
        "class Noisy:\n"
        "    def __del__(self): print('finalized', flush=True)\n"
        "a = Noisy(); a.me = a; del a  # a cycle alive only for the collector\n"
        "import gc\n"
        "gc.disable()  # nothing collects it before the freeze\n"
        "from florist.gcfreeze import freeze_startup_objects\n"
        "gc.freeze(); freeze_startup_objects()\n"
    )
    proc = run_python(code)
    assert proc.stdout.count("finalized") == 1, proc.stdout


def test_servers_freeze_after_start_up():
    for path in ("florist/server/cli.py", "florist/gateway/server.py"):
        assert "freeze_startup_objects()" in (ROOT / path).read_text(), path
