"""Launch-config sweep of the W4A16 v2 kernel at decode shapes, and the tuned table it feeds.

    python scripts/bench_w4a16_decode.py --out w4a16_decode.json \\
        [--write-table w4a16_tuned.json] [--jobs 16] [--quick] [--problems NAME ...]
    python scripts/bench_w4a16_decode.py --plan        # the grid and its size, no GPU needed
    python scripts/bench_w4a16_decode.py --tuned-only --out F   # only what a model launches

Why: at decode a W4A16 call moves only 2-10 MB (Lightning at batch 1: 93 calls of ~15 us), so
its time is set by tile shape, split-K, warps and pipeline depth, not by bandwidth.  The
problems are the ones a decode step runs (Nemotron-3.5-Lightning, 128 experts, top-6):

- routed experts: ``pair_w4a16`` (one block per pair, deduplicating over several tokens, as
  ``MoE.routed_pairs`` calls it) for 6, 24 and 36 pairs (1, 4, 6 tokens), up 1856x2688 (x is
  one row per token) and down 2688x1856 (one x row per pair);
- shared expert: dense ``w4a16_linear`` at M = 1, 4, 6, up 3712x2688 and down 2688x3712;
- lm_head: dense 131072x2688 at M = 1, 4, 8 (8: a width-8 verify and the draft's head);
- the published-size draft's fused projections (``DRAFT_SHAPES``) at M = 4 and 8.

The grid is ``AXES`` less what the launcher rejects or what cannot help (``plan_configs``
counts why): 600-1500 points per problem, ~15.5k in all, too many kernels to compile in
minutes.  So the default search is staged: every tile x split at the built-in warps and
3 stages (~1.7k points), then every warps x stages of the ``--beam`` fastest tiles (<= 2.5k
points, ~1.7k kernels in all, ~3-4 min on an H200 host); ``--search grid`` times all of it
(~17 min) and ``--plan`` prints the counts.  Each point is checked against the torch
reference (rel err <= 1e-2), then timed by CUDA-graph replay (``graph_time_ms``).  GB/s
counts the bytes a call must move: packed weight + E4M3 scales of the experts it touches,
x and y.  Kernels are compiled first in ``--jobs`` processes (Triton's disk cache is shared);
a config whose compile or first run fails there is recorded and never run in this process.

L2: an H200's 50 MB L2 holds one call's weights, but the model streams other weights between
two calls of a layer, so each timed graph cycles through enough weight copies (dense) or expert
draws (grouped) to move twice the L2 between repeats; ``--hot-l2`` repeats one call instead.

``--write-table`` writes the best config per problem class in the format
``blockspec/kernels/w4a16_tuned.json`` has (copy it there to make it the default); with
``--merge`` it starts from the shipped table's entries, so a sweep of a few problems adds or
replaces only their classes.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockspec.kernels import tile_counters  # noqa: E402
from blockspec.kernels import w4a16 as tw  # noqa: E402
from blockspec.kernels import w4a16_tuned as tt  # noqa: E402

EXPERTS, TOP_K, BLOCK_M = 128, 6, 16   # Lightning's routing; pair_w4a16's rows per block
SHARED_PARTS = 2                       # the shared expert (3712 = 2 x 1856) rides as 2 slices
TOL = 1e-2
H200_SMS = 132                         # --plan without a GPU plans for an H200
# The grid.  split_k None ("auto", ``_pick_split_k``) is resolved to the split it launches, so
# it adds no point of its own; the points whose split is auto's choice are marked auto_split.
AXES = {"block_n": (16, 32, 64, 128), "block_k": (64, 128, 256), "k_slices": (1, 2, 4),
        "split_k": (None, 1, 2, 4, 8, 16), "num_warps": (1, 2, 4, 8),
        "num_stages": (2, 3, 4, 5), "maxnreg": (None, 128, 96)}
QUICK_AXES = {"block_n": (32, 64), "block_k": (128,), "k_slices": (1,),
              "split_k": (None, 1, 2, 4), "num_warps": (4,), "num_stages": (3,),
              "maxnreg": (None,)}
# Pruning bounds ("obviously" bad, not rejected by the launcher):
MAX_WEIGHTS_PER_THREAD = 256   # weights per thread and K step: 512 spills registers on sm_90
                               # in every tile tried (ptxas), 256 only in some
MAX_CTAS_PER_SM = 32           # an SM holds <= 32 CTAs: a split past that only adds partials
SMEM_BYTES = 227 * 1024        # per-block shared memory of an H100/H200 (launch fails above)
# Rough costs for the runtime estimate printed up front (H200 host, 16 cores).
COMPILE_S, POINT_S, STARTUP_S = 1.0, 0.02, 40.0


# ------------------------------------------------------------------------------- problems
@dataclass(frozen=True)
class Problem:
    """One decode call: ``m`` rows of x (dense: tokens; grouped: (token, expert) pairs, one row
    block each, ``m`` a multiple of TOP_K), weight N x K, ``experts`` stacked for grouped."""
    name: str
    kind: str                 # "dense" | "grouped"
    n: int
    k: int
    m: int
    experts: int = 0
    repeat_x: bool = False    # grouped up: x is one row per token (not per pair)
    shared: int = 0           # grouped: the shared expert's slices riding in the launch (MoE)

    @property
    def grouped(self) -> bool:
        return self.kind == "grouped"

    @property
    def blocks(self) -> int:
        """Blocks of the launch: dense row blocks; grouped, one per pair plus the shared
        slices' (one each under dedup, else one per token and slice), as pair_w4a16 counts."""
        if not self.grouped:
            return -(-self.m // BLOCK_M)
        tokens = self.m // TOP_K
        return self.m + self.shared * (1 if self.dedup else tokens)

    @property
    def dedup(self) -> bool:
        """pair_w4a16's dedup, chosen as MoE.routed_pairs chooses it."""
        return self.grouped and 1 < self.m // TOP_K <= tw.PAIR_DEDUP_MAX_TOKENS

    @property
    def key(self) -> str:
        """The tuned-table key this problem's best config is stored under."""
        if self.grouped:
            return tt.problem_key(self.n, self.k, BLOCK_M, self.blocks)
        return tt.problem_key(self.n, self.k, self.m)

    @property
    def weight_bytes(self) -> int:
        """Packed E2M1 + E4M3 scales of one N x K weight."""
        return self.n * self.k // 2 + self.n * self.k // 16


# The published-size Nemotron 3.5 draft's W4A16 calls (bench/draft_presets.py at Lightning's
# shapes), fused as the serving draft runs them: q/k/v, o, gate/up, down. Its forward runs a
# block of rows: 8 for DFlash, 4 for DSpark at gamma 3 (batch 1).
DRAFT_SHAPES = {"draft_qkv": (6144, 2688), "draft_o": (2688, 4096),
                "draft_gate_up": (10752, 2688), "draft_down": (2688, 5376)}


def decode_problems() -> list[Problem]:
    """The W4A16 calls of a Lightning decode / speculative-verify step (module docstring)."""
    out = []
    for proj, (n, k) in (("expert_up", (1856, 2688)), ("expert_down", (2688, 1856))):
        out += [Problem(f"{proj}/pairs={t * TOP_K}", "grouped", n, k, t * TOP_K, EXPERTS,
                        repeat_x=proj == "expert_up", shared=SHARED_PARTS) for t in (1, 4, 6)]
    for proj, (n, k) in (("shared_up", (3712, 2688)), ("shared_down", (2688, 3712))):
        out += [Problem(f"{proj}/M={m}", "dense", n, k, m) for m in (1, 4, 6)]
    out += [Problem(f"lm_head/M={m}", "dense", 131072, 2688, m) for m in (1, 4, 8)]
    for proj, (n, k) in DRAFT_SHAPES.items():
        out += [Problem(f"{proj}/M={m}", "dense", n, k, m) for m in (4, 8)]
    return out


def random_nvfp4(shape: tuple[int, ...], gen: torch.Generator, device: torch.device | str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random packed NVFP4 weights [.., N, K] (any byte is a valid pair of E2M1 codes, in either
    layout: the kernel's is a permutation of the checkpoint's words; block
    scales in [0.5, 4)): made directly, since quantizing 128 experts per worker costs more
    than the speed of a kernel that never looks at the values could tell apart."""
    *lead, n, k = shape
    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, device=device,
                           dtype=torch.uint8)
    scale = (torch.rand(*lead, n, k // 16, generator=gen, device=device) * 3.5 + 0.5
             ).to(torch.float8_e4m3fn)
    scale2 = torch.full(tuple(lead), 0.01, dtype=torch.float32, device=device)
    return packed, scale, scale2


@dataclass
class Built:
    """A problem's tensors on a device: ``variants`` are the argument sets the timed graph
    cycles through (weight copies or expert draws), ``ref`` the reference of variant 0."""
    problem: Problem
    variants: list[tuple]
    bytes_per_call: float
    ref: torch.Tensor | None = None

    def call(self, cfg: dict, variant: int = 0) -> Callable[[], torch.Tensor]:
        p = self.problem
        if p.grouped:
            x, ids, w, s, s2 = self.variants[variant]
            return lambda: tw.pair_w4a16(x, ids, w, s, s2, x_per_pair=not p.repeat_x,
                                         dedup=p.dedup, distinct=True, shared_parts=p.shared,
                                         **cfg)
        x, w, s, s2 = self.variants[variant]
        return lambda: tw.w4a16_linear(x, w, s, s2, variant="v2", **cfg)

    def cycled(self, cfg: dict) -> Callable[[], torch.Tensor]:
        """One callable that runs the next variant on each call (for the captured graph)."""
        calls = [self.call(cfg, i) for i in range(len(self.variants))]
        state = {"i": 0}

        def run() -> torch.Tensor:
            state["i"] += 1
            return calls[(state["i"] - 1) % len(calls)]()

        run.config = cfg  # lets a test's fake timer tell configs apart
        return run


def rotation(problem: Problem, l2_bytes: int, hot: bool) -> int:
    """Variants to cycle so that repeats of one call are >= 2 x L2 apart (1 if ``hot``)."""
    if hot or l2_bytes <= 0:
        return 1
    per_call = problem.weight_bytes * (min(problem.m, problem.experts) if problem.grouped
                                       else 1)
    return max(1, min(64, math.ceil(2 * l2_bytes / per_call)))


_WEIGHTS: dict[tuple, tuple] = {}


def build(problem: Problem, device: torch.device | str, variants: int = 1, seed: int = 0,
          reference: bool = True) -> Built:
    """Inputs of ``problem``: random expert draws (grouped: ``ids`` [tokens, TOP_K]) or weight
    copies (dense), x, and the reference output of variant 0 (``pair_w4a16_reference``, or ``w4a16_linear_reference``)."""
    p, dev = problem, torch.device(device)
    if p.grouped and (p.m % TOP_K or p.experts < TOP_K):
        raise ValueError(f"{p.name}: a grouped problem needs pairs a multiple of {TOP_K} and "
                         f">= {TOP_K} experts")
    gen = torch.Generator(device=dev).manual_seed(seed * 1009 + p.n * 7 + p.k)
    tokens = p.m // TOP_K if p.grouped else p.m
    h = torch.randn(tokens, p.k, generator=gen, device=dev).bfloat16()
    if p.grouped:
        key = ("grouped", p.n, p.k, p.experts + p.shared, str(dev))
        if key not in _WEIGHTS:
            _WEIGHTS[key] = random_nvfp4((p.experts + p.shared, p.n, p.k), gen, dev)
        w, s, s2 = _WEIGHTS[key]
        rows = p.m + tokens * p.shared
        x = h if p.repeat_x else torch.randn(rows, p.k, generator=gen, device=dev).bfloat16()
        out, moved = [], []
        for _ in range(variants):
            ids = torch.stack([torch.randperm(p.experts, generator=gen, device=dev)[:TOP_K]
                               for _ in range(tokens)])
            out.append((x, ids, w, s, s2))
            moved.append((len(set(ids.reshape(-1).tolist())) + p.shared) * p.weight_bytes)
        built = Built(p, out, sum(moved) / len(moved) + x.numel() * 2 + rows * p.n * 2)
        if reference:
            built.ref = tw.pair_w4a16_reference(x, out[0][1], w, s, s2,
                                                x_per_pair=not p.repeat_x,
                                                shared_parts=p.shared)
        return built
    out = []
    for i in range(variants):
        key = ("dense", p.n, p.k, i, str(dev))
        if key not in _WEIGHTS:
            _WEIGHTS[key] = random_nvfp4((p.n, p.k), gen, dev)
        out.append((h, *_WEIGHTS[key]))
    built = Built(p, out, p.weight_bytes + h.numel() * 2 + p.m * p.n * 2)
    if reference:
        built.ref = tw.w4a16_linear_reference(*out[0])
    return built


# ------------------------------------------------------------------------------- the grid
def _smem_bytes(block_n: int, chunk: int, stages: int) -> int:
    """Shared memory a CTA stages, overestimated (every stage holds W at 4 bits, its scales
    and 16 rows of bf16 x; Triton's own figures come out 10-40 % lower)."""
    return stages * (block_n * chunk // 2 + block_n * chunk // 16 + BLOCK_M * chunk * 2)


def plan_configs(problem: Problem, sms: int, axes: dict = AXES) -> tuple[list[dict], Counter]:
    """Explicit v2 configs to time for ``problem`` and the count of grid points dropped, by
    reason.  Each config names every option (``split_k`` the split it launches), so the tuned
    table plays no part in the sweep.  The built-in default is always included (``builtin``).

    Dropped: tiles the launcher rejects; a K step (block_k * k_slices) longer than K; more
    than ``MAX_WEIGHTS_PER_THREAD`` weights per thread; more warps than the dot has 16 x 8
    MMA tiles (M = 16 rows: k_slices * block_n / 8), which would only repeat its work; shared
    memory over the limit; pipeline stages beyond the K steps of a split (nothing left to
    prefetch); a split that launches the same split as a smaller request; a split past
    ``MAX_CTAS_PER_SM`` CTAs per SM.
    """
    p = problem
    builtin = tw.v2_default_config(p.n, p.k, BLOCK_M if p.grouped else p.m, tuned=False)
    tiles_of = {bn: p.blocks * -(-p.n // bn) for bn in axes["block_n"] + (builtin["block_n"],)}

    def auto_split(bn: int, chunk: int) -> int:
        return tw._pick_split_k(tiles_of[bn], p.k, chunk, sms, waves=1.5)

    chunk0 = builtin["block_k"] * builtin["k_slices"]
    builtin["split_k"] = tw.split_plan(p.k, chunk0, auto_split(builtin["block_n"], chunk0))[0]
    default = launch_config(builtin)
    configs, seen, dropped = [], set(), Counter()
    for bn, bk, sl, warps, stages in itertools.product(
            axes["block_n"], axes["block_k"], axes["k_slices"], axes["num_warps"],
            axes["num_stages"]):
        chunk = bk * sl
        try:
            tt.check_v2_tile(bn, bk, sl)
        except ValueError:
            dropped["launcher rejects the tile"] += len(axes["split_k"])
            continue
        reason = None
        if chunk > p.k:
            reason = "K step > K"
        elif bn * chunk // (32 * warps) > MAX_WEIGHTS_PER_THREAD:
            reason = "weights per thread"
        elif warps > max(1, sl * bn // 8):
            reason = "warps beyond the MMA tiles"
        elif _smem_bytes(bn, chunk, stages) > SMEM_BYTES:
            reason = "shared memory (estimate)"
        if reason:
            dropped[reason] += len(axes["split_k"])
            continue
        auto = tw.split_plan(p.k, chunk, auto_split(bn, chunk))[0]
        launched = set()
        for split in axes["split_k"]:
            eff, k_per_split = tw.split_plan(p.k, chunk, split or auto)
            if eff in launched:
                dropped["same split as another request"] += 1
                continue
            launched.add(eff)
            if stages > 2 and stages - 1 > -(-k_per_split // chunk):
                dropped["stages beyond the K steps"] += 1
                continue
            if eff > 1 and tiles_of[bn] * eff > MAX_CTAS_PER_SM * sms:
                dropped["CTAs per SM"] += 1
                continue
            for reg in axes.get("maxnreg", (None,)):
                cfg = {"block_n": bn, "block_k": bk, "k_slices": sl, "split_k": eff,
                       "num_warps": warps, "num_stages": stages, "maxnreg": reg}
                seen.add(tuple(cfg.values()))
                configs.append({**cfg, "auto_split": eff == auto, "builtin": cfg == default})
    if tuple(default.values()) not in seen:  # (same key order: launch_config's)
        configs.append({**default, "auto_split": True, "builtin": True})
    return configs, dropped


def tuned_point(problem: Problem, sms: int) -> dict:
    """The one config a model's call of ``problem`` launches today: the tuned table in force
    (``BLOCKSPEC_W4A16_TUNED`` or the packaged one) over the built-ins, split-K resolved as
    the launcher resolves it. ``--tuned-only`` times just this, e.g. to compare two trees'
    kernels and tables on one machine."""
    p = problem
    cfg = (tw.v2_default_config(p.n, p.k, BLOCK_M, blocks=p.blocks) if p.grouped
           else tw.v2_default_config(p.n, p.k, p.m))
    chunk = cfg["block_k"] * cfg["k_slices"]
    split = cfg["split_k"] or tw._pick_split_k(p.blocks * -(-p.n // cfg["block_n"]), p.k,
                                               chunk, sms, waves=1.5)
    cfg["split_k"] = tw.split_plan(p.k, chunk, split)[0]
    return {**launch_config(cfg), "auto_split": True, "builtin": True}


def launch_config(point: dict) -> dict:
    """The keyword arguments of a planned point (its labels dropped)."""
    return {k: point[k] for k in tt.TUNED_KEYS}


def compile_signature(problem: Problem, cfg: dict) -> tuple:
    """What Triton specializes a launch on (constexprs, options, int-argument divisibility):
    points of one signature share a compiled kernel, so the pool compiles one of them."""
    tiles = problem.blocks * -(-problem.n // cfg["block_n"])
    return (problem.kind, problem.n, problem.k, problem.m == 1, problem.m % 16 == 0,
            tiles % 16 == 0, *launch_config(cfg).values())


# ------------------------------------------------------------------------------- compiling
_WORKER: dict = {}


def _worker_init() -> None:
    torch.set_num_threads(1)  # many workers share the host's cores


def _warm(task: tuple[Problem, dict, str]) -> str | None:
    """Pool worker: compile and run one config once (its kernel lands in Triton's disk cache).
    Returns the error, if any.  After an error that leaves the CUDA context unusable, every
    later task of this worker answers 'lost' so that the caller retries it elsewhere."""
    problem, cfg, device = task
    if "dead" in _WORKER:
        return f"lost: this worker's CUDA context broke at {_WORKER['dead']}"
    try:
        if problem not in _WORKER:
            _WORKER[problem] = build(problem, device, reference=False)
        _WORKER[problem].call(cfg)()
        if device == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - reported, never fatal
        msg = _error(e)
        if device == "cuda":
            try:
                torch.cuda.synchronize()
                torch.zeros(1, device="cuda").item()
            except Exception:  # noqa: BLE001
                _WORKER["dead"] = f"{problem.name} {cfg}"
        return msg


def _error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def precompile(tasks: list[tuple[Problem, dict]], jobs: int, device: str = "cuda",
               rounds: int = 3) -> dict[int, str]:
    """Errors by task index after compiling every task in ``jobs`` spawned workers.  Tasks
    that a broken worker or pool lost are retried in a fresh pool, up to ``rounds`` times."""
    errors: dict[int, str] = {}
    todo = list(range(len(tasks)))
    for _ in range(rounds):
        lost: list[int] = []
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"),
                                 initializer=_worker_init) as pool:
            answers = pool.map(_warm, [(*tasks[i], device) for i in todo],
                               chunksize=max(1, len(todo) // (8 * jobs)))
            done = 0
            try:
                for i, err in zip(todo, answers):
                    done += 1
                    if err and err.startswith("lost:"):
                        lost.append(i)
                    elif err:
                        errors[i] = err
            except BrokenProcessPool:
                lost += todo[done:]
        todo = lost
        if not todo:
            return errors
    for i in todo:
        errors[i] = "not compiled: lost in every retry (a config here breaks the CUDA context)"
    return errors


# ------------------------------------------------------------------------------- measuring
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _reset_counters() -> None:
    """Zero the split-K tile counters: a failed launch must not corrupt the next point."""
    tile_counters.zero_all()


def measure_point(built: Built, cfg: dict, timer: Callable, calls: int, reps: int) -> dict:
    """Check one config against the reference, then time it; failures become a record."""
    try:
        _reset_counters()
        err = _rel(built.call(cfg)(), built.ref)
        if not math.isfinite(err) or err > TOL:
            return {"ok": False, "error": f"wrong result: rel err {err:.3g} > {TOL}"}
        n = len(built.variants)
        ms = timer(built.cycled(cfg), -(-calls // n) * n, reps)
        return {"ok": True, "rel_err": err, "us": ms * 1e3,
                "gbs": built.bytes_per_call / (ms * 1e-3) / 1e9}
    except Exception as e:  # noqa: BLE001 - a launch the compiler or driver refuses
        return {"ok": False, "error": _error(e)}


@dataclass
class Result:
    """The timed points of one problem and the summary the table is written from."""
    problem: Problem
    bytes_per_call: float
    variants: int
    points: list[dict] = field(default_factory=list)

    @property
    def best(self) -> dict | None:
        return min((r for r in self.points if r["ok"]), key=lambda r: r["us"], default=None)

    @property
    def builtin(self) -> dict | None:
        return next((r for r in self.points if r["builtin"]), None)

    def summary(self) -> dict:
        best, builtin = self.best, self.builtin
        out = {**asdict(self.problem), "key": self.problem.key,
               "bytes_per_call": self.bytes_per_call, "variants": self.variants,
               "points": len(self.points), "ok": sum(r["ok"] for r in self.points),
               "best": best, "builtin": builtin}
        if best and builtin and builtin["ok"]:
            out["speedup_vs_builtin"] = builtin["us"] / best["us"]
        return out


def tile_of(point: dict) -> tuple:
    """The part of a config the first stage of the staged search varies."""
    return point["block_n"], point["block_k"], point["k_slices"], point["split_k"]


def first_stage(points: list[dict], warps: int, stages: int = 3) -> list[int]:
    """Per tile (``tile_of``) the one point whose warps and stages are nearest ``warps`` (the
    built-in's) and ``stages``: the tile x split grid at a natural launch, and the built-in."""
    pick: dict[tuple, int] = {}

    def dist(p: dict) -> tuple:
        return (abs(math.log2(p["num_warps"] / warps)), abs(p["num_stages"] - stages),
                p.get("maxnreg") is not None, p["num_warps"], p["num_stages"])

    for i, p in enumerate(points):
        j = pick.get(tile_of(p))
        if j is None or dist(p) < dist(points[j]):
            pick[tile_of(p)] = i
    return sorted(set(pick.values()) | {i for i, p in enumerate(points) if p["builtin"]})


def second_stage(points: list[dict], timed: list[dict], beam: int) -> list[int]:
    """Every untimed point (each warps x stages) of the ``beam`` fastest tiles timed so far."""
    ranked = sorted((r for r in timed if r["ok"]), key=lambda r: r["us"])
    tiles: list[tuple] = []
    for r in ranked:
        if tile_of(r) not in tiles:
            tiles.append(tile_of(r))
    top, done = set(tiles[:beam]), {tuple(launch_config(r).values()) for r in timed}
    return [i for i, p in enumerate(points)
            if tile_of(p) in top and tuple(launch_config(p).values()) not in done]


def run_sweep(problems: list[Problem], plans: dict[str, list[dict]], device: str,
              timer: Callable, calls: int, reps: int, *, l2_bytes: int = 0,
              hot_l2: bool = True, beam: int | None = 4,
              compile_points: Callable[[list[tuple[Problem, dict]]], dict[int, str]]
              | None = None, log: Callable[[str], None] = print) -> list[Result]:
    """Check and time the planned points of every problem: with ``beam`` None all of them,
    else the staged search (``first_stage``, then ``second_stage`` of the ``beam`` best
    tiles).  Before each stage ``compile_points(tasks)`` compiles one point per compile
    signature and returns errors by task; points whose kernel failed there are recorded,
    never run here."""
    built = {p.name: build(p, device, variants=rotation(p, l2_bytes, hot_l2))
             for p in problems}
    results = {p.name: Result(p, built[p.name].bytes_per_call, len(built[p.name].variants))
               for p in problems}
    compiled: dict[tuple, str | None] = {}  # signature -> error (None: fine)

    def run_stage(stage: int, todo: dict[str, list[int]]) -> None:
        tasks: dict[tuple, tuple[Problem, dict]] = {}
        for p in problems:
            for i in todo[p.name]:
                sig = compile_signature(p, plans[p.name][i])
                if sig not in compiled:
                    tasks.setdefault(sig, (p, launch_config(plans[p.name][i])))
        t0 = time.time()
        errors = compile_points(list(tasks.values())) if compile_points and tasks else {}
        for j, sig in enumerate(tasks):
            compiled[sig] = errors.get(j)
        log(f"stage {stage}: {sum(map(len, todo.values()))} points, {len(tasks)} new kernels "
            f"compiled in {time.time() - t0:.0f} s ({len(errors)} failed)")
        for p in problems:
            t0, res = time.time(), results[p.name]
            for i in todo[p.name]:
                point = plans[p.name][i]
                err = compiled.get(compile_signature(p, point))
                r = ({"ok": False, "error": err} if err else
                     measure_point(built[p.name], launch_config(point), timer, calls, reps))
                res.points.append({**point, **r, "stage": stage})
            log(_line(res) + f"  [{time.time() - t0:.0f} s]")

    if beam is None:
        run_stage(0, {p.name: list(range(len(plans[p.name]))) for p in problems})
    else:
        run_stage(1, {p.name: first_stage(plans[p.name], _builtin_warps(p))
                      for p in problems})
        run_stage(2, {p.name: second_stage(plans[p.name], results[p.name].points, beam)
                      for p in problems})
    return [results[p.name] for p in problems]


def _builtin_warps(p: Problem) -> int:
    return tw.v2_default_config(p.n, p.k, BLOCK_M if p.grouped else p.m,
                                tuned=False)["num_warps"]


# ------------------------------------------------------------------------------- the table
def best_configs(results: list[Result]) -> tuple[dict[str, dict], dict[str, dict]]:
    """(config per table key, its measured times).  Problems that share a key (none in the
    default set) get the config with the least total time among those timed on all of them."""
    groups: dict[str, list[Result]] = {}
    for res in results:
        if res.best:
            groups.setdefault(res.problem.key, []).append(res)
    configs, measured = {}, {}
    for key, group in groups.items():
        times: dict[tuple, list[float]] = {}
        for res in group:
            for r in res.points:
                if r["ok"]:
                    times.setdefault(tuple(launch_config(r).items()), []).append(r["us"])
        common = {c: sum(t) for c, t in times.items() if len(t) == len(group)}
        pick = (min(common, key=common.get) if common
                else tuple(launch_config(group[0].best).items()))
        configs[key] = dict(pick)
        measured[key] = {}
        for res in group:
            us = next((r["us"] for r in res.points
                       if r["ok"] and tuple(launch_config(r).items()) == pick), None)
            builtin = res.builtin
            measured[key][res.problem.name] = {
                "us": us, "gbs": None if us is None else res.bytes_per_call / us / 1e3,
                "builtin_us": builtin["us"] if builtin and builtin["ok"] else None}
    return configs, measured


def write_table(path: str | Path, results: list[Result], meta: dict,
                base: dict | None = None) -> dict:
    """Write the tuned table, checked by the loader's own validation before it is written;
    ``measured`` (times per problem) is a note the loader ignores. ``base``: a table whose
    entries (and notes) the swept classes are laid over."""
    configs, measured = best_configs(results)
    if base is not None:
        configs = {**base.get("configs", {}), **configs}
        measured = {**base.get("measured", {}), **measured}
    data = {"about": _ABOUT, **meta, "configs": dict(sorted(configs.items())),
            "measured": dict(sorted(measured.items()))}
    tt.parse_tuned_table(data, str(path))
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return data


_ABOUT = ("Tuned launch configs of the W4A16 v2 kernel per problem class (keys: "
          "w4a16_tuned.problem_key; options: TUNED_KEYS). Written by "
          "scripts/bench_w4a16_decode.py --write-table on the GPU it measured; a class missing "
          "here keeps the built-in defaults.")


# ------------------------------------------------------------------------------- reporting
def _cfg_text(r: dict) -> str:
    reg = f" r{r['maxnreg']}" if r.get("maxnreg") else ""
    return (f"n{r['block_n']} k{r['block_k']}x{r['k_slices']} split{r['split_k']} "
            f"w{r['num_warps']} st{r['num_stages']}{reg}")


def _line(res: Result) -> str:
    b, d = res.best, res.builtin
    ok = sum(r["ok"] for r in res.points)
    line = f"{res.problem.name:20s} {ok:4d}/{len(res.points):<4d}"
    line += (f" built-in {d['us']:6.1f} us {d['gbs']:5.0f} GB/s" if d and d["ok"]
             else " built-in failed" + " " * 20)
    if b:
        line += f" | best {b['us']:6.1f} us {b['gbs']:5.0f} GB/s  {_cfg_text(b)}"
    return line


def plan_size(problems: list[Problem], plans: dict[str, list[dict]], beam: int | None
              ) -> tuple[int, int]:
    """(points, kernels) the sweep will time and compile; for the staged search an upper
    bound (its second stage takes the ``beam`` largest tile groups)."""
    points, sigs = 0, set()
    for p in problems:
        pts = plans[p.name]
        if beam is None:
            chosen = pts
        else:
            chosen = [pts[i] for i in first_stage(pts, _builtin_warps(p))]
            groups = Counter(tile_of(q) for q in pts)
            big = {t for t, _ in groups.most_common(beam)}
            chosen += [q for q in pts if tile_of(q) in big]
        points += len({tuple(launch_config(q).values()) for q in chosen})
        sigs |= {compile_signature(p, q) for q in chosen}
    return points, len(sigs)


def _print_plan(problems: list[Problem], plans: dict, dropped: dict, beam: int | None,
                jobs: int) -> None:
    for p in problems:
        why = ", ".join(f"{k} {v}" for k, v in sorted(dropped[p.name].items()))
        first = len(first_stage(plans[p.name], _builtin_warps(p)))
        print(f"{p.name:20s} grid {len(plans[p.name]):4d}  stage 1 {first:3d}  "
              f"key {p.key!r}\n{'':22s}dropped: {why}")
    points, kernels = plan_size(problems, plans, beam)
    est = kernels * COMPILE_S / max(1, jobs) + points * POINT_S + STARTUP_S
    what = "full grid" if beam is None else f"staged search, beam {beam} (upper bound)"
    print(f"{what}: {points} points over {len(problems)} problems, {kernels} kernels to "
          f"compile; ~{est / 60:.1f} min with {jobs} jobs (at {COMPILE_S} s per compile and "
          f"job, {POINT_S * 1e3:.0f} ms per timed point, {STARTUP_S:.0f} s of start-up)")


def main(argv: list[str] | None = None) -> None:
    names = [p.name for p in decode_problems()]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:5]))
    ap.add_argument("--out", help="JSON file for every point and the best per problem")
    ap.add_argument("--write-table", metavar="PATH",
                    help="also write the best configs as a tuned table (w4a16_tuned.json format)")
    ap.add_argument("--merge", action="store_true",
                    help="--write-table keeps the shipped table's other classes")
    ap.add_argument("--problems", nargs="+", choices=names, metavar="NAME", default=names,
                    help=f"subset of: {' '.join(names)}")
    ap.add_argument("--search", choices=("staged", "grid"), default="staged",
                    help="staged (default, ~3-4 min on an H200): tile x split at the built-in "
                         "warps and 3 stages, then every warps x stages of the --beam best "
                         "tiles; grid: every point (~17 min)")
    ap.add_argument("--beam", type=int, default=4, help="tiles the staged search refines")
    ap.add_argument("--quick", action="store_true", help="a small grid (smoke run)")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                    help="compile processes (1: compile inline in this process)")
    ap.add_argument("--calls", type=int, default=20, help="calls per captured graph (at least)")
    ap.add_argument("--reps", type=int, default=5, help="graph replays; the median counts")
    ap.add_argument("--hot-l2", action="store_true",
                    help="repeat one call (weights stay in L2) instead of cycling copies")
    ap.add_argument("--tuned-only", action="store_true",
                    help="time only the config each call launches today (tuned table over "
                         "built-ins; reported as 'built-in'): an A/B of two trees' kernels")
    ap.add_argument("--plan", action="store_true",
                    help="print the grid per problem and the size estimate; needs no GPU")
    ap.add_argument("--sms", type=int, help="SM count to plan for (default: the GPU's, or "
                                            f"{H200_SMS} without one)")
    args = ap.parse_args(argv)
    if args.merge and not args.write_table:
        ap.error("--merge lays the sweep over the shipped table: it needs --write-table")
    cuda = torch.cuda.is_available()
    if not args.plan:
        if not cuda:
            raise SystemExit("bench_w4a16_decode.py times CUDA kernels and needs a CUDA device "
                             "(torch.cuda.is_available() is False here); --plan shows the "
                             "grid without one")
        if not args.out:
            ap.error("--out is required (or --plan)")
    problems = [p for p in decode_problems() if p.name in args.problems]
    sms = args.sms or (torch.cuda.get_device_properties(0).multi_processor_count if cuda
                       else H200_SMS)
    axes = QUICK_AXES if args.quick else AXES
    beam = None if args.search == "grid" else args.beam
    plans, dropped = {}, {}
    for p in problems:
        plans[p.name], dropped[p.name] = plan_configs(p, sms, axes)
        if args.tuned_only:
            plans[p.name], dropped[p.name] = [tuned_point(p, sms)], Counter()
    _print_plan(problems, plans, dropped, beam, args.jobs)
    if args.plan:
        return

    from blockspec.bench.timing import graph_time_ms
    from blockspec.bench.w4a16 import NOMINAL_GBS, read_bandwidth_gbs

    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    read_gbs = read_bandwidth_gbs()
    print(f"{props.name}: {sms} SMs, L2 {props.L2_cache_size >> 20} MB, HBM read "
          f"{read_gbs:.0f} GB/s; per problem: points ok/timed, built-in default, best")
    results = run_sweep(
        problems, plans, "cuda", graph_time_ms, args.calls, args.reps,
        l2_bytes=props.L2_cache_size, hot_l2=args.hot_l2, beam=beam,
        compile_points=(lambda tasks: precompile(tasks, args.jobs)) if args.jobs > 1 else None)
    meta = {"device": props.name, "sms": sms, "triton": __import__("triton").__version__,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "hot_l2": args.hot_l2, "search": args.search, "quick": args.quick}
    summary = [r.summary() for r in results]
    for s in summary:
        if s["best"]:
            s["best"]["frac_read"] = s["best"]["gbs"] / read_gbs
            s["best"]["frac_nominal"] = s["best"]["gbs"] / NOMINAL_GBS
    out = {**meta, "read_gbs": read_gbs, "nominal_gbs": NOMINAL_GBS,
           "axes": {k: list(v) for k, v in axes.items()},
           "dropped": {k: dict(v) for k, v in dropped.items()},
           "problems": [{**s, "timed": res.points} for s, res in zip(summary, results)]}
    print(f"{'problem':20s} {'best us':>8s} {'GB/s':>6s} {'% read':>6s} {'x built-in':>10s}")
    for s in summary:
        if s["best"]:
            print(f"{s['name']:20s} {s['best']['us']:8.1f} {s['best']['gbs']:6.0f} "
                  f"{s['best']['frac_read']:6.0%} {s.get('speedup_vs_builtin', 0):10.2f}")
    if args.write_table:
        base = (json.loads(tt.TUNED_PATH.read_text(encoding="utf-8")) if args.merge
                else None)
        out["table"] = write_table(args.write_table, results, meta, base)
        print(f"wrote the tuned table {args.write_table} ({len(out['table']['configs'])} "
              f"entries): copy it to {tt.TUNED_PATH} or set {tt.TUNED_ENV}={args.write_table}")
    out["seconds"] = time.time() - t0
    Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n", encoding="utf-8")
    print(f"wrote {args.out} in {out['seconds']:.0f} s")


if __name__ == "__main__":
    main()
