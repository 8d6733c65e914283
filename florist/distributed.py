"""The tensor-parallel process group.

Layers ask this module for their rank and the group size and issue their own collectives; model
files never call `torch.distributed`. Without `init_tensor_parallel` the group is a single rank
and every collective is the identity. The collectives queue work and never read device values on
the host, so they can be captured in CUDA graphs (NCCL).
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
    """Join (or create) the default process group; NCCL on CUDA, gloo on CPU. With NCCL, rank r
    uses GPU r % device_count (one host), made the current device before the group exists."""
    global _GROUP
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise RuntimeError(
            f"torch.distributed is already initialised as rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"not {rank} of {world_size}; call destroy_tensor_parallel() first or pass the existing rank and size"
        )
    _GROUP = TensorParallelGroup(rank=rank, world_size=world_size, group=dist.group.WORLD)
    return _GROUP


def destroy_tensor_parallel(*, abort: bool = False) -> None:
    """Leave the group. NOTE: under NCCL the teardown is collective: every rank must call this at
    about the same time, or the first one waits for the others. `abort`: a peer is gone, so tear
    down without waiting for it (where torch offers that)."""
    global _GROUP
    if dist.is_initialized():
        from torch.distributed import distributed_c10d

        if abort and hasattr(distributed_c10d, "_abort_process_group"):
            distributed_c10d._abort_process_group()
        else:
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
    _all_gather_single(out, x.contiguous(), group=_GROUP.group)
    return out


# torch >= 2.13 names it all_gather_single (and deprecates the old name); 2.11 has only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
