"""The generation engine: the scheduler's steps run on the runner (and, at TP > 1, on every rank).

    submit(prompt) ──inbox──▶ step(): drain inbox -> schedule -> pack -> [broadcast] -> runner
                                      -> next ids to the host -> scheduler.update -> sequences

`submit` and `abort` may be called from any thread; they take effect at the next step boundary.
`step` runs one step at a time (a lock), from the caller's thread (`generate`) or the server's
generation thread. Greedy decoding needs each step's ids on the host (who stops?), and they are
the next step's input; waiting for them before launching the next step would leave the device
idle during all host work (scheduling, packing, copies, launch, the wake-up after the sync).

Pipelined decode (vLLM's "async scheduling"). While the running set stays the same, step N+1 is
launched before step N's ids are read: its inputs are step N's, advanced on the device from step
N's next ids (runner.decode_next), so the host needs nothing from step N to launch it. One step
is in flight between calls of `step()`:

    host    launch N | launch N+1 | read N, update | launch N+2 | read N+1, update | ...
    device  ...[ step N         ][ step N+1        ][ step N+2        ][ ...
                                   └ one step() call: returns step N's sequences, leaves N+1 in flight

Invariant: when `step()` returns, at most one step is in flight, launched for sequences that were
all running when it was launched. Reading it (the next call) drops the token of any sequence that
the step before finished (a stop id, max_tokens) or that was aborted since, so outputs are the
step-by-step ones. The dropped step wrote k/v only into that sequence's own slot, at position
num_tokens < max_model_len (prompt + max_tokens <= max_model_len). The slot is handed out again
only by `schedule()`, which runs once that step was read (after `fail_all`, which drops it unread,
the new prefill is queued behind it on the same stream); a prefill writes from position 0 and
decodes mask every row past a sequence's length. Joins, leaves, aborts and prefills flush the
pipeline: the step in flight is read, then steps go one at a time until a decode over an
unchanged set comes again (scheduler.next_decode decides). At TP > 1 rank 0 broadcasts an
ADVANCE step (no payload) and every rank advances its own copy of the same buffer from the same
next ids, so the ranks stay in lockstep. On the CPU the same calls run synchronously (step N+1 is
computed before N is read). `pipelined_decode=False` (GenerationConfig) reads every step before
launching the next.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Sequence as Seq

import numpy as np
import torch

from florist.engine.generation.batch import pack_decode, pack_prefill
from florist.engine.generation.config import GenerationConfig
from florist.engine.generation.decode_graphs import decode_buckets
from florist.engine.generation.runner import ADVANCE, DECODE, PREFILL, GenerationRunner
from florist.engine.generation.scheduler import RUNNING, GenerationScheduler, Sequence, Step
from florist.engine.engine import warm_up_shapes
from florist.engine.staging import PendingTokens
from florist.engine.model_dir import ModelDir
from florist.text import InputError

WARM_UP_NEW_TOKENS = 2  # per warm-up sequence: its prefill, then one decode step


def eos_token_ids(model_dir: ModelDir) -> frozenset[int]:
    """EOS ids from generation_config.json (what transformers' generate stops at), else config.json."""
    path = model_dir.path / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    if eos is None:
        eos = model_dir.config.raw.get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(int(t) for t in (eos if isinstance(eos, list) else [eos]))


def warm_up_rounds(max_tokens: int, max_prompt_len: int, max_num_seqs: int) -> list[list[int]]:
    """The prompt lengths of Generator.warm_up's rounds. A round's prompts are prefilled in one
    step (several where they pass max_prefill_tokens), then decoded together in one step.

    - Prefills: Engine.warm_up's batch shapes (engine.warm_up_shapes): at 64 tokens doubling up
      to max_tokens one prompt and eight, and 1, 2, 4, ... up to max_num_seqs prompts of 16
      tokens, so every sequence bucket of the prefill graphs is met. With fewer than eight slots
      the eight prompts become one per slot, of the same total where they can hold it.
    - Decodes: a round of B prompts decodes B sequences; a round of B prompts of 16 tokens is
      added for every decode bucket B (decode_graphs.decode_buckets) those rounds miss.
    """
    rounds: list[list[int]] = []
    for lengths in warm_up_shapes(max_tokens, max_prompt_len, max_num_seqs):
        if len(lengths) > max_num_seqs:
            total, n = min(sum(lengths), max_num_seqs * max_prompt_len), max_num_seqs
            lengths = [total // n + (i < total % n) for i in range(n)]
        if lengths not in rounds:
            rounds.append(lengths)
    sizes = decode_buckets(max_num_seqs)
    met = {next(b for b in sizes if b >= len(r)) for r in rounds}
    return rounds + [[min(16, max_prompt_len)] * b for b in sizes if b not in met]


@dataclass
class _InFlight:
    """A launched step whose next ids are on their way to the host."""

    step: Step
    tokens: PendingTokens


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
        self.pipelined = config.pipelined_decode
        self._in_flight: _InFlight | None = None  # the step launched last and not yet read

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
        return self._in_flight is not None or self.scheduler.has_work or not self._inbox.empty()

    # -- stepping (one thread at a time) ---------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Read one step's next ids (launching it first when none is in flight, and launching the
        following decode before reading when the pipeline allows); returns the sequences that got
        a new token (finished ones included), each once."""
        with self._lock:
            self._drain_inbox()
            current, self._in_flight = self._in_flight, None
            try:
                if current is None:
                    step = self.scheduler.schedule()
                    if step is None:
                        return []
                    current = self._launch(step)
                if self.pipelined and self._inbox.empty():
                    following = self.scheduler.next_decode(current.step)
                    if following is not None:
                        self._in_flight = self._launch(following, advance=True)
                tokens = current.tokens.tolist()  # waits for `current` only, not the step behind it
            except BaseException:
                self._in_flight = None  # a failed step leaves nothing to read (fail_all follows)
                raise
            stepped = [s for s in current.step.seqs if s.status == RUNNING]
            self.scheduler.update(current.step, tokens)
            return stepped

    def fail_all(self) -> list[Sequence]:
        """Abort every queued and running sequence (after a failed step); returns them."""
        with self._lock:
            self._in_flight = None  # its tokens would go to sequences aborted here
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

    def warm_up(self, max_tokens: int | None = None) -> dict:
        """Before serving: a prefill of every bucket up to max_tokens (default: the prefill graph
        threshold, at most max_prefill_tokens) and a few prompt counts, and a decode of every
        decode bucket (warm_up_rounds), so that their kernels compile now rather than while a
        stream waits. Each bucket gets its first sight (eager); one met twice is captured here,
        the others when traffic brings them again. The rounds go through submit / step like any
        request, so at TP > 1 every rank runs the same steps (and meets the same buckets). Afterwards nothing is queued or
        running and every slot is free; the k/v it leaves in the slots are never attended to (a
        prefill writes a slot from position 0, a decode attends to its sequence's length only).
        Returns what ran and how long it took."""
        if self.has_work:
            raise RuntimeError("warm up before serving: this generator has sequences queued or running")
        started = time.perf_counter()
        graphs = self.runner.prefill_graphs
        limit = self.config.max_prefill_tokens if graphs is None else min(self.config.max_prefill_tokens, graphs.max_tokens)
        new_tokens = min(WARM_UP_NEW_TOKENS, self.max_len - 1)
        rounds = warm_up_rounds(max_tokens or limit, self.max_len - new_tokens, self.config.max_num_seqs)
        rng, vocab, steps = np.random.default_rng(0), self.model_dir.config.vocab_size, 0
        for lengths in rounds:
            seqs = [self.submit(rng.integers(0, vocab, size=n).tolist(), new_tokens, ignore_eos=True) for n in lengths]
            while not all(s.finished for s in seqs):
                self.step()
                steps += 1
        return {"rounds": len(rounds), "steps": steps, "max_tokens": max(sum(r) for r in rounds), "max_seqs": max(len(r) for r in rounds),
                "decode_rows": sorted({self.runner.decode_rows(len(r)) for r in rounds}), "seconds": time.perf_counter() - started}

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

    def _launch(self, step: Step, advance: bool = False) -> _InFlight:
        """Every rank runs the step; its next ids start on their way to rank 0's host."""
        num_seqs = len(step.seqs)
        if advance:
            kind, packed, num_tokens = ADVANCE, None, 0
        elif step.kind == "prefill":
            kind, num_tokens = PREFILL, step.num_tokens
            packed = pack_prefill([s.prompt for s in step.seqs], [s.slot for s in step.seqs], self.max_len)
        else:
            kind, num_tokens = DECODE, self.runner.decode_rows(num_seqs)
            seqs = step.seqs
            packed = pack_decode([s.last_token for s in seqs], [s.num_tokens - 1 for s in seqs], [s.slot for s in seqs], num_tokens,
                                 self.runner.scratch_slot)
        if self.tp is not None:
            self.tp.send(kind, packed, num_tokens, num_seqs)
        next_ids = self.runner.execute(kind, packed, num_tokens, num_seqs)
        return _InFlight(step, self.runner.read_back(next_ids, num_seqs))

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at TP = 1)."""
        if self.tp is not None:
            self.runner.release_graphs()  # before the group goes: they hold its collectives
            self.tp.close()
