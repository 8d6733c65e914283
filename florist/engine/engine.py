"""The embedded API: load a model in-process and embed or score with it.

    engine = florist.Engine.from_pretrained()          # all-MiniLM-L6-v2 from its wheel
    engine.embed(["a text", "another"])                # -> np.ndarray [2, 384] float32
    scorer = florist.Engine.from_pretrained(path_to_cross_encoder)
    scorer.score("query", ["doc 1", "doc 2"])          # -> np.ndarray [2]
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from florist.config import Task
from florist.engine.batch import HostBatch
from florist.engine.lazy import LazyTensor
from florist.engine.model_dir import ModelDir, read_model_dir
from florist.engine.output import Encoding, check_output_options, finalize_embeddings, finalize_scores
from florist.engine.runner import ModelRunner, resolve_device, resolve_dtype
from florist.text import InputError, TextProcessor

if TYPE_CHECKING:
    from florist.engine.generation.config import GenerationConfig
    from florist.engine.generation.results import GenerationResult


@dataclass(frozen=True)
class ModelInfo:
    """What a client needs to know about the served model (the gRPC `Info` and HTTP `/info`)."""

    model_name: str
    model_path: str
    family: str
    task: str
    dimensions: int
    max_input_tokens: int
    vocab_size: int
    dtype: str
    device: str
    pooling: tuple[str, ...]
    normalize: bool
    prompts: dict[str, str]
    default_prompt_name: str | None
    score_activation: str
    native_int8: bool
    tokenizer: str

    def to_dict(self) -> dict:
        return asdict(self)


def _output_dim(md: ModelDir) -> int:
    p = md.pipeline
    if p.task == "score":
        return max(md.config.num_labels, 1)
    if p.dense:
        return p.dense[-1].out_features
    return md.config.hidden_size * len(p.pooling)


def warm_up_shapes(max_tokens: int, max_seqlen: int, max_seqs: int = 256) -> list[list[int]]:
    """The batches Engine.warm_up runs, as lists of sequence lengths.

    - Token counts: at 64 tokens, doubling up to max_tokens (and max_tokens itself), one
      sequence (where the model takes it) and eight of unequal lengths. One sequence and many
      reach different attention paths, and the matrix products pick their kernels by row count.
    - Sequence counts: 1, 2, 4, ... up to max_seqs (and max_seqs itself) sequences of 16 tokens,
      one batch for each graph bucket of sequences (the next power of two above the count). A
      model whose head reads only each sequence's last token runs its final layer on one row
      per sequence, and those products choose kernels, and Triton specialises them, by that
      row count (skinny_gemm: a fused norm up to 4 rows, a row count divisible by 16 or not).
    """
    counts = sorted({t for t in (64 << k for k in range(20)) if t < max_tokens} | {max_tokens})
    shapes = []
    for t in counts:
        if t <= max_seqlen:
            shapes.append([t])
        if t >= 16:
            part = t // 8
            lengths = [min(max_seqlen, part + (part // 2 if i % 2 else -(part // 2))) for i in range(8)]  # 1.5x / 0.5x, ragged
            shapes.append([max(1, n) for n in lengths])
    length = min(16, max_seqlen)
    for k in sorted({1 << j for j in range(20) if 1 << j < max_seqs} | {max_seqs}):
        if k * length <= max_tokens and [length] * k not in shapes:
            shapes.append([length] * k)
    return shapes


class Engine:
    """Tokenize, batch by length, run on the device, restore order, finish on the host."""

    def __init__(self, model_dir: ModelDir, runner: ModelRunner, max_batch_tokens: int = 16384):
        _check_batch_tokens(max_batch_tokens)
        self.model_dir, self.runner = model_dir, runner
        self.text = TextProcessor(str(model_dir.tokenizer_file), model_dir.config, model_dir.pipeline)
        self.max_batch_tokens = max_batch_tokens
        p = model_dir.pipeline
        self.info = ModelInfo(
            model_name=model_dir.name,
            model_path=str(model_dir.path),
            family=model_dir.config.family,
            task=p.task,
            dimensions=_output_dim(model_dir),
            max_input_tokens=p.max_seq_length,
            vocab_size=model_dir.config.vocab_size,
            dtype=str(runner.dtype).removeprefix("torch."),
            device=str(runner.device),
            pooling=p.pooling if p.task == "embed" else (),
            normalize=p.normalize,
            prompts=p.prompt_dict,
            default_prompt_name=p.default_prompt_name,
            score_activation=p.score_activation,
            native_int8=p.native_quantization,
            tokenizer=str(model_dir.tokenizer_file),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, *, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None, task: Task | None = None, attention_backend: str | None = None, max_batch_tokens: int = 16384, tensor_parallel_size: int | None = None, generation: "GenerationConfig | None" = None) -> "Engine":
        """Load a model directory (None: the default all-MiniLM-L6-v2). Never downloads.

        A causal LM (task "generate") is served by the generation engine: `generation` sets its
        KV-cache slots and lengths, `tensor_parallel_size` > 1 starts that many processes."""
        _check_batch_tokens(max_batch_tokens)  # before the model loads
        md = read_model_dir(path, task)
        dev = resolve_device(device)
        if md.pipeline.task == "generate":
            from dataclasses import replace

            from florist.engine.generation.config import GenerationConfig
            from florist.engine.generation.generator import Generator

            config = generation or GenerationConfig()
            if tensor_parallel_size is not None:
                config = replace(config, tensor_parallel_size=tensor_parallel_size)
            return cls(md, Generator(md, dev, resolve_dtype(dtype, dev), config, attention_backend), max_batch_tokens)
        if tensor_parallel_size not in (None, 1):
            raise InputError(f"tensor parallelism serves causal LMs (task generate); {md.name} is loaded for {md.pipeline.task} on one device")
        return cls(md, ModelRunner(md, dev, resolve_dtype(dtype, dev), attention_backend), max_batch_tokens)

    @property
    def graph_max_tokens(self) -> int | None:
        """The largest batch (tokens) replayed from a CUDA graph; None without graphs."""
        graphs = getattr(self.runner, "graphs", None)
        return graphs.max_tokens if graphs is not None else None

    # -- public API ----------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], *, prompt_name: str | None = None, prompt: str | None = None, truncate: bool = False) -> list[list[int]]:
        prompt_text = self.text.resolve_prompt(prompt_name, prompt)
        return [ids.tolist() for ids in self.text.encode(_as_list(texts), prompt=prompt_text, truncate=truncate)]

    def embed(self, texts: Sequence[str] | Sequence[Sequence[int]] | str, *, prompt_name: str | None = None, prompt: str | None = None, dimensions: int | None = None, normalize: bool | None = None, encoding: Encoding = "float", truncate: bool = False) -> np.ndarray:
        """Embeddings [N, D]: float32, or int8 / uint8 for the packed encodings."""
        self._require("embed")
        check_output_options(self.info.dimensions, dimensions, encoding, self.info.native_int8)
        prompt_text = self.text.resolve_prompt(prompt_name, prompt)
        ids = self.text.encode(_as_list(texts), prompt=prompt_text, truncate=truncate)
        vectors = self.run(ids)
        if normalize is None:
            normalize = self.model_dir.pipeline.normalize
        return finalize_embeddings(vectors, dimensions=dimensions, normalize=normalize, encoding=encoding)

    def score(self, query: str, documents: Sequence[str], *, truncate: bool = False, raw: bool = False, instruction: str | None = None) -> np.ndarray:
        """Relevance of each document to the query: [N] (or [N, labels] for multi-label heads)."""
        self._require("score")
        ids, first = self.text.encode_pairs(query, _as_list(documents), truncate=truncate, instruction=instruction)
        return finalize_scores(self.run(ids, first), self.info.score_activation, raw=raw)

    def warm_up(self, max_tokens: int | None = None, max_seqs: int = 256) -> dict:
        """Run a few batch shapes before serving, so that their kernels are compiled (Triton) and
        planned (cuBLAS, cuDNN) at start-up rather than while a request waits: on the H200 a new
        sequence bucket compiles three or four kernels and held its batch for 0.85-1.7 s while
        serving (docs/benchmarks.md, "The stall's cause"). The shapes,
        `warm_up_shapes`, span the token counts a batch can have (up to max_tokens, default the
        engine's max_batch_tokens), one sequence and several at each, and the sequence counts up
        to max_seqs. A shape run here counts as the first sight of its graph bucket, so that
        bucket captures when traffic first brings it. Returns what ran and how long it took."""
        started = time.perf_counter()
        shapes = warm_up_shapes(max_tokens or self.max_batch_tokens, min(self.info.max_input_tokens, self.model_dir.config.max_position_embeddings),
                                max_seqs)
        for lengths in shapes:
            rng = np.random.default_rng(len(lengths) * 100_003 + sum(lengths))
            seqs = [rng.integers(0, self.info.vocab_size, size=n, dtype=np.int32) for n in lengths]
            first = [max(1, n // 2) for n in lengths] if self.info.task == "score" else None
            self.step(HostBatch.from_sequences(seqs, first)).numpy()
        return {"shapes": len(shapes), "max_tokens": max(sum(x) for x in shapes), "max_seqs": max(len(x) for x in shapes),
                "seconds": time.perf_counter() - started}

    def step(self, batch: HostBatch) -> LazyTensor:
        """Launch one batch and return at once; the output stays on its way to the host."""
        if self.info.task == "generate":
            raise InputError(f"{self.info.model_name} is a causal LM: use generate()")
        # A bad id or an over-long sequence would fault on the device and take the CUDA context
        # with it; these host checks cost microseconds.
        if batch.num_seqs == 0 or int(batch.seq_lens.min()) < 1:
            raise InputError("a batch needs at least one sequence, and every sequence at least one token")
        if batch.max_seqlen > self.model_dir.config.max_position_embeddings:
            raise InputError(f"a sequence has {batch.max_seqlen} tokens; the model's positions stop at {self.model_dir.config.max_position_embeddings}")
        # One reduction: a negative id read as uint32 is >= 2**31, so it fails the bound too.
        ids, vocab = batch.input_ids, self.info.vocab_size
        if ids.dtype == np.int32:
            out_of_range = int(ids.view(np.uint32).max()) >= vocab
        else:
            out_of_range = int(ids.min()) < 0 or int(ids.max()) >= vocab
        if out_of_range:
            raise InputError(f"token ids must lie in [0, {self.info.vocab_size})")
        return self.runner.step(batch)

    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], *, max_tokens: int = 16, stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False) -> list["GenerationResult"]:
        """Greedy continuations, one per prompt (strings, or token-id lists), in input order.
        Stops at the model's EOS (unless ignore_eos), at any of `stop_token_ids`, or after
        max_tokens new tokens. See florist/engine/generation/ and docs/generation.md."""
        from florist.engine.generation.results import GenerationResult

        self._require("generate")
        if isinstance(prompts, Sequence) and prompts and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompts):
            prompts = [prompts]  # one prompt given as a flat list of token ids
        ids = self.text.encode(_as_list(prompts))
        seqs = self.runner.generate(ids, max_tokens, stop_token_ids or (), ignore_eos=ignore_eos)
        return [GenerationResult.of(seq, self.text) for seq in seqs]

    def close(self) -> None:
        """Release what the engine holds beyond memory (tensor-parallel worker processes)."""
        if hasattr(self.runner, "close"):
            self.runner.close()

    # -- batching ------------------------------------------------------------------------------
    def run(self, ids: list[np.ndarray], first_segment_lens: list[int] | None = None) -> np.ndarray:
        """Model output for each sequence, in input order. Sequences are grouped by length so
        batches are dense; batch N+1 is launched before batch N is waited on."""
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out: np.ndarray | None = None
        pending: list[tuple[list[int], LazyTensor]] = []
        for chunk in _chunks(order, [len(x) for x in ids], self.max_batch_tokens):
            types = [first_segment_lens[i] for i in chunk] if first_segment_lens is not None else None
            pending.append((chunk, self.step(HostBatch.from_sequences([ids[i] for i in chunk], types))))
            if len(pending) > 1:
                out = _scatter(out, *pending.pop(0), len(ids))
        for chunk, lazy in pending:
            out = _scatter(out, chunk, lazy, len(ids))
        assert out is not None
        return out

    def _require(self, task: str) -> None:
        if self.info.task != task:
            what = {"embed": "an embedding model", "score": "a cross-encoder or reranker", "generate": "a causal LM (Qwen3ForCausalLM)"}[task]
            raise InputError(f"{task} needs {what}; {self.info.model_name} is loaded for {self.info.task}")


def _check_batch_tokens(max_batch_tokens: int) -> None:
    if max_batch_tokens < 1:  # 0 would batch one sequence at a time, silently
        raise InputError(f"max_batch_tokens must be at least 1; got {max_batch_tokens}")


def _as_list(x):
    return [x] if isinstance(x, str) else x


def _chunks(order: list[int], lens: list[int], budget: int):
    chunk: list[int] = []
    tokens = 0
    for i in order:
        if chunk and tokens + lens[i] > budget:
            yield chunk
            chunk, tokens = [], 0
        chunk.append(i)
        tokens += lens[i]
    if chunk:
        yield chunk


def _scatter(out: np.ndarray | None, chunk: list[int], lazy: LazyTensor, n: int) -> np.ndarray:
    rows = lazy.numpy()
    if out is None:
        out = np.empty((n, *rows.shape[1:]), dtype=np.float32)
    out[chunk] = rows
    return out
