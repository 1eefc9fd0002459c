"""The pool's ranks and the few collectives they use (torch.distributed: gloo on CPU, nccl on GPU).

The master (rank 0) decides; every other rank follows. Everything that crosses ranks goes through
this module: objects from the master (`broadcast_from_master`, `scatter_from_master`), sums
(`all_reduce_sum_`, `all_reduce_grads_`), and the barrier. With one rank every helper is a no-op,
so single-process callers (tests, benchmarks) run the same code without a process group.
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    """Where this process stands among the pool's ranks (torchrun's RANK / WORLD_SIZE / LOCAL_RANK)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"invalid rank {self.rank} for world_size {self.world_size}")

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "World":
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        )


def pick_device(choice: str, world: World) -> torch.device:
    """`cuda` (one GPU per local rank) or `cpu`; `auto` takes a GPU when there is one."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def init_world(world: World, device: torch.device) -> None:
    """Join the process group (env:// rendezvous from torchrun) when there is more than one rank."""
    if world.world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def destroy_world() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _check_group(world: World) -> bool:
    """True when collectives must run; refuses a world that torch.distributed does not match."""
    if world.world_size == 1:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"world_size {world.world_size} needs torch.distributed initialised")
    actual = (dist.get_rank(), dist.get_world_size())
    if actual != (world.rank, world.world_size):
        raise RuntimeError(
            f"built for rank {world.rank}/{world.world_size}, but torch.distributed says "
            f"rank {actual[0]}/{actual[1]}"
        )
    return True


def barrier(world: World) -> None:
    if _check_group(world):
        dist.barrier()


def broadcast_from_master(obj: T | None, world: World) -> T:
    """The master's `obj` on every rank (pickled; for small objects: plans, run maps, configs)."""
    if not _check_group(world):
        assert obj is not None, "the master must pass the object it broadcasts"
        return obj
    box: list[object] = [obj if world.is_master else None]
    dist.broadcast_object_list(box, src=0)
    return cast(T, box[0])  # what the master put in


def scatter_from_master(per_rank: Sequence[T] | None, world: World) -> T:
    """Rank r gets `per_rank[r]` of the master's list (the master passes one item per rank)."""
    if not _check_group(world):
        assert per_rank is not None and len(per_rank) == 1
        return per_rank[0]
    out: list[object] = [None]
    dist.scatter_object_list(out, list(per_rank) if world.is_master and per_rank is not None else None, src=0)
    return cast(T, out[0])  # one of the master's items


def gather_to_master(obj: T, world: World) -> list[T] | None:
    """Every rank's `obj` in rank order on the master, None on the other ranks (pickled; small objects)."""
    if not _check_group(world):
        return [obj]
    out: list[object] | None = [None] * world.world_size if world.is_master else None
    dist.gather_object(obj, out, dst=0)
    return None if out is None else [cast(T, o) for o in out]


def all_reduce_sum_(tensor: torch.Tensor, world: World) -> None:
    """Sum `tensor` over ranks, in place."""
    if _check_group(world):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


def all_reduce_grads_(params: Sequence[nn.Parameter], world: World) -> None:
    """Sum the gradients of `params` over ranks in one flat buffer (a missing gradient counts as zero)."""
    if not params or not _check_group(world):
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).clone()
        offset += n
