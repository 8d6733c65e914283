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
def spread_cross_encoder_dir(tmp_path_factory):
    """cross_encoder_dir's model with larger initial weights: its scores span ~0.3-0.8 on the
    test texts (the default initializer_range keeps them within ~3e-4 of 0.5, under most
    tolerances, so a mixed-up or constant score would pass)."""
    return tiny.make_bert_cross_encoder(tmp_path_factory.mktemp("cross-encoder-spread"), initializer_range=0.2)


@pytest.fixture(scope="session")
def spread_reranker_dir(tmp_path_factory):
    """Likewise for reranker_dir: scores span ~0.10-0.31 (0.45-0.48 with the default)."""
    return tiny.make_qwen3_reranker(tmp_path_factory.mktemp("qwen3-reranker-spread"), initializer_range=0.1)


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


def _gpu_missing(item) -> str | None:
    """Why this machine cannot run a test marked `gpu`, or None. `@pytest.mark.gpu` needs CUDA;
    `gpu(count=2)` that many devices; `gpu(capability=(9, 0))` a device of at least that compute
    capability (Hopper). Marks at several levels (module and test) add up."""
    marks = list(item.iter_markers("gpu"))
    if not marks:
        return None
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA"
    count = max(mark.kwargs.get("count", 1) for mark in marks)
    if torch.cuda.device_count() < count:
        return f"needs {count} GPUs"
    capability = max(tuple(mark.kwargs.get("capability", (0, 0))) for mark in marks)
    if torch.cuda.get_device_capability() < capability:
        return f"needs a GPU of compute capability {capability[0]}.{capability[1]} or newer"
    return None


def pytest_collection_modifyitems(config, items):
    """A test that needs a GPU says so with the `gpu` marker alone: the marker skips it where the
    GPU is missing, and `python -m pytest -m gpu tests` on the device selects it. A `skipif` that
    gives a missing GPU as its reason stops the collection: `-m gpu` would not select its test."""
    by_skipif = [
        item.nodeid for item in items
        if any(str(mark.kwargs.get("reason", "")).startswith("needs") and ("CUDA" in mark.kwargs["reason"] or "GPU" in mark.kwargs["reason"])
               for mark in item.iter_markers("skipif"))
    ]
    if by_skipif:
        raise pytest.UsageError("tests that skip for want of a GPU by a skipif (mark them @pytest.mark.gpu instead, with count= "
                                "for several devices or capability= for a newer one): " + ", ".join(by_skipif[:10]))
    for item in items:
        reason = _gpu_missing(item)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
