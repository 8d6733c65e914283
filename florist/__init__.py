"""florist: fast GPU inference for text-embedding, reranking and greedy LLM models."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Engine", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import florist` (e.g. by the torch-free scheduler) does not import torch.
    if name == "Engine":
        from florist.engine.engine import Engine

        return Engine
    raise AttributeError(name)
