"""The processes of a tensor-parallel Engine (``--tp-size N``): this one is rank 0 (the
scheduler, the engine loop, its shard of the target), and ``TPWorkers.start`` spawns ranks
1 .. N-1 (torch.multiprocessing, spawn context). They meet at a TCP rendezvous on 127.0.0.1
(a free port), join one process group (NCCL with rank i on cuda:<base + i>, gloo on the CPU)
and a gloo group for the plans (``runtime/tp_worker.py``). Each worker loads only its shard,
sizes its caches as rank 0 tells it (``build``: rank 0 decides every capacity), builds the
same runner and drafter as rank 0 and then serves rank 0's plans until the "stop" plan.

A worker that fails reports its traceback on a queue and exits; rank 0 names that error the
next time it looks (before every plan, and while waiting for the workers at start).
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from blockspec.args import ArgsError, EngineArgs, ResolvedBackends
from blockspec.cache import CacheLayout, MemoryManager
from blockspec.models.loader import load_target
from blockspec.parallel import TPGroup, init_tp
from blockspec.runtime.model_runner import ModelRunner, RunnerOptions
from blockspec.runtime.tp_worker import MirroredDrafter, MirroredRunner, PlanChannel, TPError, serve
from blockspec.speculative.worker import build_spec_worker

log = logging.getLogger("blockspec")
COLLECTIVE_TIMEOUT_S = 600.0   # a collective waiting longer fails its rank
START_TIMEOUT_S = 600.0        # workers not ready (met, joined, loaded, built) by then: give up
STOP_TIMEOUT_S = 30.0          # a worker still running this long after "stop" is terminated
PLAN_TIMEOUT = timedelta(days=365)   # workers wait for the next plan as long as the engine idles


@dataclass
class WorkerSpec:
    """What a worker needs to build what rank 0 builds (all picklable)."""

    args: EngineArgs
    backends: ResolvedBackends
    dtype: torch.dtype
    device: str                      # "cpu" or "cuda"
    first_gpu: int                   # rank i runs on cuda:<first_gpu + i - first_rank>
    threads: int                     # CPU threads per worker
    timeout: float                   # seconds a collective may wait (COLLECTIVE_TIMEOUT_S)
    first_rank: int = 0              # the first rank on this node (multi-node)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, size: int, addr: str, device: str, timeout: float,
          ep: bool) -> tuple[TPGroup, PlanChannel]:
    tp = replace(init_tp(f"tcp://{addr}", rank=rank, world_size=size,
                         backend="nccl" if device == "cuda" else "gloo", timeout=timeout,
                         rendezvous_timeout=START_TIMEOUT_S), ep=ep)
    plans = dist.new_group(backend="gloo", timeout=PLAN_TIMEOUT)
    return tp, PlanChannel(plans, timeout=timeout if rank == 0 else None)


def _worker_main(rank: int, size: int, addr: str, spec: WorkerSpec, reports: Any) -> None:
    """A worker process: join, load the shard, build on rank 0's word, serve the plans; on
    any failure, report it to rank 0 and exit."""
    try:
        _work(rank, size, addr, spec, reports)
    except BaseException:       # noqa: BLE001 - reported to rank 0, then this process ends
        reports.put(("error", rank, traceback.format_exc()))
        reports.close()
        reports.join_thread()
        sys.stderr.flush()
        os._exit(1)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _work(rank: int, size: int, addr: str, spec: WorkerSpec, reports: Any) -> None:
    logging.basicConfig(level=spec.args.log_level.upper(), format=f"[blockspec tp{rank}] %(message)s")
    if spec.device == "cuda":
        gpu = spec.first_gpu + rank - spec.first_rank
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    else:
        torch.set_num_threads(spec.threads)
        device = torch.device("cpu")
    tp, channel = _join(rank, size, addr, spec.device, spec.timeout, spec.args.ep_size > 1)
    model, _ = load_target(spec.args.model_path, spec.dtype, device, tp=tp)
    _, (name, *build) = channel.recv()
    if name == "stop":              # rank 0 failed before it built anything
        return
    if name != "build":
        raise TPError(f"expected the build plan, got {name!r}")
    sizes, options = build
    memory = MemoryManager(CacheLayout.for_model(model.rank_cfg), dtype=spec.dtype, device=device,
                           **sizes)
    runner = ModelRunner(model, memory, spec.backends, options)
    drafter = (build_spec_worker(spec.args, runner, spec.backends.draft, spec.dtype, device)
               if spec.args.speculative_algorithm else None)
    reports.put(("ready", rank, ""))
    serve(channel, runner, drafter)


class TPWorkers:
    """Rank 0's handle on its workers: the TP group, the plan channel, start and stop."""

    def __init__(self, procs: list, reports: Any) -> None:
        self.procs, self.reports = procs, reports
        self.errors: dict[int, str] = {}
        self.ready_ranks: set[int] = set()
        self.group: TPGroup | None = None
        self.channel: PlanChannel | None = None
        self.runner: MirroredRunner | None = None

    @classmethod
    def start(cls, args: EngineArgs, device: torch.device, dtype: torch.dtype,
              backends: ResolvedBackends) -> TPWorkers:
        size = args.tp_size
        if dist.is_initialized():
            raise ArgsError("tp_size > 1 starts its own worker processes, but torch.distributed "
                            "is already initialized in this process")
        per_node = size // args.nnodes
        first_rank = args.node_rank * per_node       # this node's ranks: first_rank + 0 .. per_node-1
        if device.type == "cuda":
            first = device.index or 0
            if first + per_node > torch.cuda.device_count():
                raise ArgsError(f"tp_size={size} over nnodes={args.nnodes} needs GPUs "
                                f"cuda:{first}..cuda:{first + per_node - 1} here, but "
                                f"{torch.cuda.device_count()} are visible")
            if args.speculative_adaptive:
                raise ArgsError("speculative_adaptive is not supported with tp_size > 1 on CUDA "
                                "(its step-time table is measured by graph replays on rank 0 only)")
        else:
            first = 0
        threads = max(1, (os.cpu_count() or 1) // per_node)
        spec = WorkerSpec(args, backends, dtype, device.type, first, threads, COLLECTIVE_TIMEOUT_S,
                          first_rank)
        ctx = mp.get_context("spawn")
        reports = ctx.Queue()
        addr = args.dist_init_addr or f"127.0.0.1:{_free_port()}"
        local = range(max(first_rank, 1), first_rank + per_node)     # rank 0 is this process
        procs = [ctx.Process(target=_worker_main, args=(r, size, addr, spec, reports),
                             name=f"blockspec-tp{r}", daemon=args.node_rank == 0) for r in local]
        for p in procs:
            p.start()
        if args.node_rank > 0:          # a node of workers only: rank 0 is elsewhere
            return cls(procs, reports)
        self = cls(procs, reports)
        try:
            joined: list = []
            failed: list[str] = []

            def join() -> None:
                try:
                    joined.append(_join(0, size, addr, device.type, spec.timeout,
                                        args.ep_size > 1))
                except Exception as e:  # noqa: BLE001 - named in the TPError below
                    failed.append(f"{type(e).__name__}: {e}")

            t = threading.Thread(target=join, daemon=True)
            t.start()
            self._wait(lambda: not t.is_alive(), "join the process group")
            if not joined:
                raise TPError("rank 0 could not join the tensor-parallel process group: "
                              + (failed[0] if failed else "no reason given"))
            self.group, self.channel = joined[0]
            self.channel.check = self.dead
        except BaseException:
            self.close()
            raise
        return self

    def _wait(self, done, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not done():
            why = self.dead()
            if why is not None:
                raise TPError(f"tensor parallelism: {why}")
            if time.monotonic() > deadline:
                raise TPError(f"tensor parallelism: the workers did not {what} within "
                              f"{START_TIMEOUT_S:.0f} s")
            time.sleep(0.01)

    def _drain(self) -> None:
        """Take the workers' reports: ready, or the traceback they failed with."""
        with contextlib.suppress(queue.Empty, OSError, ValueError):
            while True:
                kind, rank, text = self.reports.get_nowait()
                if kind == "error":
                    self.errors[rank] = text
                else:
                    self.ready_ranks.add(rank)

    def dead(self) -> str | None:
        """Why a worker is gone (its reported error, else its exit code), or None."""
        self._drain()
        for p in self.procs:
            rank = int(p.name.rpartition("tp")[2])
            if rank in self.errors or p.exitcode is not None:
                time.sleep(0.05)            # its report may be a moment behind its exit
                self._drain()
                text = self.errors.get(rank)
                tail = f":\n{text.rstrip()}" if text else f" (exit code {p.exitcode})"
                return f"worker rank {rank} failed{tail}"
        return None

    def build(self, sizes: dict, options: RunnerOptions) -> None:
        """Tell every worker the capacities rank 0 chose (its caches are sized the same). A
        worker may still be loading its shard: this plan waits as long as the start may."""
        self.channel.send("build", sizes, options, wait_s=START_TIMEOUT_S)

    def mirrored_runner(self, *args: Any) -> MirroredRunner:
        self.runner = MirroredRunner(*args, channel=self.channel)
        return self.runner

    def ready(self, drafter: Any) -> Any:
        """Wait until every worker has built its runner; rank 0's drafter, mirrored."""
        def all_ready() -> bool:
            self._drain()
            return len(self.ready_ranks) == len(self.procs)

        self._wait(all_ready, "load and build")
        return MirroredDrafter(drafter, self.runner) if drafter is not None else None

    def close(self, stop: bool = True) -> None:
        """Stop the workers (the "stop" plan unless ``stop`` is False: the loop thread may
        still be inside a plan; then join, and terminate what does not stop) and leave the
        process group. Idempotent; safe after a failure."""
        ch, self.channel = self.channel, None
        sent = False
        if stop and ch is not None and ch.broken is None and all(p.is_alive() for p in self.procs):
            with contextlib.suppress(Exception):
                ch.send("stop")
                sent = True
        # workers told to stop get a while; after a failure they are of no use: end them now
        deadline = time.monotonic() + (STOP_TIMEOUT_S if sent else 0.0)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                if sent:
                    log.warning("tensor-parallel worker %s did not stop; terminating it", p.name)
                p.terminate()
                p.join(1)
            if p.is_alive():             # stopped (SIGSTOP) or ignoring SIGTERM
                p.kill()
                p.join(5)
        self.procs = []
        if self.group is not None:
            self.group = None
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_node(args: EngineArgs, device: torch.device, dtype: torch.dtype,
             backends: ResolvedBackends) -> None:
    """A node other than 0 (``--node-rank`` > 0): start this node's ranks and wait until rank
    0 stops them (its "stop" plan). Raises TPError naming a rank that failed."""
    workers = TPWorkers.start(args, device, dtype, backends)
    try:
        for p in workers.procs:
            p.join()
        why = workers.dead() if any(p.exitcode for p in workers.procs) else None
        if why is not None:
            raise TPError(f"tensor parallelism: {why}")
    finally:
        for p in workers.procs:
            if p.is_alive():
                p.terminate()


def stop_engine(loop: Any, tp: TPWorkers | None) -> None:
    """An Engine's end: its loop thread, then its tensor-parallel workers (no "stop" plan is
    sent beside a loop thread still inside a plan: those workers are terminated)."""
    if loop is not None:
        loop.close()
    if tp is not None:
        tp.close(stop=loop is None or not loop.alive)
