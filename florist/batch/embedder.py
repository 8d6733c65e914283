"""The two halves of embedding a part: tokenizing (CPU, no model weights) and running the model.

They are separate so each runs where it belongs: locally, tokenizing is a thread that works on
the next part while the device runs this one; on Ray, tokenizing is a CPU task stage and running
is the GPU actor stage.

    records (reader.py)          + token_ids list<int32>, tokens int32  (Tokenize)
      part line id text error    ─────────────────────────────────────▶
    tokenized                    part line id embedding error tokens    (Embed)
                                 ─────────────────────────────────────▶

A record the model cannot take (too many tokens without --truncate) gets an error here, like a
malformed record from the reader; its embedding is null. Rows keep their order throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from florist.engine.output import finalize_embeddings
from florist.text import InputError, TextProcessor

_FALLBACK_BLOCK = 256  # texts per encode call while looking for the ones that fail


@dataclass(frozen=True)
class OutputOptions:
    dimensions: int | None
    encoding: str
    normalize: bool

    def width(self, model_dim: int) -> int:
        dim = self.dimensions or model_dim
        return dim // 8 if self.encoding in ("binary", "ubinary") else dim

    @property
    def value_type(self) -> pa.DataType:
        return {"float": pa.float32(), "int8": pa.int8(), "binary": pa.int8(), "ubinary": pa.uint8()}[self.encoding]


class Tokenize:
    """records -> records + token_ids + tokens. Documents that cannot be tokenized become errors."""

    def __init__(self, text: TextProcessor, prompt: str, truncate: bool):
        self.text, self.prompt, self.truncate = text, prompt, truncate

    def __call__(self, records: pa.Table) -> pa.Table:
        texts = records.column("text").to_pylist()
        errors = records.column("error").to_pylist()
        docs = [i for i, t in enumerate(texts) if t is not None]
        encoded, failed = self._encode([texts[i] for i in docs])
        per_row: list[np.ndarray | None] = [None] * len(texts)
        for j, i in enumerate(docs):
            if j in failed:
                errors[i] = failed[j]
            else:
                per_row[i] = encoded[j]
        # Every document has at least one token (empty ones were failed), so length 0 <=> not a document.
        lens = np.array([0 if x is None else len(x) for x in per_row], dtype=np.int32)
        offsets = np.zeros(len(per_row) + 1, dtype=np.int32)
        np.cumsum(lens, out=offsets[1:])
        values = np.concatenate([x for x in per_row if x is not None]) if lens.any() else np.zeros(0, np.int32)
        id_col = records.column("id")
        return pa.table({
            "part": records.column("part"),
            "line": records.column("line"),
            "id": pc.if_else(pa.array([e is not None for e in errors]), pa.scalar(None, id_col.type), id_col),
            "error": pa.array(errors, pa.string()),
            "token_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int32()), mask=pa.array(lens == 0)),
            "tokens": pa.array(lens),
        })

    def _encode(self, texts: list[str]) -> tuple[list[np.ndarray], dict[int, str]]:
        """Token ids of every text, and an error for each one that fails (index -> message).
        One call for the whole part; only when it fails are smaller blocks, then single texts, tried."""
        if not texts:
            return [], {}
        try:
            return self._encode_all(texts), {}
        except InputError:
            pass
        out: list[np.ndarray] = []
        failed: dict[int, str] = {}
        for lo in range(0, len(texts), _FALLBACK_BLOCK):
            block = texts[lo : lo + _FALLBACK_BLOCK]
            try:
                out.extend(self._encode_all(block))
                continue
            except InputError:
                pass
            for i, t in enumerate(block, lo):
                try:
                    out.extend(self._encode_all([t]))
                except InputError as e:
                    out.append(np.zeros(0, np.int32))
                    failed[i] = _as_cli_message(str(e))
        return out, failed

    def _encode_all(self, texts: list[str]) -> list[np.ndarray]:
        out = self.text.encode(texts, prompt=self.prompt, truncate=self.truncate)
        if any(len(x) == 0 for x in out):
            raise InputError("input 0 has no tokens")  # worded for the single-text fallback, which reports it
        return out


def _as_cli_message(msg: str) -> str:
    # NOTE: TextProcessor words its errors for the API ("input 0 has 700 tokens; ... pass
    # truncate=true"); a single text was encoded, so "input 0" is this record.
    if msg.startswith("input 0 "):
        msg = "text " + msg.removeprefix("input 0 ")
    return msg.replace("truncate=true", "--truncate")


def token_id_arrays(tokenized: pa.Table) -> list[np.ndarray]:
    """The token ids of the rows that are documents (token_ids not null), as int32 views."""
    col = tokenized.column("token_ids").combine_chunks()
    values = col.values.to_numpy(zero_copy_only=False)
    offsets = col.offsets.to_numpy()
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]] for i in np.flatnonzero(valid)]


class Embed:
    """tokenized -> part, line, id, embedding (null where the row is not a document), error, tokens."""

    def __init__(self, engine, options: OutputOptions):
        self.engine, self.options = engine, options
        self.model_dim = engine.info.dimensions

    def run(self, tokenized: pa.Table) -> np.ndarray:
        """The device half: raw model output for the documents, in row order."""
        ids = token_id_arrays(tokenized)
        if not ids:
            return np.zeros((0, self.model_dim), np.float32)
        return self.engine.run(ids)

    def finish(self, tokenized: pa.Table, vectors: np.ndarray) -> pa.Table:
        """The host half: output options applied, vectors laid into a nullable fixed-size list."""
        o = self.options
        width = o.width(self.model_dim)
        valid = tokenized.column("token_ids").is_valid().to_numpy(zero_copy_only=False)
        out = finalize_embeddings(vectors, dimensions=o.dimensions, normalize=o.normalize, encoding=o.encoding)
        full = np.zeros((len(valid), width), dtype=out.dtype)
        full[valid] = out
        embedding = pa.FixedSizeListArray.from_arrays(pa.array(full.reshape(-1), o.value_type), width, mask=pa.array(~valid))
        return tokenized.drop_columns(["token_ids"]).append_column("embedding", embedding)

    def __call__(self, tokenized: pa.Table) -> pa.Table:
        return self.finish(tokenized, self.run(tokenized))
