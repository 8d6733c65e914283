import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import models as tiny  # noqa: E402


@pytest.fixture(scope="session")
def default_engine():
    import florist

    return florist.Engine.from_pretrained(device="cpu")


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory):
    return tiny.make_bert_embedder(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="session")
def cross_encoder_dir(tmp_path_factory):
    return tiny.make_bert_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return tiny.make_qwen3_embedder(tmp_path_factory.mktemp("qwen3-embedding"))


@pytest.fixture(scope="session")
def pplx_dir(tmp_path_factory):
    return tiny.make_qwen3_embedder(tmp_path_factory.mktemp("pplx-embed"), bidirectional=True)


@pytest.fixture(scope="session")
def reranker_dir(tmp_path_factory):
    return tiny.make_qwen3_reranker(tmp_path_factory.mktemp("qwen3-reranker"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module: where an engine thread (a server, a job's reader and
    writer) shares the small CPU with the test, more OpenMP threads only spin against each other
    (tens of times slower on a busy machine); one thread is faster and deterministic."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """Every test skipped for want of a GPU ("needs CUDA", "needs a Hopper GPU", "needs 2 GPUs")
    carries the `gpu` marker, so `python -m pytest -m gpu tests` on the device runs all of them.
    One without it stops the collection: it would be skipped in CI and never selected on the GPU."""
    unmarked = [
        item.nodeid for item in items
        if item.get_closest_marker("gpu") is None
        and any(str(mark.kwargs.get("reason", "")).startswith("needs") and ("CUDA" in mark.kwargs["reason"] or "GPU" in mark.kwargs["reason"])
                for mark in item.iter_markers("skipif"))
    ]
    if unmarked:
        raise pytest.UsageError("tests that need a GPU without the `gpu` marker (add @pytest.mark.gpu): " + ", ".join(unmarked[:10]))
