"""`florist embed`: every input format against engine.embed, kill-and-resume byte equality,
malformed records (line numbers, skip vs fail, counts), refused resumes, and the Ray path."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bench_scripts import run_bench

import florist
from florist.batch.job import JobConfig, MalformedRecord, run_job
from florist.batch.plan import InputSpec, detect_format, plan_input
from florist.batch.reader import read_part
from florist.cli import main as cli_main
from florist.text import InputError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _torch_on_one_thread(one_torch_thread):
    """conftest.one_torch_thread for every test here."""


@pytest.fixture(scope="module")
def tiny_engine(bert_dir):
    return florist.Engine.from_pretrained(bert_dir, device="cpu")


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["the", "rose", "garden", "of", "seeds", "and", "water", "in", "the", "sun", "is", "green", "red", "blue", "fast", "search", "engine"]
    return [f"doc {i} " + " ".join(rng.choice(words, size=int(rng.integers(1, 40)))) for i in range(n)]


def _write(path: Path, fmt: str, texts: list[str], ids: list | None = None) -> Path:
    ids = ids if ids is not None else [f"id-{i}" for i in range(len(texts))]
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids, texts)))
    elif fmt == "csv":
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "id"])
            w.writerows(zip(texts, ids))
    elif fmt == "parquet":
        pq.write_table(pa.table({"id": ids, "text": texts}), path, row_group_size=37)
    else:
        path.write_text("".join(t + "\n" for t in texts))
    return path


def _result(out: Path) -> tuple[list, np.ndarray]:
    t = pq.read_table(out / "embeddings.parquet")
    emb = t.column("embedding").combine_chunks()
    return t.column("id").to_pylist(), emb.values.to_numpy().reshape(len(emb), -1)


def _quiet(*_):
    pass


# -- inputs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "txt"])
def test_parts_read_back_the_whole_file(tmp_path, fmt):
    texts = _texts(101) + ["multi\nline"] * (fmt in ("csv", "parquet"))
    path = _write(tmp_path / f"in.{fmt}", fmt, texts, list(range(len(texts))))
    spec = InputSpec(str(path), detect_format(path))
    whole = read_part(spec, plan_input(spec, 10_000), 0).drop_columns(["part"])
    for part_rows in (1, 7, 50):
        plan = plan_input(spec, part_rows)
        assert plan.num_parts == -(-len(texts) // part_rows)
        parts = pa.concat_tables([read_part(spec, plan, k) for k in range(plan.num_parts)])
        assert parts.drop_columns(["part"]).equals(whole)
    assert whole.column("text").to_pylist() == texts
    assert whole.column("id").to_pylist() == (whole.column("line").to_pylist() if fmt == "txt" else [str(i) if fmt == "csv" else i for i in range(len(texts))])


def test_line_oddities(tmp_path):
    """BOM, CRLF, no final newline, blank lines (not documents), invalid UTF-8 (an error)."""
    path = tmp_path / "in.txt"
    path.write_bytes(b"\xef\xbb\xbffirst\r\n\r\nthird \xff\nfourth")
    spec = InputSpec(str(path), "txt")
    rows = read_part(spec, plan_input(spec, 3), 1).to_pylist() + read_part(spec, plan_input(spec, 3), 0).to_pylist()
    by_line = {r["line"]: r for r in rows}
    assert by_line[1]["text"] == "first" and by_line[4]["text"] == "fourth"
    assert by_line[2]["text"] is None and by_line[2]["error"] is None
    assert by_line[3]["error"] == "text is not valid UTF-8"


# -- output equals engine.embed ------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "txt"])
def test_each_format_equals_engine_embed(tmp_path, tiny_engine, fmt):
    texts = _texts(150)
    path = _write(tmp_path / f"in.{fmt}", fmt, texts)
    summary = run_job(JobConfig(str(path), str(tmp_path / "out"), part_rows=40), engine=tiny_engine, progress="off", log=_quiet)
    ids, got = _result(tmp_path / "out")
    assert ids == (list(range(1, 151)) if fmt == "txt" else [f"id-{i}" for i in range(150)])
    np.testing.assert_allclose(got, tiny_engine.embed(texts), atol=2e-6)
    assert (summary.rows, summary.skipped, summary.records) == (150, 0, 150)


def test_one_part_is_bitwise_engine_embed_default_model(tmp_path, default_engine):
    texts = _texts(24, seed=1)
    path = _write(tmp_path / "in.jsonl", "jsonl", texts, list(range(24)))
    run_job(JobConfig(str(path), str(tmp_path / "out")), engine=default_engine, progress="off", log=_quiet)
    ids, got = _result(tmp_path / "out")
    assert ids == list(range(24)) and got.dtype == np.float32 and got.shape == (24, 384)
    np.testing.assert_array_equal(got, default_engine.embed(texts))


@pytest.mark.parametrize("encoding, dimensions", [("ubinary", 32), ("binary", None), ("float", 16)])
def test_output_options(tmp_path, tiny_engine, encoding, dimensions):
    texts = _texts(30, seed=2)
    path = _write(tmp_path / "in.txt", "txt", texts)
    run_job(JobConfig(str(path), str(tmp_path / "out"), encoding=encoding, dimensions=dimensions), engine=tiny_engine, progress="off", log=_quiet)
    _, got = _result(tmp_path / "out")
    want = tiny_engine.embed(texts, encoding=encoding, dimensions=dimensions)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want) if encoding != "float" else np.testing.assert_allclose(got, want, atol=2e-6)


# -- kill and resume -----------------------------------------------------------------------------
def _cli(input_: Path, out: Path, model: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "florist.cli", "embed", str(input_), "-o", str(out), "--model", str(model),
            "--device", "cpu", "--part-rows", "20", "--on-error", "skip", *extra]


def test_sigkill_then_resume_gives_the_same_file(tmp_path, bert_dir):
    texts = _texts(3000, seed=3)
    texts[5] = ""  # a malformed record: the skipped list must survive the kill too
    path = _write(tmp_path / "in.jsonl", "jsonl", texts, list(range(3000)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    ref = subprocess.run(_cli(path, tmp_path / "ref", bert_dir), env=env, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]

    out = tmp_path / "out"
    proc = subprocess.Popen(_cli(path, out, bert_dir), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = out / "parts" / "part-00000.parquet"
    deadline = time.monotonic() + 120
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    parts = sorted((out / "parts").glob("part-*.parquet"))
    assert not (out / "embeddings.parquet").exists(), "the job finished before it could be killed"
    assert 1 <= len(parts) < 150

    again = subprocess.run(_cli(path, out, bert_dir), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming" in again.stderr and "3000 records" in again.stdout and "1 skipped" in again.stdout
    assert (out / "embeddings.parquet").read_bytes() == (tmp_path / "ref" / "embeddings.parquet").read_bytes()
    assert (out / "skipped.jsonl").read_text() == (tmp_path / "ref" / "skipped.jsonl").read_text() == '{"line": 6, "error": "text is empty"}\n'
    assert not list(out.rglob(".*.tmp-*"))
    ids, _ = _result(out)
    assert ids == [i for i in range(3000) if i != 5]


# -- malformed records ---------------------------------------------------------------------------
BAD_LINES = {
    3: ("not json at all", "invalid JSON"),
    5: ('{"id": 5}', "no 'text' field"),
    8: ('{"id": 8, "text": 42}', "'text' is an integer, not a string"),
    9: ('{"id": 9, "text": ""}', "text is empty"),
    11: ('{"id": "eleven", "text": "x"}', "'id' is a string; the ids in this file are integers"),
    14: ('{"id": 14, "text": "' + "flower " * 80 + '"}', "text has 82 tokens; the model takes at most 64; pass --truncate"),
    15: ("[1, 2]", "an array, not a JSON object"),
}


def _bad_jsonl(path: Path) -> tuple[Path, list[str]]:
    lines, good = [], []
    for n in range(1, 41):
        if n in BAD_LINES:
            lines.append(BAD_LINES[n][0])
        elif n == 20:
            lines.append("   ")  # blank: not a document, not an error
        else:
            good.append(f"document {n} about roses")
            lines.append(json.dumps({"id": n, "text": good[-1]}))
    path.write_text("\n".join(lines) + "\n")
    return path, good


def test_fail_names_the_line_and_keeps_earlier_parts(tmp_path, tiny_engine):
    path, _ = _bad_jsonl(tmp_path / "in.jsonl")
    with pytest.raises(MalformedRecord, match=r"^line 3: invalid JSON .*--on-error skip"):
        run_job(JobConfig(str(path), str(tmp_path / "out"), part_rows=2), engine=tiny_engine, progress="off", log=_quiet)
    assert (tmp_path / "out" / "parts" / "part-00000.parquet").exists()
    assert not (tmp_path / "out" / "parts" / "part-00001.parquet").exists()
    assert not (tmp_path / "out" / "embeddings.parquet").exists()


def test_skip_reports_every_line_and_counts(tmp_path, tiny_engine):
    path, good = _bad_jsonl(tmp_path / "in.jsonl")
    out = tmp_path / "out"
    with pytest.raises(MalformedRecord):  # first with fail: parts before line 3 are kept ...
        run_job(JobConfig(str(path), str(out), part_rows=2), engine=tiny_engine, progress="off", log=_quiet)
    logs: list[str] = []
    summary = run_job(JobConfig(str(path), str(out), part_rows=2, on_error="skip"), engine=tiny_engine, progress="bar", log=logs.append)
    assert any("resuming" in m for m in logs)  # ... and --on-error skip resumes from them
    assert (summary.records, summary.rows, summary.skipped, summary.blank) == (40, 32, 7, 1)
    assert "32 rows embedded, 7 skipped, 1 blank of 40 records" in summary.lines()[0]
    skipped = [json.loads(x) for x in (out / "skipped.jsonl").read_text().splitlines()]
    assert [s["line"] for s in skipped] == sorted(BAD_LINES)
    for s in skipped:
        assert BAD_LINES[s["line"]][1] in s["error"], s
    ids, got = _result(out)
    assert ids == [n for n in range(1, 41) if n not in BAD_LINES and n != 20]
    np.testing.assert_allclose(got, tiny_engine.embed(good), atol=2e-6)


def test_cli_summary_and_exit_codes(tmp_path, bert_dir, capsys):
    path, _ = _bad_jsonl(tmp_path / "in.jsonl")
    args = ["embed", str(path), "-o", str(tmp_path / "out"), "--model", str(bert_dir), "--device", "cpu", "--no-progress-bar"]
    assert cli_main(args) == 2
    assert "florist embed: line 3: invalid JSON" in capsys.readouterr().err
    assert cli_main(args + ["--on-error", "skip"]) == 0
    captured = capsys.readouterr()
    assert "32 rows embedded, 7 skipped, 1 blank of 40 records" in captured.out and "embeddings/s" in captured.out
    assert "skipped line 14: text has 82 tokens" in captured.err
    assert cli_main(args + ["--on-error", "skip"]) == 0
    assert "already complete" in capsys.readouterr().err


def test_counts_below_one_are_refused_before_a_model_loads(tmp_path, bert_dir, monkeypatch, capsys):
    """--batch-tokens 0 once ran one sequence a batch, silently; every count is now checked first."""
    import florist

    path = _write(tmp_path / "in.txt", "txt", _texts(4))

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(florist.Engine, "from_pretrained", no_load)
    for flags in (["--batch-tokens", "0"], ["--part-rows", "0"], ["--ray", "--num-replicas", "0"]):
        assert cli_main(["embed", str(path), "-o", str(tmp_path / "out"), "--model", str(bert_dir), "--device", "cpu", *flags]) == 2, flags
        assert f"florist embed: {flags[-2]} must be at least 1; got 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    with pytest.raises(InputError, match="max_batch_tokens must be at least 1; got 0"):
        florist.Engine.from_pretrained(bert_dir, device="cpu", max_batch_tokens=0)


def test_mismatched_resume_is_refused(tmp_path, tiny_engine):
    path = _write(tmp_path / "in.txt", "txt", _texts(10))
    cfg = JobConfig(str(path), str(tmp_path / "out"), part_rows=4)
    run_job(cfg, engine=tiny_engine, progress="off", log=_quiet)
    with pytest.raises(InputError, match=r"other settings \(encoding 'float' then, 'ubinary' now\)"):
        run_job(JobConfig(str(path), str(tmp_path / "out"), part_rows=4, encoding="ubinary"), engine=tiny_engine, log=_quiet)
    with pytest.raises(InputError, match=r"part_rows 4 then, 5 now"):
        run_job(JobConfig(str(path), str(tmp_path / "out"), part_rows=5), engine=tiny_engine, log=_quiet)
    path.write_text(path.read_text() + "one more line\n")
    with pytest.raises(InputError, match="the input changed .*size"):
        run_job(cfg, engine=tiny_engine, log=_quiet)


# -- Ray -----------------------------------------------------------------------------------------
def test_ray_matches_local(tmp_path, tiny_engine, bert_dir):
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    path, _ = _bad_jsonl(tmp_path / "in.jsonl")
    local = JobConfig(str(path), str(tmp_path / "local"), part_rows=6, on_error="skip")
    run_job(local, engine=tiny_engine, progress="off", log=_quiet)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}})
    try:
        cfg = JobConfig(str(path), str(tmp_path / "ray"), model=str(bert_dir), part_rows=6, on_error="skip", ray=True, device="cpu")
        summary = run_job(cfg, progress="off", log=_quiet)
    finally:
        ray.shutdown()
    assert (summary.rows, summary.skipped, summary.blank) == (32, 7, 1)
    ids, got = _result(tmp_path / "ray")
    want_ids, want = _result(tmp_path / "local")
    assert ids == want_ids
    np.testing.assert_allclose(got, want, atol=2e-6)
    assert (tmp_path / "ray" / "skipped.jsonl").read_text() == (tmp_path / "local" / "skipped.jsonl").read_text()


# -- the benchmark's code path -------------------------------------------------------------------
def test_batch_job_bench_smoke():
    out = run_bench("batch_job.py", "--smoke", env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "florist embed job" in out.stdout and "direct step()" in out.stdout and "job / step()" in out.stdout
