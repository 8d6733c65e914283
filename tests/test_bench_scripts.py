"""tests/bench_scripts.run_script: a bench run that hangs is killed with everything it started."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from bench_scripts import run_script


def test_a_timed_out_script_is_killed_with_the_processes_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "hangs.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"  # a server it started
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_script(script, timeout=5)
    assert "started" in raised.value.stdout  # what it printed comes with the error
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break  # gone (reaped by init once its parent died)
        if open(f"/proc/{child}/stat").read().split(") ")[1].startswith("Z"):
            break  # a zombie: killed, not yet reaped
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail("the script's child outlived the timeout")


def test_a_script_that_ends_gives_its_output_and_exit_code(tmp_path):
    script = tmp_path / "ends.py"
    script.write_text("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)\n")
    done = run_script(script, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
