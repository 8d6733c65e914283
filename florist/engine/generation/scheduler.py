"""Which sequences run in the next generation step: plain Python, no torch (and no numpy).

A sequence owns one KV-cache slot from admission to finish. Steps are either a prefill (new
sequences' whole prompts) or a decode (one new token for every running sequence); sequences join
and leave only between steps (continuous batching):

    waiting (FCFS) ──admit: a free slot, prefill token budget──▶ running ──stop──▶ finished
                                                                   │  (slot freed at once)
    schedule():  waiting and a free slot  -> prefill of the head of the queue (never skips ahead)
                 else running             -> decode of every running sequence
    update(step, tokens): one new token per sequence of the step; a sequence stops at a stop id
                 (EOS or the caller's), or when it has max_tokens new tokens.
    next_decode(step): the decode step to launch *before* `step`'s tokens are known (pipelined
                 decode, generator.py), or None when the next step must wait for them.

Pipelined decode. `version` counts changes of the running set (admission, finish, abort). While
it stays the same and no prefill is due, the decode after a decode step may be launched before
that step's tokens are known, over the same sequences. A sequence the first step finishes (stop
id, max_tokens) does not take the second step's token: `update` skips sequences that are no
longer running. So outputs equal the step-by-step ones and never pass max_tokens. Exactly one
step is unread when next_decode runs, hence its test `len(output) + 2 <= max_tokens`: some
sequence can use the token after the unread one.

Positions and cache layout: a sequence of n tokens (prompt + output) holds k/v of tokens
0 .. n-2 in its slot; the decode step feeds token n-1 at position n-1 and attends to n tokens.
`add` guarantees len(prompt) + max_tokens <= max_model_len, so a slot never overflows.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Sequence as Seq

NEW, WAITING, RUNNING, FINISHED = "new", "waiting", "running", "finished"
FinishReason = Literal["stop", "length", "abort"]
StepKind = Literal["prefill", "decode"]
_ids = itertools.count()


class Sequence:
    """One prompt being continued. `output` holds the new tokens (a stop token included)."""

    __slots__ = ("seq_id", "prompt", "output", "max_tokens", "stop_token_ids", "slot", "status", "finish_reason", "payload")

    def __init__(self, prompt: Seq[int], max_tokens: int, stop_token_ids: Iterable[int] = (), payload: Any = None):
        self.seq_id = next(_ids)
        self.prompt = [int(t) for t in prompt]
        self.output: list[int] = []
        self.max_tokens = int(max_tokens)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.slot: int | None = None
        self.status = NEW
        self.finish_reason: FinishReason | None = None
        self.payload = payload  # the caller's (the server keeps its stream here)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, {self.status}, prompt {len(self.prompt)}, output {len(self.output)}/{self.max_tokens}, slot {self.slot})"


@dataclass
class Step:
    kind: StepKind
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: int = 0  # tokens the model runs: whole prompts (prefill) or one per sequence
    version: int = 0  # the scheduler's running-set version when the step was made


class GenerationScheduler:
    def __init__(self, num_slots: int, max_model_len: int, max_prefill_tokens: int):
        if min(num_slots, max_model_len, max_prefill_tokens) < 1:
            raise ValueError("num_slots, max_model_len and max_prefill_tokens must be >= 1")
        self.num_slots, self.max_model_len, self.max_prefill_tokens = num_slots, max_model_len, max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # A min-heap, lowest slot first: a small batch keeps its k/v in a small part of the cache.
        self._free_slots = list(range(num_slots))
        self.version = 0  # + 1 whenever `running` changes (see the module docstring)

    # -- queue -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.status != NEW:
            raise ValueError(f"{seq} was already added; submit a new Sequence")
        if not seq.prompt:
            raise ValueError("a prompt needs at least one token")
        if seq.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1; got {seq.max_tokens}")
        if len(seq.prompt) + seq.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(seq.prompt)} tokens and max_tokens is {seq.max_tokens}: {len(seq.prompt) + seq.max_tokens} "
                f"tokens, more than max_model_len {self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        seq.status = WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> bool:
        """Drop a waiting or running sequence (between steps); False if it had finished."""
        if seq.status == WAITING:
            self.waiting.remove(seq)
        elif seq.status == RUNNING:
            self.running.remove(seq)
            self._release(seq)
            self.version += 1
        else:
            return False
        seq.status, seq.finish_reason = FINISHED, "abort"
        return True

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- steps -------------------------------------------------------------------------------
    def schedule(self) -> Step | None:
        if self.waiting and self._free_slots:
            step = Step("prefill")
            while self.waiting and self._free_slots:
                seq = self.waiting[0]
                if step.seqs and step.num_tokens + len(seq.prompt) > self.max_prefill_tokens:
                    break  # a prompt over the whole budget still runs, alone
                self.waiting.popleft()
                seq.slot, seq.status = heapq.heappop(self._free_slots), RUNNING
                self.running.append(seq)
                step.seqs.append(seq)
                step.num_tokens += len(seq.prompt)
            self.version += 1
            step.version = self.version
            return step
        if self.running:
            return Step("decode", list(self.running), len(self.running), self.version)
        return None

    def next_decode(self, step: Step) -> Step | None:
        """The decode step after `step`, launched before `step`'s tokens are read: over the same
        sequences, when `step` is a decode, nobody joined or left since it was made, no prefill
        is due (a sequence waiting for a slot that `step` frees is admitted one step later), and
        some sequence has room for a token after `step`'s."""
        if step.kind != "decode" or step.version != self.version or (self.waiting and self._free_slots):
            return None
        for seq in step.seqs:
            if len(seq.output) + 2 <= seq.max_tokens:
                return Step("decode", step.seqs, step.num_tokens, self.version)
        return None  # every sequence ends with `step` at the latest: the token would be dropped

    def update(self, step: Step, tokens: Seq[int]) -> list[Sequence]:
        """Append each sequence's new token (Python ints); returns the sequences that finished
        (slots freed). Sequences no longer running (aborted while the step ran, or finished by the
        step before a pipelined one) are skipped: their token is dropped."""
        if len(tokens) != len(step.seqs):
            raise ValueError(f"{len(tokens)} tokens for a step of {len(step.seqs)} sequences")
        finished = []
        for seq, token in zip(step.seqs, tokens):
            if seq.status != RUNNING:
                continue
            output = seq.output
            output.append(token)
            if token in seq.stop_token_ids:
                seq.finish_reason = "stop"
            elif len(output) >= seq.max_tokens:
                seq.finish_reason = "length"
            else:
                continue
            seq.status = FINISHED
            finished.append(seq)
        if finished:
            self.running[:] = [seq for seq in self.running if seq.status == RUNNING]
            for seq in finished:
                self._release(seq)
            self.version += 1
        return finished

    def _release(self, seq: Sequence) -> None:
        heapq.heappush(self._free_slots, seq.slot)
        seq.slot = None
