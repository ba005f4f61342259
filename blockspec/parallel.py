"""Tensor-parallel state: which rank of how many this process is, its torch.distributed group,
the two collectives a sharded model needs (identity at size 1), and ``Shard``: what part of a
checkpoint tensor a rank holds, read through safetensors' ``get_slice`` so no rank ever holds
the whole tensor. NCCL on CUDA, gloo on the CPU; the transport is torch.distributed's."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel group as the model sees it. ``group`` None with ``size`` > 1 means the
    default (world) group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    # expert parallelism over this group: the MoE's routed experts split by expert (each rank
    # whole experts) instead of inside each expert
    ep: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place (a row-parallel layer's partial outputs)."""
        if self.size > 1:
            x = x.contiguous()
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` (equal shapes) concatenated along ``dim`` in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TPGroup()


def init_tp(init_method: str = "env://", rank: int | None = None,
            world_size: int | None = None, backend: str | None = None,
            timeout: float | None = None, rendezvous_timeout: float | None = None) -> TPGroup:
    """Join (or reuse) the default process group and return the whole world as one TP group.
    With ``env://`` the rank and size come from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT;
    the backend defaults to NCCL when CUDA is present, else gloo. ``timeout`` (seconds) bounds
    every collective: a rank that stops answering fails the others. ``rendezvous_timeout``
    (``tcp://`` with a rank) bounds the meeting separately: ranks that start slowly (spawned
    processes importing torch on a busy machine) must not be held to a short collective
    timeout. Rank 0 then serves the TCP store and waits for every rank to reach it before any
    process group exists."""
    meet = rendezvous_timeout is not None
    if meet and (rank is None or not init_method.startswith("tcp://")):
        raise ValueError(f"init_tp: rendezvous_timeout needs a tcp:// init_method and a rank, "
                         f"got init_method={init_method!r}, rank={rank}")
    if not dist.is_initialized():
        if dist.get_pg_count() > 0:
            # A failed start left torch.distributed's group counter advanced: this process
            # would name its groups differently from fresh ranks and wait on keys they never
            # write. Only a new process starts clean.
            raise RuntimeError("torch.distributed: an earlier process-group start failed in "
                               "this process; start tensor parallelism from a new process")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        kwargs: dict = {} if rank is None else {"rank": rank, "world_size": world_size}
        if timeout is not None:
            kwargs["timeout"] = timedelta(seconds=timeout)
        if meet:
            host, _, port = init_method.removeprefix("tcp://").rpartition(":")
            kwargs["store"] = dist.TCPStore(host, int(port), world_size, is_master=rank == 0,
                                            timeout=timedelta(seconds=rendezvous_timeout),
                                            wait_for_workers=True)
            dist.init_process_group(backend, **kwargs)
        else:
            dist.init_process_group(backend, init_method=init_method, **kwargs)
    return TPGroup(rank=dist.get_rank(), size=dist.get_world_size(), group=None)


@dataclass(frozen=True)
class Shard:
    """This rank's part of one tensor, in *logical* elements along ``dim``: the ``pieces``
    ([start, stop) ranges, concatenated in order) of a logical length ``full``, then ``pad``
    zero rows (a vocabulary that does not divide by the TP size). A stored dimension shorter
    than ``full`` is packed (two FP4 codes a byte, one scale per 16 weights): the ranges are
    divided by the packing factor and must not split a pack. ``zero``: this rank holds zeros
    of the tensor's shape (a row-parallel bias is added once, by rank 0). A 0-d tensor is
    always read whole (per-tensor scales are replicated)."""

    dim: int = 0
    pieces: tuple[tuple[int, int], ...] = ()
    full: int = 0
    pad: int = 0
    zero: bool = False

    def local_shape(self, stored: list[int]) -> list[int]:
        if not stored or self.zero:
            return list(stored)
        factor = self._factor(stored)
        shape = list(stored)
        shape[self.dim] = (sum(b - a for a, b in self.pieces) + self.pad) // factor
        return shape

    def read(self, part, stored: list[int]) -> torch.Tensor:
        """The rank's tensor from a safetensors slice object ``part`` of shape ``stored``
        (not 0-d, not ``zero``: those the loader reads whole or fills itself)."""
        factor = self._factor(stored)
        lead = (slice(None),) * self.dim
        chunks = []
        for a, b in self.pieces:
            if a % factor or b % factor:
                raise ValueError(f"tensor-parallel slice [{a}, {b}) splits a pack of {factor} "
                                 "elements (a scale group); choose a TP size that keeps whole "
                                 "groups per rank")
            chunks.append(part[lead + (slice(a // factor, b // factor),)])
        if self.pad:
            shape = list(chunks[0].shape)
            shape[self.dim] = self.pad // factor
            chunks.append(torch.zeros(shape, dtype=chunks[0].dtype))
        return torch.cat(chunks, dim=self.dim)

    def _factor(self, stored: list[int]) -> int:
        size = stored[self.dim]
        if self.full % size:
            raise ValueError(f"stored length {size} does not pack logical length {self.full}")
        return self.full // size
