"""The model runner: everything that touches the device.

Builds the model for the directory's task on the chosen device and dtype, loads and checks its
weights, and runs batches: `step(host_batch)` launches and returns a `LazyTensor` at once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from florist.config import ModelConfig, int_from_env
from florist.engine.batch import HostBatch, RaggedBatch, to_device
from florist.engine.graph_runner import GraphRunner
from florist.engine.lazy import LazyTensor
from florist.engine.loader import check_complete, iter_tensors, load_weights, safetensors_files
from florist.engine.model_dir import ModelDir
from florist.layers.attention import select_backend
from florist.models import ModelBundle, build_model
from florist.models.base import WeightMap

_DENSE_MAP = WeightMap(default_prefix="")


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:  # torch's message lists every device type it knows, not the ones florist runs on
        raise ValueError(f"unknown device {device!r}; florist runs on cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device} is not supported; florist runs on cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for but CUDA is not available; use device='cpu'")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {device} was asked for but {torch.cuda.device_count()} CUDA device(s) are visible (cuda:0..)")
    return device


def make_current(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (a no-op on the CPU and when it
    already is). Kernels launch on the current device, which CUDA keeps per thread, so a model on
    cuda:1 needs this in every thread that runs it: the loading thread, a server's batch thread."""
    if device.type == "cuda" and device.index is not None and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
        if dtype not in names:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(names)}")
        return names[dtype]
    return dtype


def default_graph_max_tokens(cfg: ModelConfig) -> int:
    """Largest batch (in tokens) replayed from a CUDA graph; above it batches run eagerly.

    Graphs pay while launch overhead is a visible share of the step. Measured on the H200
    (`bench/engine.py --only threshold`, docs/benchmarks.md): for the Qwen3-0.6B geometry a graph
    still wins at 16384 tokens (46 ms vs 48 ms eager) and wins 1.6x at 8192. The crossover scales
    with the work per token, so smaller models keep graphs longer, capped to bound graph memory.
    """
    qwen3_06b_flops_per_token = 2 * 0.44e9
    flops_per_token = 2 * cfg.num_layers * (
        cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
        + cfg.hidden_size * cfg.intermediate_size * (3 if cfg.family == "qwen3" else 2)
    )
    tokens = 16384 * qwen3_06b_flops_per_token / max(flops_per_token, 1)
    return -(-int(min(max(tokens, 4096), 32768)) // 256) * 256


def default_split_min_tokens(cfg: ModelConfig) -> int:
    """Fewest tokens from which a graph runs a batch as two halves side by side (graph_runner.py,
    "Halves"); 0: never. FLORIST_GRAPH_SPLIT_MIN_TOKENS sets it for every family (0: off).

    Measured on the H200 (docs/benchmarks.md, "Halves on two streams"), device time per batch in
    a graph, halves against the whole batch: all-MiniLM-L6-v2 +15 % at 1,024 tokens, +5 % at
    4,096, even at 5,120-5,336, -4 % (uniform) and +0.8 % (ragged) at 6,144-6,746, -3 to -10 %
    from ~7,200 to 32,768; the BERT-base geometry -1 to -14 % at 8,192-25,600; the Qwen3-0.6B
    geometry +1 to +5 % at 16,384 (its products fill the device), so other families keep whole
    batches."""
    return int_from_env("FLORIST_GRAPH_SPLIT_MIN_TOKENS", BERT_SPLIT_MIN_TOKENS if cfg.family == "bert" else 0)


BERT_SPLIT_MIN_TOKENS = 7168


class ModelRunner:
    def __init__(self, model_dir: ModelDir, device: torch.device, dtype: torch.dtype, attention_backend: str | None = None, graph_max_tokens: int | None = None):
        self.model_dir, self.device, self.dtype = model_dir, device, dtype
        make_current(device)
        backend = select_backend(attention_backend, device, model_dir.config.head_dim, dtype)
        previous = torch.get_default_dtype()
        try:
            torch.set_default_dtype(dtype)
            with torch.device(device):
                self.model: ModelBundle = build_model(model_dir.config, model_dir.pipeline, backend)
        finally:
            torch.set_default_dtype(previous)
        self._load()
        self.model.eval()
        self.graphs: GraphRunner | None = None
        if device.type == "cuda" and graph_max_tokens != 0 and getattr(backend, "capturable", True):
            self.graphs = GraphRunner(
                self.forward, device,
                max_tokens=graph_max_tokens or default_graph_max_tokens(model_dir.config),
                with_token_types=model_dir.config.family == "bert",
                split_min_tokens=default_split_min_tokens(model_dir.config),
            )

    def _load(self) -> None:
        loaded = load_weights(self.model, iter_tensors(safetensors_files(self.model_dir.path)), self.model.weight_map)
        for k, dense in enumerate(self.model_dir.pipeline.dense):
            files = sorted(Path(dense.path).glob("*.safetensors"))
            loaded |= load_weights(self.model, iter_tensors(files), _DENSE_MAP, prefix=f"head.dense.{k}.")
        check_complete(self.model, loaded)

    @torch.inference_mode()
    def forward(self, batch: RaggedBatch) -> torch.Tensor:
        return self.model(batch)

    @torch.inference_mode()
    def step(self, host: HostBatch) -> LazyTensor:
        """Launch one batch; returns at once (on CUDA) with the output still in flight."""
        if host.num_seqs == 0:
            raise ValueError("a batch needs at least one sequence")
        make_current(self.device)
        if self.graphs is not None and self.graphs.applies(host):
            return LazyTensor.from_device(self.graphs.run(host))
        batch = to_device(host, self.device, pin=self.device.type == "cuda")
        return LazyTensor.from_device(self.forward(batch))
