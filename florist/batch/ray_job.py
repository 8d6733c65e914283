"""The job on Ray Data: the same parts, files and checks as the local run, spread over a cluster.

    from_items([part k, ...])                  one block per pending part
      .map_batches(read_and_tokenize)          CPU tasks: read part k from INPUT, tokenize it
      .map_batches(EngineActor, N actors)      actor pool: one engine per GPU (num_gpus=1),
                                               or CPU actors when the cluster has no GPU
      .iter_batches()                          the driver: rows regrouped by part, sorted by line,
                                               written as part files, appended to the result

Ray streams between the stages, so with GPU actors tokenizing overlaps the engines (for CPU
actors Ray fuses both stages into the actors: same resources, nothing to overlap). Ray may cut and reorder
batches; rows carry (part, line), so the driver restores parts and order. The driver writes every
file, so OUTPUT only has to exist where the driver runs; INPUT and the model directory must be
readable at the same path on every node (a shared filesystem), and florist installed there.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from florist.batch.embedder import Embed, OutputOptions, Tokenize
from florist.batch.plan import InputPlan, InputSpec
from florist.batch.reader import read_part
from florist.batch.store import PartResult
from florist.engine.model_dir import read_model_dir
from florist.text import TextProcessor


@functools.lru_cache(maxsize=4)
def _text_processor(model: str | None) -> TextProcessor:
    # Cached per worker process: Ray reuses workers, and a large tokenizer takes a while to load.
    md = read_model_dir(model)
    return TextProcessor(str(md.tokenizer_file), md.config, md.pipeline)


def read_and_tokenize(batch: pa.Table, *, spec: InputSpec, plan: InputPlan, model: str | None, prompt: str, truncate: bool) -> pa.Table:
    tokenize = Tokenize(_text_processor(model), prompt, truncate)
    return pa.concat_tables([tokenize(read_part(spec, plan, k)) for k in batch.column("part").to_pylist()])


class EngineActor:
    def __init__(self, *, model: str | None, device: str, dtype: str | None, batch_tokens: int, output: OutputOptions):
        from florist import Engine

        self.embed = Embed(Engine.from_pretrained(model, device=device, dtype=dtype, max_batch_tokens=batch_tokens), output)

    def __call__(self, tokenized: pa.Table) -> pa.Table:
        return self.embed(tokenized)


class RayRunner:
    def __init__(self, cfg, spec: InputSpec):
        try:
            import ray
            import ray.data  # Ray Data is the `ray[data]` extra
        except ImportError:
            raise ValueError("--ray needs Ray Data: pip install 'florist[ray]'") from None
        import torch

        # NOTE: the engine's own rule for its output width, so the driver needs no weights
        from florist.engine.engine import _output_dim
        from florist.engine.runner import resolve_dtype

        if cfg.device not in (None, "cpu", "cuda"):
            raise ValueError(f"--device {cfg.device} names one device; with --ray use cuda (one actor per GPU) or cpu")
        self.cfg, self.spec = cfg, spec
        # Workers resolve the model path themselves: the default model's wheel may live elsewhere there.
        self.model = str(Path(cfg.model).resolve()) if cfg.model else None
        self.model_dir = read_model_dir(self.model)
        self.text = _text_processor(self.model)
        self.model_dim = _output_dim(self.model_dir)
        self._started = not ray.is_initialized()
        if self._started:
            ray.init(address=cfg.address, include_dashboard=False, log_to_driver=False)
        gpus = ray.cluster_resources().get("GPU", 0)
        self.use_gpu = gpus >= 1 and cfg.device != "cpu"
        if cfg.device == "cuda" and not self.use_gpu:
            self.close()
            raise ValueError("--device cuda was asked for but the Ray cluster has no GPU; use --device cpu")
        self.replicas = cfg.num_replicas or (int(gpus) if self.use_gpu else 1)
        self.dtype = str(resolve_dtype(cfg.dtype, torch.device("cuda" if self.use_gpu else "cpu"))).removeprefix("torch.")

    def run(self, plan: InputPlan, pending: list[int], tokenize: Tokenize, output: OutputOptions, sink) -> None:
        import ray

        ray.data.DataContext.get_current().enable_progress_bars = False  # ours is on the driver
        model = self.model
        ds = ray.data.from_items([{"part": k} for k in pending], override_num_blocks=len(pending))
        ds = ds.map_batches(
            read_and_tokenize, batch_size=1, batch_format="pyarrow", num_cpus=1,
            fn_kwargs=dict(spec=self.spec, plan=plan, model=model, prompt=tokenize.prompt, truncate=tokenize.truncate),
        )
        ds = ds.map_batches(
            EngineActor, batch_size=plan.part_rows, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=self.replicas),
            num_gpus=1 if self.use_gpu else 0, num_cpus=1,
            fn_constructor_kwargs=dict(model=model, device="cuda" if self.use_gpu else "cpu", dtype=self.cfg.dtype,
                                       batch_tokens=self.cfg.batch_tokens, output=output),
        )
        parts = _Regroup(plan, sink)
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            parts.add(batch)
        parts.check_complete(pending)

    def close(self) -> None:
        if self._started:
            import ray

            ray.shutdown()
            self._started = False


class _Regroup:
    """Rows back into parts: a part is written once all its records have arrived."""

    def __init__(self, plan: InputPlan, sink):
        self.plan, self.sink = plan, sink
        self.pieces: dict[int, list[pa.Table]] = {}
        self.counts: dict[int, int] = {}
        self.written: set[int] = set()

    def add(self, batch: pa.Table) -> None:
        for k in pc.unique(batch.column("part")).to_pylist():
            rows = batch.filter(pc.equal(batch.column("part"), k))
            self.pieces.setdefault(k, []).append(rows)
            self.counts[k] = self.counts.get(k, 0) + rows.num_rows
            if self.counts[k] == self.plan.part_records(k):
                self._complete(k)

    def _complete(self, k: int) -> None:
        rows = pa.concat_tables(self.pieces.pop(k))
        rows = rows.take(pc.sort_indices(rows, [("line", "ascending")]))
        self.sink.check(rows)
        self.sink.write(PartResult.from_rows(k, self.plan.part_records(k), rows))
        self.written.add(k)

    def check_complete(self, pending: list[int]) -> None:
        missing = sorted(set(pending) - self.written)
        if missing:
            raise RuntimeError(f"Ray returned incomplete parts {missing[:10]}; run the same command again to redo them")
