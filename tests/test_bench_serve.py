"""bench/serve.py --smoke: the suite's code path (random models, `florist serve` and the baseline
server, the output check, all four scenarios over HTTP, the table, results.json, the plots) on
tiny models on the CPU; and the baseline's own models against the embedded API."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import numpy as np
import pytest
from bench_scripts import ROOT, run_bench


def run_serve_bench(*args: str) -> str:
    out = run_bench("serve.py", "--smoke", *args, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout


def test_serve_bench_smoke(tmp_path, capsys):
    """The whole suite on tiny models, with Infinity beside florist and the baseline: --infinity
    starts a third server with the given command (here tests/stand_ins, which answers like
    Infinity and refuses token ids); it is sent texts of the same token counts where a scenario
    sends ids, checked against florist, timed, tabled and plotted, and sits out scoring."""
    stand_in = ROOT / "tests" / "stand_ins"
    stdout = run_serve_bench("--requests", "3", "--out", str(tmp_path), "--json", str(tmp_path / "rows.json"),
                             "--infinity", f"env PYTHONPATH={stand_in} {sys.executable}")
    cosine = re.search(r"check: min cosine, florist vs baseline over \d+ rows: ([0-9.]+)", stdout)
    assert cosine and float(cosine.group(1)) >= 0.999, stdout
    assert re.search(r"check: max \|score difference\|, florist vs baseline over \d+ rows: 0\.0", stdout), stdout
    assert "ratio: how many times florist is ahead" in stdout
    for row in ("1 low-latency embedding, 64 tokens", "2 low-latency scoring, 50 pairs of 256 tokens", "3 high-throughput embedding, 10 x 128 tokens",
                "4 high-concurrency embedding, 32-token text, 4 clients"):
        assert re.search(re.escape(row) + r"\s+(p50 ms|emb/s)\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+x", stdout), row

    results = json.loads((tmp_path / "results.json").read_text())
    assert {r["scenario"] for r in results["rows"]} == {1, 2, 3, 4}
    for r in results["rows"]:
        for server in ("florist", "baseline"):
            m = r[server]
            assert m["n"] == m["planned"] > 0 and m["p50"] <= m["p90"] <= m["p99"] <= m["max"] and m["items_per_s"] > 0
    assert results["meta"]["checks"]["embed"]["ok"] and results["meta"]["checks"]["score"]["ok"]
    assert "florist serve: tiny-qwen3 on http://" in results["meta"]["servers"]["embed"]["florist"]
    assert results["meta"]["florist_env"] == {k: v for k, v in os.environ.items() if k.startswith("FLORIST_")}
    # --json: florist's figures as bench/report.py rows, the baseline beside them (what bench/ab.py compares)
    report = json.loads((tmp_path / "rows.json").read_text())
    assert {r["scenario"].split()[0] for r in report} == {"1", "2", "3", "4"}
    for r in report:
        assert r["florist"] > 0 and r["transformers"] > 0 and r["speedup"] > 0 and r["unit"] in ("ms", "emb/s", "req/s")
    by_key = {(r["scenario"], r["metric"]): r for r in report}
    cell = next(r for r in results["rows"] if r["scenario"] == 4)
    row = by_key[(f"4 {cell['name']}, {cell['label']}", "req/s")]
    assert row["florist"] == cell["florist"]["requests_per_s"] and row["transformers"] == cell["baseline"]["requests_per_s"]
    for name in ("scenario1_latency", "scenario2_latency", "scenario3_throughput", "scenario4_latency", "scenario4_concurrency"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"

    # --replot prints the same table and redraws the same plots from results.json alone.
    sys.path.insert(0, str(ROOT / "bench"))
    import serve

    capsys.readouterr()
    assert serve.main(["--replot", str(tmp_path / "results.json"), "--out", str(tmp_path / "replot")]) == 0
    assert sorted(p.name for p in (tmp_path / "replot").iterdir()) == sorted(p.name for p in tmp_path.glob("*.png"))
    lines = stdout.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("scenario ")))
    table = lines[start:start + 1 + next(i for i, line in enumerate(lines[start + 1:]) if not line[:1].isdigit())]
    replotted = capsys.readouterr().out.splitlines()
    assert len(table) > 40, table
    assert [line for line in replotted if line in table] == table, (table, replotted)

    # Infinity: checked and timed in every cell but scoring's
    cosine = re.search(r"check: min cosine, florist vs infinity over (\d+) rows: ([0-9.]+)", stdout)
    assert cosine and int(cosine.group(1)) >= 3 + 1 + 1 and float(cosine.group(2)) >= 0.999, stdout  # scenario 1's three, 3's, 4's
    assert "infinity: -m infinity_emb.cli v2 --model-id" in stdout and "--url-prefix /v1" in stdout
    for row in ("1 low-latency embedding, 64 tokens", "3 high-throughput embedding, 10 x 128 tokens", "4 high-concurrency embedding, 32-token text, 4 clients"):
        assert re.search(re.escape(row) + r"\s+(p50 ms|emb/s)\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+x\s+[0-9.]+\s+[0-9.]+x\s+\d+ / \d+ / \d+", stdout), row
    assert re.search(r"NOTE: infinity sat out '2 low-latency scoring, 5 pairs of 256 tokens'", stdout), stdout

    assert results["meta"]["checks"]["embed infinity"]["ok"]
    assert results["meta"]["versions"]["infinity"]["infinity-emb"] is None  # the stand-in is no installed distribution
    for r in results["rows"]:
        if r["scenario"] == 2:
            assert "infinity" not in r
        else:
            m = r["infinity"]
            assert m["n"] == m["planned"] > 0 and m["p50"] <= m["max"] and m["items_per_s"] > 0


def test_serve_bench_cross_encoder_behind_aiohttp_and_infinity_reranking(tmp_path):
    """The ms-marco-style cross-encoder geometry and the baseline's aiohttp fallback; Infinity
    (the stand-in) reranks with a sequence classifier, so it gets the same pairs as /rerank
    bodies and is checked against florist's /v1/score and timed."""
    stand_in = ROOT / "tests" / "stand_ins"
    stdout = run_serve_bench("--geometry", "tiny-cross-encoder", "--scenarios", "2", "--baseline-http", "aiohttp", "--requests", "3",
                             "--out", str(tmp_path), "--infinity", f"env PYTHONPATH={stand_in} {sys.executable}")
    assert re.search(r"baseline server: aiohttp, sentence-transformers CrossEncoder, cpu", stdout), stdout
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["label"] for r in rows] == ["5 pairs of 256 tokens", "25 pairs of 256 tokens", "50 pairs of 256 tokens"]
    diff = re.search(r"check: max \|score difference\|, florist vs infinity over (\d+) rows: ([0-9.]+)", stdout)
    assert diff and int(diff.group(1)) == 5 + 25 + 50 and float(diff.group(2)) <= 1e-4, stdout
    assert all(r["infinity"]["n"] == r["infinity"]["planned"] > 0 for r in rows)
    assert "sat out" not in stdout


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("geometry, variant, kind", [
    ("tiny-bert", "embed", "STEmbedder"),
    ("tiny-qwen3", "pplx", "BidirectionalQwen3Embedder"),
    ("tiny-bert", "cross-encoder", "CrossEncoderScorer"),
    ("tiny-qwen3", "reranker", "Qwen3RerankerScorer"),
])
def test_baseline_models_match_the_embedded_api(tmp_path, geometry, variant, kind):
    """Each of the baseline's model paths against florist's embedded API on the same weights
    (the HTTP smoke runs above use only some of them), ragged lengths included."""
    import torch

    import florist

    sys.path.insert(0, str(ROOT / "bench"))
    import baseline_server
    from geometries import make_model

    task = "score" if variant in ("cross-encoder", "reranker") else "embed"
    path = make_model(tmp_path / f"{geometry}-{variant}", geometry, variant=variant, dtype=torch.float32)
    model = baseline_server.load_model(str(path), task, "cpu", torch.float32)
    assert type(model).__name__ == kind
    engine = florist.Engine.from_pretrained(path, device="cpu", task=task)
    if task == "embed":
        rng = np.random.default_rng(0)
        seqs = [rng.integers(250, 1000, size=n).tolist() for n in (16, 40, 16, 7)]
        assert cosine(model.embed_ids(seqs), engine.embed(seqs)).min() >= 0.9999
        texts = ["the rose needs sun", "which seed grows fast in a small garden"]
        assert cosine(model.embed_texts(texts), engine.embed(texts)).min() >= 0.9999
    else:
        docs = ["the rose needs sun and water", "search engine", "which flower is red"]
        np.testing.assert_allclose(model.score("which flower needs sun", docs), engine.score("which flower needs sun", docs), atol=1e-5)


def test_capture_times_are_read_from_the_engine_log():
    """bench/serve.py reports the graphs the engine captured during a cell from its log lines."""
    from florist.engine.graph_runner import CAPTURE_LOG

    sys.path.insert(0, str(ROOT / "bench"))
    import serve

    lines = ["2026-11-30 INFO florist.engine.graph_runner: " + CAPTURE_LOG % (1536, 3, 512, 41.25, 7, 180.0) + "\n",
             "[engine 0] something else\n", CAPTURE_LOG % (512, 1, 512, 9.0, 8, 181.0)]
    assert serve.captures(lines) == [41.2, 9.0]
    assert serve.captures(["florist engine-server: listening on 127.0.0.1:1"]) == []
    from florist.engine.graph_runner import FIRST_SIGHT_LOG

    first = FIRST_SIGHT_LOG % (512, 3, 256, 812.5, 30.25, 7, 2)
    launched, cpu, compiled = serve.first_sights(lines + ["x: " + first])
    assert launched == [812.5]
    assert cpu == [30.2]
    assert compiled == [7]
    assert serve.captures([first]) == []
    from florist.engine.graph_runner import COVER_LOG

    cover = COVER_LOG % (896, 7, 128, 448, 7, 128, 1, 8)
    assert serve.covered(lines + [first, "x: " + cover, cover]) == 2
    assert serve.captures([cover]) == [] and serve.first_sights([cover]) == ([], [], [])


def test_infinity_is_sent_texts_of_the_same_token_counts(tmp_path):
    """Where a cell's bodies are token ids, its text bodies hold texts the model's tokenizer makes
    exactly as many tokens of, one for each id list."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import serve
    from geometries import make_model

    path = make_model(tmp_path / "tiny-qwen3", "tiny-qwen3", variant="embed", dtype=torch.float32)
    model = serve.describe_model(path, "test")
    cells = serve.plan_cells([1, 3, 4], serve.SMOKE_PLAN, 4, model, for_infinity=True)
    texts = serve.Texts(path, 0)
    checked = 0
    for c in cells:
        if c.scenario == 4:
            assert c.infinity_bodies is None and c.bodies_for("infinity") is c.bodies  # already text
            clients = c.procs * c.clients
            assert c.requests == -(-16 // clients) * clients  # 4 n, a whole number per client
            continue
        if c.scenario == 1:
            assert c.requests == 4
        assert len(c.infinity_bodies) == len(c.bodies)
        for ids_body, text_body in zip(c.bodies, c.infinity_bodies):
            ids, words = json.loads(ids_body)["input"], json.loads(text_body)["input"]
            assert all(isinstance(w, str) for w in words)
            assert [len(texts.tok.encode(w).ids) for w in words] == [len(i) for i in ids]
            checked += len(words)
    assert checked == 3 * 8 + 3 * 2 * 10
    assert all(c.infinity_bodies is None for c in serve.plan_cells([1, 3], serve.SMOKE_PLAN, 4, model))


def test_a_server_that_dies_is_reported_and_the_run_goes_on(tmp_path):
    """Infinity (the stand-in) dies in scenario 3's first cell (after the check's 4 requests and
    2 of the cell's): that cell says it failed and shows its last output, the next cells say it had
    exited, florist and the baseline are measured to the end, and the run exits 0 with the
    failures in the table and results.json."""
    stand_in = ROOT / "tests" / "stand_ins"
    stdout = run_serve_bench("--scenarios", "3,4", "--requests", "3", "--out", str(tmp_path),
                             "--infinity", f"env STAND_IN_EXIT_AFTER=6 PYTHONPATH={stand_in} {sys.executable}")
    assert re.search(r"3 high-throughput embedding, 10 x 32 tokens\s+infinity\s+FAILED: ", stdout), stdout
    assert "| stand-in: exiting on request 7" in stdout
    assert re.search(r"4 high-concurrency embedding, 32-token text, 1 client\s+infinity\s+not run: the server had exited \(code 3\)", stdout), stdout
    assert re.search(r"4 high-concurrency embedding, 32-token text, 4 clients\s+req/s\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+x\s+failed\s", stdout), stdout
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 3 + 3
    for r in rows:
        assert r["florist"]["n"] > 0 and r["baseline"]["n"] > 0 and "infinity" not in r
        assert set(r["failed"]) == {"infinity"}


def test_infinity_failing_the_check_is_not_timed(tmp_path):
    """Infinity dies while the check asks it (after 1 request): every cell says it was not
    timed and why; florist and the baseline run as usual."""
    stand_in = ROOT / "tests" / "stand_ins"
    stdout = run_serve_bench("--scenarios", "1", "--requests", "3", "--out", str(tmp_path),
                             "--infinity", f"env STAND_IN_EXIT_AFTER=1 PYTHONPATH={stand_in} {sys.executable}")
    assert re.search(r"check: florist vs infinity over 0 rows: nan \(\) FAILED: infinity did not answer the check's requests", stdout), stdout
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 3 and all(r["florist"]["n"] == 3 and r["baseline"]["n"] == 3 and "infinity" not in r for r in rows)
    assert all(r["failed"]["infinity"].startswith("not timed: infinity did not answer") for r in rows)


def test_infinity_that_does_not_start_is_reported_and_the_run_goes_on(tmp_path):
    """Infinity (the stand-in) exits before its start-up line: the run says so with its output,
    every cell it would have run says it did not start, and florist and the baseline are
    checked and timed as usual (the run exits 0)."""
    stand_in = ROOT / "tests" / "stand_ins"
    stdout = run_serve_bench("--scenarios", "1", "--requests", "3", "--out", str(tmp_path),
                             "--infinity", f"env STAND_IN_FAIL_START=1 PYTHONPATH={stand_in} {sys.executable}")
    assert "stand-in: failing to start" in stdout and "NOTE: infinity did not start (exit 1): the run goes on without it" in stdout, stdout
    assert re.search(r"check: min cosine, florist vs baseline over \d+ rows", stdout), stdout
    assert "florist vs infinity" not in stdout
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 3
    for r in rows:
        assert r["florist"]["n"] == 3 and r["baseline"]["n"] == 3 and "infinity" not in r
        assert r["failed"] == {"infinity": "not run: infinity did not start (exit 1)"}


def test_infinity_answering_health_with_500_is_given_up_at_once(tmp_path):
    """An Infinity that starts but answers /health with 500 (as one without orjson does) is up and
    broken: the run says so with its output at once, instead of waiting out the start-up limit
    (300 s) for a 200 that never comes, and florist and the baseline are timed as usual."""
    stand_in = ROOT / "tests" / "stand_ins"
    started = time.monotonic()
    stdout = run_serve_bench("--scenarios", "1", "--requests", "3", "--out", str(tmp_path),
                             "--infinity", f"env STAND_IN_HEALTH_500=1 PYTHONPATH={stand_in} {sys.executable}")
    assert time.monotonic() - started < 240, "waited for a broken server"
    assert re.search(r"NOTE: infinity at http://[\d.:]+ answers /health with 500:", stdout), stdout
    assert "stand-in: /health will answer 500" in stdout, stdout
    assert "NOTE: infinity did not start" in stdout, stdout
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 3
    for r in rows:
        assert r["florist"]["n"] == 3 and r["baseline"]["n"] == 3 and "infinity" not in r
        assert r["failed"]["infinity"].startswith("not run: infinity did not start")


@pytest.mark.parametrize("missing", ["httptools", "orjson"])
def test_infinity_without_a_package_its_server_needs_stops_the_run_before_anything_starts(tmp_path, missing):
    """Infinity's server runs uvicorn with http="httptools" and answers with fastapi's
    ORJSONResponse (/health included): a --infinity Python that cannot import either is refused at
    once with the reason, before any model is built or server started. A module that raises
    ImportError stands in for the missing package, as this Python may have the real one."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("infinity_emb", "httptools"):
        if name != missing:
            (bare / name).symlink_to(ROOT / "tests" / "stand_ins" / name)
    (bare / f"{missing}.py").write_text("raise ImportError('stand-in: not installed')\n")
    out = run_bench("serve.py", "--smoke", "--scenarios", "1", "--out", str(tmp_path / "out"),
                    "--infinity", f"env PYTHONPATH={bare} {sys.executable}", timeout=120)
    assert out.returncode != 0
    assert f"{missing} is not importable" in out.stdout + out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    assert "florist serve:" not in out.stdout


def test_a_cell_the_baseline_failed_shows_florist_and_says_failed(capsys):
    """A cell the baseline failed (an out-of-memory 500 at 4 x 100 x 4096 tokens on an 80 GB card)
    still has florist's and Infinity's figures: the table prints them with "failed" in the
    baseline's column, not "not run", which is for cells the run never reached."""
    sys.path.insert(0, str(ROOT / "bench"))
    import serve

    def measured(n, p50, rate):
        return {"n": n, "planned": n, "retries": 0, "p50": p50, "items_per_s": rate}

    failed = serve.Cell(scenario=3, label="100 x 4096 tokens", route="/v1/embeddings", bodies=[], items=100,
                        results={"florist": measured(4, 3154.68, 80.2), "infinity": measured(4, 9219.12, 38.4)},
                        failed={"baseline": "RuntimeError: POST /v1/embeddings: 500"})
    unreached = serve.Cell(scenario=3, label="100 x 8192 tokens", route="/v1/embeddings", bodies=[], items=100,
                           results={"florist": measured(4, 6000.0, 40.0)})
    serve.print_table([failed, unreached])
    lines = capsys.readouterr().out.splitlines()
    rate = next(line for line in lines if line.startswith(failed.key) and "emb/s" in line)
    assert re.search(r"emb/s\s+80\.20\s+failed\s+38\.40\s+2\.09x", rate), rate
    assert any(line.startswith(unreached.key) and "not run (the run stopped first)" in line for line in lines), lines
    assert any(line.startswith("NOTE: baseline failed in '3 high-throughput embedding, 100 x 4096 tokens'") for line in lines), lines


def test_a_server_that_failed_a_cell_keeps_its_bar_slot():
    """In the bar plots each server keeps its place beside the others in a cell it failed (marked
    there), so Infinity's bar is not drawn where the baseline's stands in the other groups."""
    sys.path.insert(0, str(ROOT / "bench"))
    import serve

    def cell(results, failed=None):
        return serve.Cell(scenario=3, label="100 x 4096 tokens", route="/v1/embeddings", bodies=[], items=100,
                          results={k: {"items_per_s": 1.0} for k in results}, failed=failed or {})

    width, slots = serve.bar_slots(cell(["florist", "baseline", "infinity"]))
    assert slots == [("florist", -width), ("baseline", 0.0), ("infinity", width)] and width == pytest.approx(0.8 / 3)
    assert serve.bar_slots(cell(["florist", "infinity"], {"baseline": "RuntimeError: 500"})) == (width, slots)
    assert serve.bar_slots(cell(["florist", "baseline"])) == (0.4, [("florist", -0.2), ("baseline", 0.2)])


def test_log_axes_label_two_and_five_and_start_a_decade_below_the_lowest_bar():
    sys.path.insert(0, str(ROOT / "bench"))
    import serve

    assert [serve.minor_label(v) for v in (2, 3, 5, 7, 20, 40, 500, 0.2, 0.3)] == ["2", "", "5", "", "20", "", "500", "0.2", ""]
    assert serve.decade_below([2.46, 31.9, None, 0, 48.4]) == 1.0
    assert serve.decade_below([12.2, 58.9]) == 10.0
    assert serve.decade_below([0.35]) == 0.1
    assert serve.decade_below([None, 0]) is None


def test_florist_alone_with_more_serve_flags(tmp_path):
    """--florist-only: no baseline, no check, florist's column only; --serve-flags reach `florist serve`."""
    stdout = run_serve_bench("--scenarios", "1", "--requests", "3", "--florist-only", "--serve-flags=--launch-ahead-ms 2", "--out", str(tmp_path))
    assert "check: none (--florist-only" in stdout and "check: min cosine" not in stdout
    assert re.search(r"1 low-latency embedding, 64 tokens\s+p50 ms\s+[0-9.]+\s+-\s+3 / -", stdout), stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert all("baseline" not in r and r["florist"]["n"] == 3 for r in results["rows"])
    assert (tmp_path / "scenario1_latency.png").read_bytes()[:4] == b"\x89PNG"
    bad = run_bench("serve.py", "--smoke", "--scenarios", "1", "--requests", "3", "--florist-only", "--serve-flags=--launch-ahead-ms -1",
                    "--out", str(tmp_path / "bad"), timeout=300)
    assert bad.returncode != 0 and "--launch-ahead-ms must be 0 or more" in bad.stdout + bad.stderr
    refused = run_bench("serve.py", "--smoke", "--florist-only", "--infinity", "python", timeout=60)
    assert refused.returncode == 2 and "drop --infinity" in refused.stderr
