"""Weight loading: declared (the model's `WeightMap`), then checked.

Every checkpoint tensor must map to a parameter (or be declared ignored), and every parameter
(every shard of a fused one) must be filled; otherwise the error names the tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from florist.config import UnsupportedModelError
from florist.models.base import ShardId, WeightMap


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: `model.safetensors`, or the shards its index names."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = [p.name for p in model_dir.glob("*.bin")]
        hint = f" (found {bins}; convert them to safetensors)" if bins else ""
        raise UnsupportedModelError(f"no *.safetensors weights in {model_dir}{hint}")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(module: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], weight_map: WeightMap, *, prefix: str = "") -> set[tuple[str, ShardId]]:
    """Copy tensors into `module`'s parameters; returns the (parameter, shard) pairs filled."""
    params = dict(module.named_parameters())
    loaded: set[tuple[str, ShardId]] = set()
    unexpected: list[str] = []
    for name, tensor in tensors:
        for target, shard in weight_map.targets(name):
            target = prefix + target
            param = params.get(target)
            if param is None:
                unexpected.append(f"{name} (-> {target})")
                continue
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}; parameter {target} has {tuple(param.shape)}")
                param.data.copy_(tensor)
            elif shard is None:
                loader(param, tensor.to(param.dtype))
            else:
                loader(param, tensor.to(param.dtype), shard)
            loaded.add((target, shard))
    if unexpected:
        raise UnsupportedModelError(f"checkpoint tensors that the model does not use: {', '.join(unexpected[:10])}" + (" ..." if len(unexpected) > 10 else ""))
    return loaded


def _shards_of(module: nn.Module) -> tuple[ShardId, ...]:
    from florist.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(module, QKVParallelLinear):
        return ("q", "k", "v")
    if isinstance(module, MergedColumnParallelLinear):
        return tuple(range(len(module.output_sizes)))
    return (None,)


def check_complete(module: nn.Module, loaded: set[tuple[str, ShardId]]) -> None:
    """Every parameter filled; a fused parameter by every one of its shards."""
    missing = []
    for mod_name, mod in module.named_modules():
        for p_name, _ in mod.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            missing += [f"{name}[{s}]" if s is not None else name for s in _shards_of(mod) if (name, s) not in loaded]
    if missing:
        raise UnsupportedModelError(
            f"weights missing from the checkpoint: {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else "")
        )
