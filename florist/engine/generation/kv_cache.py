"""The KV cache: one contiguous slot of `max_len` tokens per running sequence.

    cache [num_layers, 2 (k, v), num_slots + 1, max_len, Hkv, D]    (Hkv: this rank's kv heads)
                                           └ slot num_slots is scratch (decode padding rows)

Allocated once at start-up, zeroed (the torch decode path multiplies stale rows by a zero weight,
which must not meet NaN garbage), and bound to the model's CachedAttention layers in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from florist.layers.cached_attention import CachedAttention


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_slots: int  # sequences at once (the scratch slot comes on top)
    max_len: int  # tokens per slot: prompt + new tokens
    num_kv_heads: int  # per rank
    head_dim: int
    dtype: torch.dtype

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def num_bytes(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return self.num_layers * 2 * (self.num_slots + 1) * self.max_len * self.num_kv_heads * self.head_dim * elem


class KVCache:
    def __init__(self, spec: KVCacheSpec, device: torch.device):
        # FlashAttention takes cache offsets (slot * max_len) as int32.
        if (spec.num_slots + 1) * spec.max_len >= 2**31:
            raise ValueError(f"{spec.num_slots} slots of {spec.max_len} tokens exceed int32 cache offsets; lower max_num_seqs or max_model_len")
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            if spec.num_bytes > free:
                raise ValueError(
                    f"the KV cache needs {spec.num_bytes / 2**30:.1f} GiB ({spec.num_slots} slots x {spec.max_len} tokens) "
                    f"but {free / 2**30:.1f} GiB are free on {device}; lower max_num_seqs or max_model_len"
                )
        self.spec = spec
        self.data = torch.zeros((spec.num_layers, 2, spec.num_slots + 1, spec.max_len, spec.num_kv_heads, spec.head_dim),
                                dtype=spec.dtype, device=device)

    def bind(self, model: nn.Module) -> None:
        layers = [m for m in model.modules() if isinstance(m, CachedAttention)]
        if len(layers) != self.spec.num_layers:
            raise ValueError(f"the model has {len(layers)} cached attention layers; the cache was sized for {self.spec.num_layers}")
        for i, layer in enumerate(layers):
            layer.bind_cache(self.data[i, 0], self.data[i, 1])
