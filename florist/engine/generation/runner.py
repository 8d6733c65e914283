"""One rank's share of generation: the model, its KV cache and decode graphs.

Every rank runs the same calls on the same packed inputs (rank 0 broadcasts them, tp.py), so
every rank writes the same cache slots and computes the same next ids; only rank 0 reads them.

    prefill(packed, T, B) -> next ids [B]      eager: whole prompts, ragged
    decode(packed)        -> next ids [rows]   CUDA graph per bucket when on CUDA, else eager
"""

from __future__ import annotations

import numpy as np
import torch

from florist.engine.generation.batch import decode_batch, prefill_batch, prefill_seq_lens
from florist.engine.generation.config import GenerationConfig
from florist.engine.generation.decode_graphs import DecodeGraphRunner
from florist.engine.generation.kv_cache import KVCache, KVCacheSpec
from florist.engine.loader import check_complete, iter_tensors, load_weights, safetensors_files
from florist.engine.model_dir import ModelDir
from florist.layers.attention import select_backend
from florist.layers.cached_attention import select_decode_backend
from florist.models.qwen3_causal_lm import Qwen3ForCausalLM

PREFILL, DECODE = 1, 2  # step kinds (also on the wire between ranks)


class GenerationRunner:
    def __init__(self, model_dir: ModelDir, device: torch.device, dtype: torch.dtype, config: GenerationConfig, max_len: int,
                 attention_backend: str | None = None, decode_backend: str | None = None):
        cfg = model_dir.config
        if cfg.family != "qwen3" or not cfg.causal:
            raise ValueError(f"generation serves Qwen3 causal LMs; {model_dir.name} is a {cfg.model_type} model")
        self.device, self.dtype, self.max_len = device, dtype, max_len
        backend = select_backend(attention_backend, device, cfg.head_dim, dtype)
        decode = select_decode_backend(decode_backend, device, cfg.head_dim, dtype)
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

    def _to_device(self, packed: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(packed)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def prefill(self, packed: np.ndarray, num_tokens: int, num_seqs: int) -> torch.Tensor:
        seq_lens = prefill_seq_lens(packed, num_tokens, num_seqs)
        return self.model(prefill_batch(self._to_device(packed), num_tokens, num_seqs, seq_lens))

    @torch.inference_mode()
    def decode(self, packed: np.ndarray) -> torch.Tensor:
        if self.graphs is not None:
            return self.graphs.run(packed)
        rows = (packed.shape[0] - 1) // 3
        max_context_len = int(packed[rows : 2 * rows].max()) + 1  # host bound: no device read
        return self._decode_forward(self._to_device(packed), rows, max_context_len)

    def _decode_forward(self, packed: torch.Tensor, rows: int, max_context_len: int) -> torch.Tensor:
        return self.model(decode_batch(packed, rows, self.max_len, max_context_len))

    def execute(self, kind: int, packed: np.ndarray, num_tokens: int, num_seqs: int) -> torch.Tensor:
        if kind == PREFILL:
            return self.prefill(packed, num_tokens, num_seqs)
        if kind == DECODE:
            return self.decode(packed)
        raise ValueError(f"unknown step kind {kind}")
