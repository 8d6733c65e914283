"""One rank's share of generation: the model, its KV cache and decode graphs.

Every rank runs the same calls on the same packed inputs (rank 0 broadcasts them, tp.py), so
every rank writes the same cache slots and computes the same next ids; only rank 0 reads them.

    prefill(packed, T, B)  -> next ids [>= B]   whole prompts, ragged; a CUDA graph per bucket
                                                on CUDA at TP 1 (prefill_graphs.py), else eager
    decode(packed, B)      -> next ids [rows]   CUDA graph per bucket when on CUDA, else eager
    decode_next(B)         -> next ids [rows]   the same rows again, inputs advanced on the device
                                                from the last decode's next ids (pipelined decode)
    read_back(ids, B)      -> PendingTokens     async copy to pinned memory + event (rank 0 only)

Nothing here waits for the device: inputs go through a reused pinned buffer
(florist/engine/staging.py) and the host reads next ids only through `read_back`. `decode_next`
is how rank 0 launches step N+1 before it has read step N's ids (generator.py); every rank holds
the same last decode buffer and next ids, so the ranks advance identically and stay in lockstep.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np
import torch

from florist.engine.generation.batch import advance_decode, decode_batch, padded_prefill_batch, prefill_batch, prefill_seq_lens
from florist.engine.generation.config import GenerationConfig
from florist.engine.generation.decode_graphs import DecodeGraphRunner
from florist.engine.generation.kv_cache import KVCache, KVCacheSpec
from florist.engine.generation.prefill_graphs import Key, PrefillGraphRunner
from florist.engine.staging import InputStaging, PendingTokens, TokenReadback
from florist.engine.loader import check_complete, iter_tensors, load_weights, safetensors_files
from florist.engine.model_dir import ModelDir
from florist.engine.runner import default_graph_max_tokens, make_current
from florist.layers.attention import select_backend
from florist.layers.cached_attention import select_decode_backend
from florist.models.qwen3_causal_lm import Qwen3ForCausalLM

PREFILL, DECODE, ADVANCE = 1, 2, 3  # step kinds (also on the wire between ranks); ADVANCE = decode_next


@dataclass
class _LastDecode:
    """The last decode step launched: where decode_next advances from."""

    inputs: torch.Tensor  # int32 [3 * rows + 1] on the device (a graph's static input once captured)
    next_ids: torch.Tensor  # int64 [rows] on the device, written by that step
    rows: int
    num_seqs: int
    max_context_len: int  # host bound on the step's context lengths (sizes the eager torch path)


class GenerationRunner:
    def __init__(self, model_dir: ModelDir, device: torch.device, dtype: torch.dtype, config: GenerationConfig, max_len: int,
                 attention_backend: str | None = None):
        cfg = model_dir.config
        if cfg.family != "qwen3" or not cfg.causal:
            raise ValueError(f"generation serves Qwen3 causal LMs; {model_dir.name} is a {cfg.model_type} model")
        self.device, self.dtype, self.max_len = device, dtype, max_len
        make_current(device)
        backend = select_backend(attention_backend, device, cfg.head_dim, dtype)
        decode = select_decode_backend(config.decode_attention, device, cfg.head_dim, dtype)
        previous = torch.get_default_dtype()
        try:
            torch.set_default_dtype(dtype)
            with torch.device(device):
                self.model = Qwen3ForCausalLM(cfg, backend, decode)
        finally:
            torch.set_default_dtype(previous)
        self._load(model_dir)
        self.model.eval()
        attn = self.model.model.layers[0].self_attn
        self.cache = KVCache(KVCacheSpec(cfg.num_layers, config.max_num_seqs, max_len, attn.num_kv_heads, attn.head_dim, dtype), device)
        self.cache.bind(self.model)
        self.graphs: DecodeGraphRunner | None = None
        if device.type == "cuda" and config.cuda_graphs:
            self.graphs = DecodeGraphRunner(self._decode_forward, device, max_num_seqs=config.max_num_seqs, max_len=max_len)
        self.staging, self.readback = InputStaging(device), TokenReadback(device)
        self.prefill_graphs: PrefillGraphRunner | None = None
        # NOTE: at TP 1 only for now: captured prefills under tensor parallelism (collectives in the
        # graph, as decode graphs have) are not yet checked on several GPUs.
        if device.type == "cuda" and config.cuda_graphs and config.tensor_parallel_size == 1 and getattr(backend, "capturable", True):
            self.prefill_graphs = PrefillGraphRunner(self._prefill_forward, self.staging, max_tokens=default_graph_max_tokens(cfg),
                                                     max_len=max_len, scratch_slot=self.cache.spec.scratch_slot)
        self._last_decode: _LastDecode | None = None

    def _load(self, model_dir: ModelDir) -> None:
        loaded = load_weights(self.model, iter_tensors(safetensors_files(model_dir.path)), self.model.weight_map)
        # A tied LM head *is* the embedding's parameter: loaded with it.
        loaded |= {(alias, None) for alias, source in self.model.tied.items() if (source, None) in loaded}
        check_complete(self.model, loaded)

    @property
    def scratch_slot(self) -> int:
        return self.cache.spec.scratch_slot

    def decode_rows(self, num_seqs: int) -> int:
        """Rows a decode buffer for `num_seqs` sequences is padded to (its graph bucket)."""
        return self.graphs.bucket(num_seqs) if self.graphs is not None else num_seqs

    @torch.inference_mode()
    def prefill(self, packed: np.ndarray, num_tokens: int, num_seqs: int) -> torch.Tensor:
        self._last_decode = None  # the next decode is packed on the host
        seq_lens = prefill_seq_lens(packed, num_tokens, num_seqs)
        if self.prefill_graphs is not None and self.prefill_graphs.applies(num_tokens):
            return self.prefill_graphs.run(packed, num_tokens, num_seqs, seq_lens)
        return self.model(prefill_batch(self.staging.to_device(packed), num_tokens, num_seqs, seq_lens))

    def _prefill_forward(self, packed: torch.Tensor, key: Key) -> torch.Tensor:
        tokens, seqs, longest, exact_single = key
        return self.model(padded_prefill_batch(packed, tokens, seqs, longest, exact_single))

    @torch.inference_mode()
    def decode(self, packed: np.ndarray, num_seqs: int) -> torch.Tensor:
        """A decode step packed on the host (batch.pack_decode), padded to `decode_rows(num_seqs)`."""
        rows = (packed.shape[0] - 1) // 3
        max_context_len = int(packed[rows : rows + num_seqs].max()) + 1  # host bound: no device read
        static = self.graphs.static_input(rows) if self.graphs is not None else None
        return self._run_decode(self.staging.to_device(packed, out=static), rows, num_seqs, max_context_len)

    @torch.inference_mode()
    def decode_next(self, num_seqs: int) -> torch.Tensor:
        """The decode step after the last one, over the same sequences (and rows): its inputs are
        that step's, advanced on the device (batch.advance_decode). No host data, no host wait."""
        last = self._last_decode
        if last is None or last.num_seqs != num_seqs:
            have = "no decode step" if last is None else f"a decode step of {last.num_seqs} sequences"
            raise RuntimeError(f"decode_next for {num_seqs} sequences follows {have}; the scheduler should have packed this step")
        advance_decode(last.inputs, last.next_ids, last.rows, num_seqs)
        return self._run_decode(last.inputs, last.rows, num_seqs, last.max_context_len + 1)

    def _run_decode(self, inputs: torch.Tensor, rows: int, num_seqs: int, max_context_len: int) -> torch.Tensor:
        if self.graphs is not None:
            next_ids, inputs = self.graphs.run(inputs, rows)
        else:
            next_ids = self._decode_forward(inputs, rows, max_context_len)
        self._last_decode = _LastDecode(inputs, next_ids, rows, num_seqs, max_context_len)
        return next_ids

    def _decode_forward(self, packed: torch.Tensor, rows: int, max_context_len: int) -> torch.Tensor:
        return self.model(decode_batch(packed, rows, self.max_len, max_context_len))

    def release_graphs(self) -> None:
        """Drop the captured decode graphs (they hold NCCL work under tensor parallelism: they
        must be gone, on every rank, before the group is torn down)."""
        if self.graphs is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # NOTE: no graph may be freed while a replay of it runs
            self.graphs = self.prefill_graphs = None
            self._last_decode = None
            gc.collect()  # the graphs are freed now, not at some later collection

    def execute(self, kind: int, packed: np.ndarray | None, num_tokens: int, num_seqs: int) -> torch.Tensor:
        """One step on this rank (rank 0 and the tensor-parallel workers make the same calls)."""
        make_current(self.device)
        if kind == ADVANCE:
            return self.decode_next(num_seqs)
        if kind == DECODE:
            return self.decode(packed, num_seqs)
        if kind == PREFILL:
            return self.prefill(packed, num_tokens, num_seqs)
        raise ValueError(f"unknown step kind {kind}")

    def read_back(self, next_ids: torch.Tensor, num_seqs: int) -> PendingTokens:
        """The first `num_seqs` next ids on their way to the host; queue it right after the step."""
        return self.readback.start(next_ids, num_seqs)
