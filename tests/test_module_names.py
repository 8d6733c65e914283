"""The scripts of bench/ and the helpers of tests/ are imported by their bare names: `python
bench/engine.py` puts bench/ first on sys.path, and so do the bench tests and this suite's conftest
for tests/. A file there named like an installed package shadows it for every library in that
process. (bench/fused_kernels.py was bench/kernels.py until transformers began importing the
`kernels` package it then shadowed.)"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _installed_top_level_names() -> set[str]:
    names = set(importlib.metadata.packages_distributions())
    # packages_distributions reads top_level.txt / RECORD; a few names are commonly imported
    # optional packages of our dependencies, so they are kept out even where not installed.
    return names | {"kernels", "flash_attn", "triton", "accelerate", "datasets", "tokenizers", "safetensors"}


def test_no_bench_script_or_test_helper_shadows_a_package():
    local = {p.stem for d in ("bench", "tests") for p in (ROOT / d).glob("*.py")}
    clashes = sorted(local & _installed_top_level_names())
    assert not clashes, f"rename these: they shadow installed or optional packages: {clashes}"
