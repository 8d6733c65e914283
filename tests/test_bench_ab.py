"""bench/ab.py: settings interleaved round by round, medians and round-by-round differences."""

from __future__ import annotations

import json
import sys

import pytest
from bench_scripts import ROOT, run_bench

STAND_IN = [sys.executable, str(ROOT / "tests" / "stand_ins" / "ab_bench.py")]


def test_interleaves_settings_and_compares_round_by_round(tmp_path, monkeypatch):
    log = tmp_path / "calls.log"
    monkeypatch.setenv("AB_LOG", str(log))
    proc = run_bench("ab.py", "--env", "AB_X=a,b", "--rounds", "3", "--out", str(tmp_path / "out"), "--", *STAND_IN, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the order turns round every round, so neither setting always runs first
    assert log.read_text().split() == ["a", "b", "b", "a", "a", "b"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    table = {(e["row"], e["value"]): e["settings"] for e in summary["table"]}
    step = table[("step [p50]", "florist")]
    # a: calls 0, 3, 4 -> 2.00, 2.03, 2.04; b: calls 1, 2, 5 -> 1.51, 1.52, 1.55
    assert step["a"]["figures"] == pytest.approx([2.00, 2.03, 2.04]) and step["a"]["median"] == pytest.approx(2.03)
    assert step["b"]["figures"] == pytest.approx([1.51, 1.52, 1.55]) and step["b"]["median"] == pytest.approx(1.52)
    assert step["b"]["median_diff"] == pytest.approx(-0.49) and step["b"]["ahead"] == 3 and step["b"]["pairs"] == 3
    assert table[("step [p50]", "gpu_ms")]["b"]["ahead"] == 3  # an extra in ms: lower is ahead
    assert table[("step [p50]", "florist_pct.p99")]["b"]["median"] == pytest.approx(2.52)
    assert ("step [p50]", "florist_pct.n") not in table
    rate = table[("batch [emb/s]", "florist")]
    assert rate["b"]["median_diff"] > 0 and rate["b"]["ahead"] == 3  # a rate: higher is ahead
    assert len(list((tmp_path / "out").glob("round*-AB_X-*.json"))) == 6
    assert "ahead in 3 of 3" in proc.stdout


def test_settings_as_extra_arguments(tmp_path, monkeypatch):
    log = tmp_path / "calls.log"
    monkeypatch.setenv("AB_LOG", str(log))
    monkeypatch.setenv("AB_X", "a")  # what the command does without extra arguments
    proc = run_bench("ab.py", "--args", "", "--args", "--x b", "--rounds", "2", "--out", str(tmp_path / "out"), "--", *STAND_IN, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert log.read_text().split() == ["a", "b", "b", "a"]  # "" added nothing, "--x b" its two words
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    step = {(e["row"], e["value"]): e["settings"] for e in summary["table"]}[("step [p50]", "florist")]
    assert step[""]["figures"] == pytest.approx([2.00, 2.03]) and step["--x b"]["figures"] == pytest.approx([1.51, 1.52])
    assert step["--x b"]["ahead"] == 2
    assert sorted(p.name for p in (tmp_path / "out").glob("round*.json")) == [
        "round0-args---x_b.json", "round0-args-none.json", "round1-args---x_b.json", "round1-args-none.json"]
    assert 'args="--x b"' in proc.stdout and 'args=""' in proc.stdout


def test_several_variables_set_together(tmp_path, monkeypatch):
    """--env twice: setting i takes each variable's i-th value, in one process environment."""
    log = tmp_path / "calls.log"
    monkeypatch.setenv("AB_LOG", str(log))
    proc = run_bench("ab.py", "--env", "AB_X=a,a,b", "--env", "AB_Y=p,q r,p", "--rounds", "2", "--out", str(tmp_path / "out"), "--", *STAND_IN,
                     timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert log.read_text().splitlines() == ["a+p", "a+q r", "b+p", "b+p", "a+q r", "a+p"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["env"] == "AB_X AB_Y" and summary["settings"] == ["AB_X=a AB_Y=p", "AB_X=a AB_Y='q r'", "AB_X=b AB_Y=p"]
    step = {(e["row"], e["value"]): e["settings"] for e in summary["table"]}[("step [p50]", "florist")]
    assert step["AB_X=b AB_Y=p"]["figures"] == pytest.approx([1.52, 1.53]) and step["AB_X=b AB_Y=p"]["ahead"] == 2
    assert step["AB_X=a AB_Y='q r'"]["figures"] == pytest.approx([2.01, 2.04])
    assert len(list((tmp_path / "out").glob("round*-env-AB_X_a_AB_Y__q_r_.json"))) == 2
    assert "AB_X=b AB_Y=p" in proc.stdout


def test_a_failed_run_is_shown_and_fails_the_comparison(tmp_path, monkeypatch):
    monkeypatch.setenv("AB_LOG", str(tmp_path / "calls.log"))
    proc = run_bench("ab.py", "--env", "AB_X=a,boom", "--rounds", "1", "--", *STAND_IN, timeout=120)
    assert proc.returncode == 1
    assert "AB_X=boom: FAILED" in proc.stdout and "stand-in failure" in proc.stdout


def test_a_run_past_its_timeout_is_stopped_and_fails_the_comparison(tmp_path):
    proc = run_bench("ab.py", "--env", "AB_X=a,b", "--rounds", "1", "--timeout", "1", "--", sys.executable, "-c",
                     "import time; time.sleep(30)", timeout=60)
    assert proc.returncode == 1
    assert proc.stdout.count("FAILED (stopped after --timeout 1 s)") == 2


@pytest.mark.parametrize("args", [["--env", "AB_X=a", "--", "true"], ["--env", "AB_X", "--", "true"], ["--env", "AB_X=a,b"],
                                  ["--env", "AB_X=a,,b", "--", "true"], ["--args", "x", "--", "true"], ["--args", "x", "--args", "x", "--", "true"],
                                  ["--env", "AB_X=a,b", "--args", "x", "--args", "y", "--", "true"], ["--rounds", "1", "--", "true"],
                                  ["--env", "AB_X=a,b", "--env", "AB_Y=p,q,r", "--", "true"], ["--env", "AB_X=a,b", "--env", "AB_X=c,d", "--", "true"],
                                  ["--env", "AB_X=a,a", "--env", "AB_Y=p,p", "--", "true"]])
def test_bad_arguments_are_refused(args):
    proc = run_bench("ab.py", *args, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_a_setting_in_a_file_name_keeps_to_plain_characters(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import ab

    assert ab.file_safe("wait") == "wait"
    assert ab.file_safe("a=b/c d,é") == "a_b_c_d__"
