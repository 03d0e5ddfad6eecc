"""Process-group setup for ``torchrun`` (DDP) and the single-process default."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int
    world_size: int
    device: torch.device

    @property
    def main(self) -> bool:
        """Rank 0 alone logs, evaluates and writes checkpoints."""
        return self.rank == 0


def setup(device: str) -> DistInfo:
    """Joins the process group when launched by torchrun (``WORLD_SIZE`` > 1): NCCL on CUDA,
    gloo on the CPU; ``device="auto"`` takes ``cuda:LOCAL_RANK`` when CUDA is there."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"train.device={device!r} but this torch has no CUDA device ({torch.__version__}); "
            "use train.device=auto or cpu"
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(rank, world_size, dev)


def teardown(synchronize: bool) -> None:
    """Leaves the process group. ``synchronize`` (a run that ended normally on every rank):
    first wait for every rank, so that none destroys its group while rank 0 still evaluates
    and writes (a gloo rank that did aborted at exit once in CI, after a complete run)."""
    if dist.is_initialized():
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()


def broadcast(obj, info: DistInfo):
    """Rank 0's ``obj`` on every rank."""
    if info.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_sum(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The sum of ``value`` over the ranks (a detached copy; the input is untouched)."""
    value = value.detach().clone()
    if info.world_size > 1:
        dist.all_reduce(value)
    return value
