"""Stages 02 and 04 as several processes under torchrun: who this process is, the process group, collectives.

torchrun (`python -m torch.distributed.run`) starts one process per rank and tells each one WORLD_SIZE,
RANK, LOCAL_RANK and LOCAL_WORLD_SIZE. A stage started without it, or with one process, sees a world of
one and runs exactly as it always did: no process group is created and every helper here does nothing.

Process groups: NCCL on GPUs, gloo on the CPU. Stage 02 only ever coordinates (a barrier, small objects),
so it uses gloo even on GPUs, with a long timeout: its ranks wait for each other at the end for as long as
the slowest one extracts. If one rank dies, torchrun stops the others.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

from eagle3_pipeline.errors import UsageError

_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# Collectives wait this long for the other ranks (rank 0 writing a 20 GB checkpoint, a slow shard of stage 02).
TRAINING_TIMEOUT = timedelta(hours=2)
EXTRACTION_TIMEOUT = timedelta(days=7)


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_info() -> RankInfo:
    """This process's place, from torchrun's environment (a world of one without it)."""
    values = {}
    for name in _ENV:
        text = os.environ.get(name)
        if text is None:
            continue
        try:
            values[name] = int(text)
        except ValueError:
            raise UsageError(f"environment variable {name}={text!r} is not an integer; start the stage with torchrun "
                             f"or unset it")
    world = values.get("WORLD_SIZE", 1)
    if world <= 1:
        return RankInfo()
    missing = [name for name in ("RANK", "LOCAL_RANK") if name not in values]
    if missing:
        raise UsageError(f"WORLD_SIZE={world} is set but {', '.join(missing)} is not: start the stage with torchrun "
                         f"(python -m torch.distributed.run), which sets all of them")
    return RankInfo(rank=values["RANK"], world_size=world, local_rank=values["LOCAL_RANK"],
                    local_world_size=values.get("LOCAL_WORLD_SIZE", 1))


def is_main() -> bool:
    return rank_info().is_main


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def init(device_type: str, timeout: timedelta = TRAINING_TIMEOUT, backend: str | None = None) -> RankInfo:
    """Join the process group (NCCL for `device_type` "cuda", else gloo; or `backend`) when run by torchrun
    with several processes; on a GPU, this process's GPU becomes cuda:LOCAL_RANK."""
    info = rank_info()
    if not info.distributed or _initialized():
        return info
    import torch
    import torch.distributed as dist

    backend = backend or ("nccl" if device_type == "cuda" else "gloo")
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
        kwargs["device_id"] = torch.device("cuda", info.local_rank)
    dist.init_process_group(backend, timeout=timeout, **kwargs)
    return info


def shutdown() -> None:
    """Leave the process group (at the end of a stage that succeeded on every rank)."""
    if _initialized():
        import torch.distributed as dist

        dist.destroy_process_group()


@contextmanager
def process_group(device_type: str, timeout: timedelta = TRAINING_TIMEOUT,
                  backend: str | None = None) -> Iterator[RankInfo]:
    """init(), then shutdown() when the block succeeds (after a failure the process just exits: torchrun stops
    the other ranks, and tearing down a group whose peers are gone could hang)."""
    info = init(device_type, timeout, backend)
    yield info
    shutdown()


# --- collectives (no-ops in a world of one) -------------------------------------------------------------

def barrier() -> None:
    if _initialized():
        import torch.distributed as dist

        dist.barrier()


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank (picklable objects)."""
    if not _initialized():
        return obj
    import torch.distributed as dist

    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def from_main(compute: Callable[[], Any]) -> Any:
    """compute() on rank 0 only, its result on every rank (e.g. one scan of a shared folder)."""
    return broadcast_object(compute() if is_main() else None)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (also a barrier)."""
    if not _initialized():
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def all_reduce_sums(tensors: dict[str, Any]) -> dict[str, Any]:
    """Each tensor summed over the ranks, in one collective: metric sums and counts travel this way and are
    divided afterwards, never averaged per rank. The tensors must share one device (the collective's)."""
    if not _initialized() or not tensors:
        return tensors
    import torch
    import torch.distributed as dist

    names = list(tensors)
    flat = torch.cat([tensors[name].detach().reshape(-1).to(torch.float64) for name in names])
    dist.all_reduce(flat)
    out, offset = {}, 0
    for name in names:
        original = tensors[name]
        out[name] = flat[offset:offset + original.numel()].view(original.shape).to(original.dtype)
        offset += original.numel()
    return out


# --- splitting work ------------------------------------------------------------------------------------

def share_by_cost(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """Indices of `costs` for each rank, balancing the summed cost: each item, in the given order, goes to the
    rank with the least so far (lowest rank on ties). Deterministic, so every rank computes the same split;
    items given largest first balance best."""
    loads = [0.0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index, cost in enumerate(costs):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += float(cost)
    return shares


def restrict_gpus_to_local_rank(info: RankInfo) -> list[str] | None:
    """Give this rank its own disjoint group of the node's GPUs through CUDA_VISIBLE_DEVICES, so that a
    verifier sharded with device_map stays inside it: LOCAL_WORLD_SIZE ranks split the visible GPUs evenly
    (8 GPUs, 2 ranks a node: GPUs 0-3 and 4-7). Must run before anything initialises CUDA in this process.
    Returns the group (None when nothing changed: one process, or no GPU)."""
    if not info.distributed:
        return None
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("restrict_gpus_to_local_rank must run before CUDA is initialised")
    count = torch.cuda.device_count()  # NVML-based before initialisation: it does not initialise CUDA
    if count == 0:
        return None
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in listed.split(",") if d.strip()][:count] if listed else [str(i) for i in range(count)]
    per_rank = len(visible) // info.local_world_size
    if per_rank == 0:
        raise UsageError(f"{info.local_world_size} processes on this node but only {len(visible)} visible GPU(s): "
                         f"start at most {len(visible)} processes per node (torchrun --nproc_per_node)")
    group = visible[info.local_rank * per_rank:(info.local_rank + 1) * per_rank]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(group)
    return group
