"""Host-side finishing of model outputs: matryoshka truncation, normalisation, encodings, scores.

Per-request options are applied here, after the batch has run, so one batch can mix requests
with different options. Everything is O(B * D) numpy work, small next to the forward pass.

Encodings:
    float    float32
    binary   int8,  D/8 bytes: np.packbits(x > 0) - 128   (sentence-transformers' "binary")
    ubinary  uint8, D/8 bytes: np.packbits(x > 0)         (sentence-transformers' "ubinary")
    int8     only for models that define it (pplx-embed): round(127 * tanh(x)), un-normalised
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from florist.text import InputError

Encoding = Literal["float", "int8", "binary", "ubinary"]
ENCODINGS = ("float", "int8", "binary", "ubinary")


def check_output_options(dim: int, dimensions: int | None, encoding: str, native_int8: bool) -> None:
    if encoding not in ENCODINGS:
        raise InputError(f"unsupported encoding {encoding!r}; choose one of {', '.join(ENCODINGS)}")
    if encoding == "int8" and not native_int8:
        raise InputError("this model defines no int8 encoding; use float, binary or ubinary")
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, (int, np.integer)):
            raise InputError("dimensions must be an integer")
        if not 1 <= dimensions <= dim:
            raise InputError(f"dimensions must be between 1 and {dim} (the model's embedding size); got {dimensions}")
        if encoding in ("binary", "ubinary") and dimensions % 8:
            raise InputError(f"{encoding} packs 8 dimensions per byte; dimensions must be a multiple of 8, got {dimensions}")
    elif encoding in ("binary", "ubinary") and dim % 8:
        raise InputError(f"{encoding} needs an embedding size divisible by 8; this model has {dim}")


def finalize_embeddings(x: np.ndarray, *, dimensions: int | None, normalize: bool, encoding: Encoding) -> np.ndarray:
    """x: [B, D] float32 model output (pooled, Dense applied, not yet normalised)."""
    if dimensions is not None:
        x = x[:, :dimensions]
    if encoding == "int8":
        return np.clip(np.rint(np.tanh(x) * 127.0), -128, 127).astype(np.int8)
    if normalize:
        norms = np.sqrt(np.einsum("ij,ij->i", x, x))[:, None]  # np.linalg.norm costs ~4x more on small rows
        x = x / np.maximum(norms, 1e-12)
    if encoding == "ubinary":
        return np.packbits(x > 0, axis=-1)
    if encoding == "binary":
        return (np.packbits(x > 0, axis=-1).astype(np.int16) - 128).astype(np.int8)
    return np.ascontiguousarray(x, dtype=np.float32)


def finalize_scores(logits: np.ndarray, activation: str, *, raw: bool = False) -> np.ndarray:
    """logits: [B, labels] -> [B] for one label, else [B, labels]; activation unless `raw`."""
    if not raw and activation == "sigmoid":
        logits = 1.0 / (1.0 + np.exp(-logits))
    return logits[:, 0].copy() if logits.shape[1] == 1 else logits
