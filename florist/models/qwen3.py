"""Qwen3 backbones: Qwen3-Embedding (causal, last-token pooling), pplx-embed (bidirectional,
mean pooling) and the Qwen3-Reranker (causal; score read from the "yes"/"no" logits).

Pre-RMSNorm decoder layers with QK-norm and rotary positions, a SwiGLU MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from florist.config import ModelConfig
from florist.engine.batch import RaggedBatch
from florist.kernels import decode_layer, qkv_rope
from florist.kernels.rotary import qk_norm_rope
from florist.layers.attention import Attention, AttentionFn
from florist.layers.embedding import VocabParallelEmbedding
from florist.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from florist.layers.norm import RMSNorm
from florist.layers.rotary import RotaryEmbedding
from florist.models.base import WeightMap


class Qwen3Attention(nn.Module):
    """`attention` builds the core (num_heads, num_kv_heads, head_dim, causal, backend) -> module
    called as (q, k, v, batch): `Attention` for embedders, a KV-cached one for generation."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionFn, attention=Attention):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.total_num_heads, cfg.total_num_kv_heads, bias=cfg.attention_bias)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.total_num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.rotary = rotary
        self.attn = attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.causal, backend)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D]: views into one qkv projection."""
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        return (q.reshape(t, self.num_heads, self.head_dim), k.reshape(t, self.num_kv_heads, self.head_dim),
                v.reshape(t, self.num_kv_heads, self.head_dim))

    def _qkv(self, x: torch.Tensor, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._norm_rope(*self._project(x), batch)

    def _norm_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # QK-norm over head_dim and rotary in one kernel, reading q and k in place inside qkv;
        # with a KV cache (generation) the same launch writes the rotated k and v into it.
        q, k = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, batch.positions, self.rotary.cos_sin_cache,
                            kv_store=self.attn.kv_store(v, batch))
        return q, k, v

    def forward(self, x: torch.Tensor, batch: RaggedBatch, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """-> norm(o_proj(attention(x)), residual): (normed, residual). A decode step where the
        attention backend takes the raw q/k/v runs QK-norm, rotary, the KV store and attention in
        one launch (`decode_with_qk_norm_rope`)."""
        fused = None if self.attn.stores_kv or self.qkv_proj.bias is not None else qkv_rope.qkv_norm_rope(
            x, self.qkv_proj.weight, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, batch.positions, self.rotary.cos_sin_cache,
            self.num_heads, self.num_kv_heads)
        if fused is not None:  # the product, QK-norm and rotary in one launch (Hopper, few rows)
            out = self.attn(*fused, batch, kv_stored=True)
        else:
            q, k, v = self._project(x)
            out = self.attn.decode_with_qk_norm_rope(q, k, v, batch, self.q_norm, self.k_norm, self.rotary.cos_sin_cache)
            if out is None:
                out = self.attn(*self._norm_rope(q, k, v, batch), batch, kv_stored=True)
        return self.o_proj.forward_add_norm(out, residual, norm)

    def forward_last(self, x: torch.Tensor, batch: RaggedBatch, last: torch.Tensor, residual: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every token, the output of each sequence's last token only: [B, H]
        (residual: those tokens' rows)."""
        q, k, v = self._qkv(x, batch)
        return self.o_proj.forward_add_norm(self.attn.forward_last(q, k, v, batch, last), residual, norm)


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """-> norm(down_proj(swiglu(gate_up_proj(x))), residual): (normed, residual)."""
        return self.down_proj.forward_add_norm(self.gate_up_proj.forward_swiglu(x), residual, norm)


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm, with each layer's input already normalised: (h, residual) -> (h, residual) for
    the next layer, where h is the output of the norm that follows it (`next_norm`: the next
    layer's input_layernorm, or the model's final norm). Each product that feeds the residual
    stream runs with the add + RMSNorm after it (`RowParallelLinear.forward_add_norm`):

        h --self_attn--> o_proj --(+ residual)--> post_attention_layernorm --> h
        h --gate_up + SwiGLU--> down_proj --(+ residual)--> next_norm --> h   (to the next layer)

    For few rows on CUDA each of those is one launch (product, sum, norm); otherwise the product
    hands its split-K partials, or its output, to the norm.
    """

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionFn, attention=Attention):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, rotary, backend, attention)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor, batch: RaggedBatch, next_norm: RMSNorm):
        h, residual = self.self_attn(h, batch, residual, self.post_attention_layernorm)
        return self.mlp(h, residual, next_norm)

    def decode_layer_weights(self) -> decode_layer.LayerWeights | None:
        """The layer's tensors for the fused decode step (florist/kernels/decode_layer.py); None
        where it cannot run them: biases, tensor parallelism (its products need all-reduces), or
        norms of different eps."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        eps = self.input_layernorm.eps
        if any(lin.bias is not None or lin.tp_size > 1 for lin in linears) or {attn.q_norm.eps, attn.k_norm.eps,
                                                                              self.post_attention_layernorm.eps} != {eps}:
            return None
        return decode_layer.LayerWeights(
            input_norm=self.input_layernorm.weight, qkv=attn.qkv_proj.weight, q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight,
            o=attn.o_proj.weight, post_norm=self.post_attention_layernorm.weight, gate_up=mlp.gate_up_proj.weight,
            down=mlp.down_proj.weight, eps=eps, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim)

    def forward_last(self, h: torch.Tensor, residual: torch.Tensor, batch: RaggedBatch, next_norm: RMSNorm):
        """The layer for each sequence's last token only (its keys/values still come from every
        token): [T, H] in, [B, H] out. Everything after attention is per token, so computing it
        for B rows instead of T gives those rows exactly."""
        last = batch.last_token_index()
        h, residual = self.self_attn.forward_last(h, batch, last, residual[last], self.post_attention_layernorm)
        return self.mlp(h, residual, next_norm)


class Qwen3Model(nn.Module):
    """Embeddings + decoder layers + final norm -> hidden states [T, H].

        x = embed(ids);  h = layers[0].input_layernorm(x);  residual = x
        layers[i]: (h, residual) -> (h, residual), ending in next_norm = layers[i + 1].input_layernorm,
                   or the final `norm` for the last layer, whose h is the output

    With `last_token_only` (set when the head reads nothing but each sequence's last token:
    last-token pooling, the reranker's yes/no head) the final layer runs attention queries,
    o_proj and the MLP for B last tokens instead of T tokens, and the output is [B, H]
    (`ModelBundle` then hands the head `batch.one_token_per_seq()`). That is ~1/num_layers of
    the work, e.g. ~3 % for 28 layers.
    """

    def __init__(self, cfg: ModelConfig, backend: AttentionFn, attention=Attention):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        # One rotary cache shared by every layer (a buffer, not a parameter).
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, rotary, backend, attention) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.last_token_only = False
        self._decode_stack: decode_layer.DecodeStack | None = None  # made on the first decode step (see _decode_fused)
        self._decode_stack_cache: torch.Tensor | None = None  # the KV cache it was made for

    def forward(self, batch: RaggedBatch) -> torch.Tensor:
        residual = self.embed_tokens(batch.input_ids)
        if getattr(batch, "decode", False):
            fused = self._decode_fused(residual, batch)
            if fused is not None:
                return fused
        h = self.layers[0].input_layernorm(residual)  # the first layer: its input is the residual stream
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for i, (layer, next_norm) in enumerate(zip(self.layers, next_norms)):
            run = layer.forward_last if self.last_token_only and i == len(self.layers) - 1 else layer
            h, residual = run(h, residual, batch, next_norm)
        return h

    def _decode_fused(self, residual: torch.Tensor, batch) -> torch.Tensor | None:
        """A one-row decode step (generation) with every layer in one launch
        (florist/kernels/decode_layer.py), then the final norm; None where that does not apply
        (host-side checks only: the step may be captured in a CUDA graph).

        The layers' pointer table is built once per KV cache, on the first decode step (always
        eager: graphs are captured on a bucket's second sight); None is kept where the layers do
        not fit it, so no later step (or capture) tries again."""
        attn = self.layers[0].self_attn
        if not getattr(getattr(attn.attn, "decode_backend", None), "fuses_qk_norm_rope", False):
            return None
        cos_sin = attn.rotary.cos_sin_cache
        if self._decode_stack_cache is not attn.attn.k_cache:
            self._decode_stack_cache, self._decode_stack = attn.attn.k_cache, self._build_decode_stack(residual, cos_sin)
        stack = self._decode_stack
        if stack is None or not decode_layer.applies(residual):
            return None
        out = decode_layer.qwen3_decode_layers_triton(residual, stack, cos_sin, batch.slots, batch.context_lens, attn.attn.scale)
        return self.norm(out)

    def _build_decode_stack(self, residual: torch.Tensor, cos_sin: torch.Tensor) -> decode_layer.DecodeStack | None:
        weights = [layer.decode_layer_weights() for layer in self.layers]
        if any(w is None for w in weights):
            return None
        caches = [layer.self_attn.attn for layer in self.layers]
        stack = decode_layer.DecodeStack.build(weights, [a.k_cache for a in caches], [a.v_cache for a in caches])
        return stack if stack.fits(residual, cos_sin) else None  # every layer (a misaligned or odd one: the unfused layers)


class YesNoHead(nn.Module):
    """Qwen3-Reranker: score logit = (w_yes - w_no) . h at the last token; only the two LM-head
    rows are kept, so the full [vocab, H] head is never materialised."""

    def __init__(self, cfg: ModelConfig, yes_id: int, no_id: int):
        super().__init__()
        self.token_ids = (yes_id, no_id)
        self.weight = nn.Parameter(torch.empty(2, cfg.hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded[list(self.token_ids)])

    def forward(self, hidden: torch.Tensor, batch: RaggedBatch) -> torch.Tensor:
        last = batch.last_rows(hidden)
        yes_no = torch.nn.functional.linear(last, self.weight).float()
        return (yes_no[:, 0] - yes_no[:, 1]).unsqueeze(1)


def qwen3_weight_map(cfg: ModelConfig, *, reranker: bool) -> WeightMap:
    layer = "layers.{i}."
    renames: dict = {
        layer + "self_attn.q_proj.": ("model.layers.{i}.self_attn.qkv_proj.", "q"),
        layer + "self_attn.k_proj.": ("model.layers.{i}.self_attn.qkv_proj.", "k"),
        layer + "self_attn.v_proj.": ("model.layers.{i}.self_attn.qkv_proj.", "v"),
        layer + "mlp.gate_proj.": ("model.layers.{i}.mlp.gate_up_proj.", 0),
        layer + "mlp.up_proj.": ("model.layers.{i}.mlp.gate_up_proj.", 1),
    }
    ignore: tuple[str, ...] = ()
    also: dict = {}
    if reranker:
        renames["lm_head."] = ("head.", None)
        if cfg.tie_word_embeddings:
            also["embed_tokens.weight"] = (("head.weight", None),)
    else:
        ignore = ("lm_head.",)
    return WeightMap(strip_prefixes=("model.",), renames=renames, ignore=ignore, also=also)


def build(cfg: ModelConfig, pipeline, backend: AttentionFn, head_for_embedding: nn.Module | None):
    """-> (backbone, head, weight map) for the pipeline's task."""
    if pipeline.task == "score":
        if pipeline.reranker_token_ids is None:
            raise ValueError("a Qwen3 reranker needs the 'yes' and 'no' token ids from its tokenizer")
        model = Qwen3Model(cfg, backend)
        model.last_token_only = True
        return model, YesNoHead(cfg, *pipeline.reranker_token_ids), qwen3_weight_map(cfg, reranker=True)
    model = Qwen3Model(cfg, backend)
    model.last_token_only = tuple(pipeline.pooling) == ("lasttoken",)
    return model, head_for_embedding, qwen3_weight_map(cfg, reranker=False)
