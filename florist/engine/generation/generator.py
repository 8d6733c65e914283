"""The generation engine: the scheduler's steps run on the runner (and, at TP > 1, on every rank).

    submit(prompt) ──inbox──▶ step(): drain inbox -> schedule -> pack -> [broadcast] -> runner
                                      -> next ids to the host -> scheduler.update -> sequences

`submit` and `abort` may be called from any thread; they take effect at the next step boundary.
`step` runs one step at a time (a lock), from the caller's thread (`generate`) or the server's
generation thread. Each step waits for its next ids on the host: greedy decoding needs them to
decide who stops, and they are the next step's input.
"""

from __future__ import annotations

import json
import queue
import threading
from typing import Iterable, Sequence as Seq

import numpy as np
import torch

from florist.engine.generation.batch import pack_decode, pack_prefill
from florist.engine.generation.config import GenerationConfig
from florist.engine.generation.runner import DECODE, PREFILL, GenerationRunner
from florist.engine.generation.scheduler import GenerationScheduler, Sequence, Step
from florist.engine.model_dir import ModelDir
from florist.text import InputError


def eos_token_ids(model_dir: ModelDir) -> frozenset[int]:
    """EOS ids from generation_config.json (what transformers' generate stops at), else config.json."""
    path = model_dir.path / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    if eos is None:
        eos = model_dir.config.raw.get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(int(t) for t in (eos if isinstance(eos, list) else [eos]))


class Generator:
    def __init__(self, model_dir: ModelDir, device: torch.device, dtype: torch.dtype, config: GenerationConfig = GenerationConfig(),
                 attention_backend: str | None = None):
        self.model_dir, self.config, self.dtype = model_dir, config, dtype
        self.max_len = config.model_len(model_dir.config.max_position_embeddings)
        self.eos_token_ids = eos_token_ids(model_dir)
        runner_args = dict(dtype=dtype, config=config, max_len=self.max_len, attention_backend=attention_backend)
        self.tp = None
        if config.tensor_parallel_size > 1:
            from florist.engine.generation.tp import TensorParallelWorkers

            self.tp = TensorParallelWorkers(config.tensor_parallel_size, device.type, dict(runner_args, model_path=str(model_dir.path)))
            device = self.tp.device
        try:
            self.runner = GenerationRunner(model_dir, device, **runner_args)
        except BaseException:
            if self.tp is not None:
                self.tp.ready(False)
            raise
        if self.tp is not None:
            self.tp.ready(True)
        self.device = device
        self.scheduler = GenerationScheduler(config.max_num_seqs, self.max_len, config.max_prefill_tokens)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()

    # -- requests (any thread) -------------------------------------------------------------------
    def submit(self, prompt: Seq[int], max_tokens: int, stop_token_ids: Iterable[int] = (), *, ignore_eos: bool = False, payload=None) -> Sequence:
        """Queue one prompt (token ids); generation stops after a stop id (the model's EOS unless
        ignore_eos, and `stop_token_ids`) or after max_tokens new tokens."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise InputError(f"max_tokens must be an integer >= 1; got {max_tokens!r}")
        stops = set(stop_token_ids) | (set() if ignore_eos else set(self.eos_token_ids))
        seq = Sequence(prompt, max_tokens, stops, payload)
        if not seq.prompt:
            raise InputError("a prompt needs at least one token")
        if len(seq.prompt) + seq.max_tokens > self.max_len:
            raise InputError(
                f"the prompt has {len(seq.prompt)} tokens and max_tokens is {seq.max_tokens}, {len(seq.prompt) + seq.max_tokens} in all; "
                f"this engine holds at most {self.max_len} tokens per sequence (max_model_len); shorten the prompt or lower max_tokens"
            )
        self._inbox.put(("add", seq))
        return seq

    def abort(self, seq: Sequence) -> None:
        self._inbox.put(("abort", seq))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or not self._inbox.empty()

    # -- stepping (one thread at a time) ---------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that got a new token (finished ones included)."""
        with self._lock:
            self._drain_inbox()
            step = self.scheduler.schedule()
            if step is None:
                return []
            kind, packed, num_tokens = self._pack(step)
            if self.tp is not None:
                self.tp.send(kind, packed, num_tokens, len(step.seqs))
            next_ids = self.runner.execute(kind, packed, num_tokens, len(step.seqs))
            self.scheduler.update(step, next_ids[: len(step.seqs)].tolist())
            return step.seqs

    def fail_all(self) -> list[Sequence]:
        """Abort every queued and running sequence (after a failed step); returns them."""
        with self._lock:
            self._drain_inbox()
            seqs = [*self.scheduler.running, *self.scheduler.waiting]
            for seq in seqs:
                self.scheduler.abort(seq)
            return seqs

    def generate(self, prompts: Seq[Seq[int]], max_tokens: int, stop_token_ids: Iterable[int] = (), *, ignore_eos: bool = False) -> list[Sequence]:
        """Run prompts to completion (others submitted meanwhile are served alongside)."""
        stops = list(stop_token_ids)
        seqs = [self.submit(p, max_tokens, stops, ignore_eos=ignore_eos) for p in prompts]
        while not all(s.finished for s in seqs):
            self.step()
        return seqs

    def _drain_inbox(self) -> None:
        while True:
            try:
                what, seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            if what == "add":
                self.scheduler.add(seq)
            else:
                self.scheduler.abort(seq)

    def _pack(self, step: Step) -> tuple[int, np.ndarray, int]:
        if step.kind == "prefill":
            return PREFILL, pack_prefill([s.prompt for s in step.seqs], [s.slot for s in step.seqs], self.max_len), step.num_tokens
        seqs = step.seqs
        rows = self.runner.decode_rows(len(seqs))
        packed = pack_decode([s.last_token for s in seqs], [s.num_tokens - 1 for s in seqs], [s.slot for s in seqs], rows, self.runner.scratch_slot)
        return DECODE, packed, rows

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at TP = 1)."""
        if self.tp is not None:
            self.tp.close()
