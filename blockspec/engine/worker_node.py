"""A tensor-parallel node other than node 0 (``--nnodes N --node-rank R --dist-init-addr
HOST:PORT``, sglang's flags): it runs only its ``tp_size / nnodes`` ranks, which join node 0's
rendezvous and serve rank 0's plans; node 0 holds the scheduler and the server. It returns
when rank 0 stops the ranks (the engine's shutdown), or raises naming a rank that failed."""
from __future__ import annotations

from typing import Any

from blockspec.args import ArgsError, EngineArgs
from blockspec.checkpoint import read_config, resolve_dtype
from blockspec.engine.engine import engine_backends, resolve_device
from blockspec.engine.tp_launch import run_node


def run_worker_node(**kwargs: Any) -> None:
    """``kwargs``: the EngineArgs of every node (model_path, tp_size, nnodes, ...) with this
    node's ``node_rank`` (> 0)."""
    args = EngineArgs.from_kwargs(**kwargs)
    if args.node_rank == 0:
        raise ArgsError("node_rank 0 schedules and serves: build an Engine there")
    device = resolve_device(args.device)
    backends = engine_backends(args, device, args.speculative_algorithm)
    dtype = resolve_dtype(args.dtype, read_config(args.model_path), device)
    run_node(args, device, dtype, backends)
