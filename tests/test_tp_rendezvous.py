"""The tensor-parallel rendezvous (``parallel.init_tp``): a rank that starts late must not be
held to the short collective timeout, and a failed start must leave the process able to try
again or say plainly why it cannot. Each case runs in spawned processes, because a failed start
in the test process would break every later distributed test in it."""
from __future__ import annotations

import contextlib
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from blockspec.parallel import init_tp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _late_rank(port: int, delay: float, results) -> None:
    time.sleep(delay)
    tp = init_tp(f"tcp://127.0.0.1:{port}", rank=1, world_size=2, backend="gloo", timeout=3.0,
                 rendezvous_timeout=60.0)
    results.put(("rank1", tp.all_reduce(torch.tensor([2.0])).item()))
    torch.distributed.destroy_process_group()


def _rank0_retry(lonely: int, port: int, results) -> None:
    """Rank 0: first a meeting nobody comes to (must fail within its own timeout), then one
    whose rank 1 arrives long after the 3 s collective timeout (must succeed)."""
    t = time.monotonic()
    try:
        init_tp(f"tcp://127.0.0.1:{lonely}", rank=0, world_size=2, backend="gloo", timeout=1.0,
                rendezvous_timeout=1.0)
        results.put(("lonely", "joined alone"))
    except Exception as e:  # noqa: BLE001 - the failure is the expected outcome
        results.put(("lonely", f"{type(e).__name__} after {time.monotonic() - t:.1f} s"))
    tp = init_tp(f"tcp://127.0.0.1:{port}", rank=0, world_size=2, backend="gloo", timeout=3.0,
                 rendezvous_timeout=60.0)
    results.put(("rank0", tp.all_reduce(torch.tensor([1.0])).item()))
    torch.distributed.destroy_process_group()


def _poisoned(port: int, other: int, results) -> None:
    """A start that fails inside torch's own rendezvous (no ``rendezvous_timeout``) advances
    its group counter; the next start in this process must refuse, not hang."""
    with contextlib.suppress(Exception):      # expected: nobody joins
        init_tp(f"tcp://127.0.0.1:{port}", rank=0, world_size=2, backend="gloo", timeout=1.0)
    assert not torch.distributed.is_initialized()
    t = time.monotonic()
    try:
        init_tp(f"tcp://127.0.0.1:{other}", rank=0, world_size=2, backend="gloo", timeout=1.0,
                rendezvous_timeout=60.0)
        results.put("joined")
    except RuntimeError as e:
        results.put(f"{e} ({time.monotonic() - t:.1f} s)")


def _gather(results, n: int, timeout: float = 120.0) -> dict:
    return dict(results.get(timeout=timeout) for _ in range(n))


def test_late_rank_joins_and_failed_meeting_can_be_retried() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank0_retry, args=(_free_port(), port, results)),
             ctx.Process(target=_late_rank, args=(port, 10.0, results))]
    for p in procs:
        p.start()
    try:
        got = _gather(results, 3)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got["lonely"].startswith(("DistStoreError", "RuntimeError", "TimeoutError")), got
    assert float(got["lonely"].split(" after ")[1].split()[0]) < 20, got
    assert got["rank0"] == 3.0 and got["rank1"] == 3.0, got
    assert [p.exitcode for p in procs] == [0, 0]


def test_start_after_a_failed_torch_rendezvous_refuses_instead_of_hanging() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=_poisoned, args=(_free_port(), _free_port(), results))
    p.start()
    try:
        got = results.get(timeout=120)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert "earlier process-group start failed" in got, got
    assert float(got.rsplit("(", 1)[1].split()[0]) < 5, got


def test_rendezvous_timeout_without_a_tcp_meeting_is_refused() -> None:
    """It would be ignored by env:// (torch's own rendezvous): say so instead of dropping it."""
    for method, rank in (("env://", 0), ("tcp://127.0.0.1:1", None)):
        with pytest.raises(ValueError, match="rendezvous_timeout needs a tcp:// init_method"):
            init_tp(method, rank=rank, world_size=2, rendezvous_timeout=1.0)
    assert not torch.distributed.is_initialized() and torch.distributed.get_pg_count() == 0
