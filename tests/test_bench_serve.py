"""bench/serve.py --smoke: the suite's code path (random models, `florist serve` and the baseline
server, the output check, all four scenarios over HTTP, the table, results.json, the plots) on
tiny models on the CPU; and the baseline's own models against the embedded API."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_serve_bench(*args: str) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--smoke", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout


def test_serve_bench_smoke(tmp_path):
    stdout = run_serve_bench("--out", str(tmp_path))
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
    for name in ("scenario1_latency", "scenario2_latency", "scenario3_throughput", "scenario4_latency", "scenario4_concurrency"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"

    # --replot redraws the same plots from results.json alone.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import serve

    assert serve.main(["--replot", str(tmp_path / "results.json"), "--out", str(tmp_path / "replot")]) == 0
    assert sorted(p.name for p in (tmp_path / "replot").iterdir()) == sorted(p.name for p in tmp_path.glob("*.png"))


def test_serve_bench_cross_encoder_behind_aiohttp(tmp_path):
    """The ms-marco-style cross-encoder geometry, and the baseline's aiohttp fallback."""
    stdout = run_serve_bench("--geometry", "tiny-cross-encoder", "--scenarios", "2", "--baseline-http", "aiohttp", "--requests", "3", "--out", str(tmp_path))
    assert re.search(r"baseline server: aiohttp, sentence-transformers CrossEncoder, cpu", stdout), stdout
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["label"] for r in rows] == ["5 pairs of 256 tokens", "25 pairs of 256 tokens", "50 pairs of 256 tokens"]


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
