"""bench/phases.py: stamps matched to the requests they fall in, and the --smoke run (a tiny model
served in-process on the CPU, its request path stamped in the server's process)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from bench_scripts import run_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import phases  # noqa: E402


def test_each_request_takes_the_first_stamp_of_each_label_inside_its_round_trip():
    requests = [(10.0, 11.0), (20.0, 21.0)]
    stamps = [("b >", 10.5), ("a >", 10.25), ("a >", 10.75),  # a second "a >" in the first request: not counted
              ("a <", 20.1),  # the first request's "a" returning after its client had the reply: not the second's
              ("a >", 20.5), ("b >", 20.75), ("late", 21.5), ("early", 9.0)]  # outside every round trip: dropped
    rows = phases.phases(requests, stamps)
    assert [(label, count) for label, _, count in rows] == [("a >", 2), ("b >", 2)]
    assert rows[0][1] == pytest.approx(375_000.0) and rows[1][1] == pytest.approx(625_000.0)  # medians of 250/500 ms and 500/750 ms


def test_smoke_stamps_the_whole_path():
    out = run_bench("phases.py", "--smoke", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {m.group(1).strip(): (float(m.group(2)), int(m.group(3))) for m in re.finditer(r"^(.{32}) +([0-9.]+) +(\d+)$", out.stdout, re.M)}
    path = ["bytes in (aiohttp) >", "JSON read >", "pipeline >", "dispatcher >", "engine client >", "Embed handler >", "batcher >",
            "step() launch >", "rows handed over >", "Embed handler <", "pipeline <", "response written >"]
    assert all(rows.get(label, (0, 0))[1] == 10 for label in path), out.stdout
    times = [rows[label][0] for label in path]
    assert times == sorted(times), out.stdout  # the request meets them in this order
    assert rows["the client has the reply"][0] > times[-1], out.stdout
