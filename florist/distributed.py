"""The tensor-parallel process group.

Layers ask this module for their rank and the group size and issue their own collectives; model
files never call `torch.distributed`. Without `init_tensor_parallel` the group is a single rank
and every collective is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    group: object | None = None  # torch ProcessGroup when world_size > 1


_GROUP = TensorParallelGroup()


def init_tensor_parallel(rank: int, world_size: int, *, init_method: str, backend: str | None = None) -> TensorParallelGroup:
    """Join (or create) the default process group; NCCL on CUDA, gloo on CPU."""
    global _GROUP
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    _GROUP = TensorParallelGroup(rank=rank, world_size=world_size, group=dist.group.WORLD)
    return _GROUP


def destroy_tensor_parallel() -> None:
    global _GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = TensorParallelGroup()


def tp_group() -> TensorParallelGroup:
    return _GROUP


def tp_rank() -> int:
    return _GROUP.rank


def tp_size() -> int:
    return _GROUP.world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _GROUP.world_size > 1:
        dist.all_reduce(x, group=_GROUP.group)
    return x


def all_gather_dim0(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along dim 0 (rank order); no rearranging copy is needed."""
    if _GROUP.world_size == 1:
        return x
    out = torch.empty((x.shape[0] * _GROUP.world_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=_GROUP.group)
    return out
