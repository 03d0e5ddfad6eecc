"""Process-group setup for ``torchrun`` (DDP) and the single-process default."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from datetime import datetime, timedelta

import torch
import torch.distributed as dist

# How long a rank waits for rank 0's launch time in torchrun's store (rank 0 may still be
# importing); rank 0 itself never waits.
LAUNCH_TIME_TIMEOUT_S = 600.0


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


def gather(obj, info: DistInfo) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if info.world_size == 1:
        return [obj]
    objs = [None] * info.world_size
    dist.all_gather_object(objs, obj)
    return objs


def all_sum(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The sum of ``value`` over the ranks (a detached copy; the input is untouched)."""
    value = value.detach().clone()
    if info.world_size > 1:
        dist.all_reduce(value)
    return value


def shares_torchrun_store() -> bool:
    """Whether this process is a rank of a multi-process torchrun launch whose agent keeps a
    store every rank can reach at ``MASTER_ADDR:MASTER_PORT`` (torchrun sets
    ``TORCHELASTIC_USE_AGENT_STORE=True`` then: its c10d and static rendezvous do)."""
    return (
        int(os.environ.get("WORLD_SIZE", "1")) > 1
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and "MASTER_ADDR" in os.environ
        and "MASTER_PORT" in os.environ
    )


@functools.cache
def launch_time() -> datetime:
    """Rank 0's ``datetime.now()``, the same on every rank of this torchrun launch (and in each
    call of a process): rank 0 writes it into the agent's store (``shares_torchrun_store()``
    must hold), under a key of the launch's id (the same for its restarts), and the other ranks
    read it there, so that no rank's path depends on its own clock. Hydra's run directory comes from it
    (``lm.config.launch_time``), before any process group exists.

    Raises TimeoutError when rank 0's time is not there within ``LAUNCH_TIME_TIMEOUT_S``."""
    if not shares_torchrun_store():
        raise RuntimeError(
            "launch_time() needs a multi-process torchrun launch with its agent's store "
            "(WORLD_SIZE > 1, TORCHELASTIC_USE_AGENT_STORE=True, MASTER_ADDR, MASTER_PORT)"
        )
    rank = int(os.environ["RANK"])
    # The launch's id, not its restart count: a restart (torchrun --max-restarts) runs in the
    # launch's directory, where train.resume=true can continue from its last checkpoint.
    key = f"lm/launch_time/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    where = f"torchrun's store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=LAUNCH_TIME_TIMEOUT_S),
        )
        if rank == 0:
            # The first value written stays: a later rendezvous round (a restart, a node
            # joining) finds its launch's time there, which other ranks may have read.
            store.compare_set(key, "", datetime.now().isoformat())
        stamp = store.get(key).decode()
    except dist.DistError as e:  # a timeout, or no store there
        raise TimeoutError(
            f"rank {rank} got no launch time from rank 0 in {where} within "
            f"{LAUNCH_TIME_TIMEOUT_S:g} s ({e}); name the run's directory instead: "
            "hydra.run.dir=..."
        ) from e
    return datetime.fromisoformat(stamp)
