"""Large-M (prefill) launch-config sweep of the W4A16 kernel on Lightning's MoE shapes.

    python scripts/tune_w4a16_prefill.py --out prefill.jsonl        # one GPU, < 4 minutes
    TRITON_INTERPRET=1 python scripts/tune_w4a16_prefill.py --smoke --out s.jsonl   # CPU check

Why: a 2048-token prefill chunk sends 12,288 (token, expert) rows through every routed
expert projection, where the decode-era tiles (32-64 rows, split-K) leave the tensor cores
mostly idle. Shapes: routed up (N=1856, K=2688, relu^2 epilogue) and down (N=2688, K=1856) over
E=128 experts with a random top-6 routing of skewed expert popularity (``grouped_w4a16``),
the shared expert's up (3712x2688, relu^2) and down (2688x3712) (``w4a16_linear``), each at
2048/4096/8192 tokens; plus the lm_head-like 131072x2688 at M=1 (the decode config, as a
check that it is unchanged). For each: ``launcher`` (what the launcher now picks),
``legacy`` (the decode-era built-in tile at this M), the sweep's candidates (staged: tiles x
swap first, then stages / K block / grid order / warps around each shape's best), and the
dequantized path (``dequant``: the Triton dequant into a bf16 copy, then
``torch._grouped_mm`` or ``torch.matmul``, a ``PREFILL_TABLE`` candidate like any tile) and the
bf16 GEMM alone on weights dequantized beforehand. Every point is checked once against the torch
reference (rel err <= 1e-2), then timed with CUDA events: median of ``--reps`` after warm-up.
``x_perm`` points include the copy of x into stream order, except for routed up, whose x the
MoE gathers in that order anyway (``x_ordered``).

A worker process does the measuring and appends one JSON line per point to ``--out``; a
config whose compile or launch fails is recorded as failed, and if the worker dies (a fault
poisons its CUDA context) the parent records the point it was on and starts a new worker,
which skips what the file already holds. Points not started by ``--budget-s`` are recorded
as skipped. At the end the parent prints the table, the best config per shape and M, and the
``PREFILL_TABLE`` entries for ``blockspec/kernels/w4a16_prefill.py`` (the MoE's up and down
share one row-block table, so down's entry is the best at up's ``block_m``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockspec.bench.timing import event_time_ms
from blockspec.kernels import w4a16 as tw
from blockspec.kernels.w4a16_blocks import pick_block_m
from blockspec.kernels.w4a16_layout import from_kernel_layout
from blockspec.kernels.w4a16_prefill import m_bucket
from blockspec.layers.moe import sort_by_expert_reference
from blockspec.quant.nvfp4 import dequantize_nvfp4

TOP_K, EXPERTS = 6, 128
# name: (kind, N, K, relu2 epilogue)
SHAPES = {"routed_up": ("grouped", 1856, 2688, True), "routed_down": ("grouped", 2688, 1856, False),
          "shared_up": ("dense", 3712, 2688, True), "shared_down": ("dense", 2688, 3712, False)}
LM_HEAD = ("dense", 131072, 2688, False)
SMOKE_SHAPES = {"routed_up": ("grouped", 64, 128, True), "routed_down": ("grouped", 128, 64, False),
                "shared_up": ("dense", 64, 128, True)}
SMOKE_LM_HEAD = ("dense", 128, 64, False)
TILES = ((128, 128, 8), (128, 256, 8), (64, 256, 8), (64, 128, 4), (128, 128, 4), (64, 128, 8))
TOL = 1e-2
DEQUANT = {"dequant": True}  # the config of the dequantize-then-cuBLAS points
POINT_TIMEOUT_S = 60.0  # one point (its compile included) running longer is hung
PHASE_ENDS = (0.4, 0.7, 0.82, 1.0)  # fractions of --budget-s: compile 0, measure 0, 1, 1


def config_key(cfg: dict | None) -> str:
    return "-" if cfg is None else json.dumps(cfg, sort_keys=True)


def config_problem(cfg: dict, k: int = 0) -> str | None:
    """Why the kernel cannot run ``cfg`` (None if it can): powers of two, wgmma's N multiple of
    64, at most 128 fp32 accumulators per thread, ~200 KB of pipelined shared memory."""
    bm, bn, bk, warps, stages = (cfg[n] for n in ("block_m", "block_n", "block_k", "num_warps",
                                                  "num_stages"))
    if any(v & (v - 1) for v in (bm, bn, bk, warps)) or bk < 64 or bn < 16 or bm < 16:
        return "tile sizes must be powers of two (block_k >= 64)"
    if cfg["swap"] and bn % 64:
        return "swap needs block_n % 64 == 0"
    if bm * bn // (32 * warps) > 128:
        return "more than 128 accumulators per thread"
    if stages * (bm * bk * 2 + bn * bk // 2 + bn * bk // 16) > 200 * 1024:
        return "pipelined tiles exceed ~200 KB of shared memory"
    if cfg.get("x_perm") and k % bk:
        return "x_perm needs K a multiple of block_k"
    return None


def _cfg(bm, bn, bk, warps, stages, swap, n_inner, x_perm=False) -> dict:
    return {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps,
            "num_stages": stages, "swap": swap, "n_inner": n_inner, "x_perm": x_perm}


def stage_configs(kind: str, k: int, stage: int, best: dict | None = None,
                  smoke: bool = False) -> list[dict]:
    """Stage 0: every tile of ``TILES`` x swap at 3 stages, the K block that divides K (128 if it
    can), N tiles innermost for grouped, and the first tile with x in stream order. Stage 1:
    one change at a time to ``best`` (4 stages, the other K block, the other grid order, the
    other warps, x in stream order or not). Runnable configs only."""
    bk = 128 if k % 128 == 0 else 64
    if smoke:
        out = [_cfg(64, 64, 64, 4, 2, True, kind == "grouped"),
               _cfg(64, 128, 64, 4, 2, False, kind != "grouped", True)] if stage == 0 else []
    elif stage == 0:
        out = [_cfg(bm, bn, bk, w, 3, swap, kind == "grouped")
               for swap, (bm, bn, w) in itertools.product((True, False), TILES)]
        perm = [_cfg(*TILES[0][:2], bk, TILES[0][2], 3, swap, kind == "grouped", True)
                for swap in (True, False)]
        out = out[:2] + perm + out[2:]  # likeliest first: a budget cut drops the tail
    elif best is None:
        out = []
    else:
        out = [{**best, "num_stages": 4}, {**best, "block_k": 192 - best["block_k"]},
               {**best, "n_inner": not best["n_inner"]},
               {**best, "num_warps": 12 - best["num_warps"]},
               {**best, "x_perm": not best.get("x_perm", False)}]
    seen, keep = set(), []
    for cfg in out:
        if config_problem(cfg, k) is None and config_key(cfg) not in seen:
            seen.add(config_key(cfg))
            keep.append(cfg)
    return keep


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def best_of(records: list[dict], shape: str, tokens: int | None = None,
            block_m: int | None = None,
            methods: tuple = ("w4a16", "legacy", "dequant+gemm")) -> dict | None:
    """Fastest passing record of ``shape`` among ``methods`` (at ``tokens``; by the sum over
    token counts when None), optionally at one ``block_m``."""
    ok = [r for r in records if r["shape"] == shape and r["status"] == "ok"
          and r["method"] in methods
          and (block_m is None or (r["config"] or {}).get("block_m", block_m) == block_m)]
    if tokens is not None:
        ok = [r for r in ok if r["tokens"] == tokens]
        return min(ok, key=lambda r: r["ms"], default=None)
    total: dict[str, list] = {}
    for r in ok:
        total.setdefault(config_key(r["config"]), []).append(r)
    full = max((len(v) for v in total.values()), default=0)
    cands = [v for v in total.values() if len(v) == full]
    best = min(cands, key=lambda v: sum(r["ms"] for r in v), default=None)
    return None if best is None else best[0]


# ------------------------------------------------------------------------------ worker
class Problem:
    """Random NVFP4 weights (kernel layout) of one shape, its inputs per token count, and the
    reference outputs, built once per worker."""

    def __init__(self, name, kind, n, k, relu2, experts, device, smoke):
        self.name, self.kind, self.n, self.k, self.relu2 = name, kind, n, k, relu2
        self.e = experts if kind == "grouped" else 1
        self.device, self.smoke = device, smoke
        g = torch.Generator(device=device).manual_seed(n * 31 + k)
        shape = (self.e, n, k // 2)
        self.w = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)
        scale = torch.rand((self.e, n, k // 16), device=device, generator=g) * 1.75 + 0.25
        self.s = scale.to(torch.float8_e4m3fn)
        self.s2 = torch.full((self.e,), 0.01, device=device) * (1 + torch.arange(
            self.e, device=device) % 3)
        if kind == "dense":
            self.w, self.s, self.s2 = self.w[0], self.s[0], self.s2[0]
        self.inputs: dict[int, tuple] = {}
        self._wbf16 = None
        self._ref = (None, None)

    def wbf16(self):
        """The exactly dequantized bf16 weights ([E, N, K] or [N, K])."""
        if self._wbf16 is None:
            s2 = self.s2.view(-1, 1, 1) if self.kind == "grouped" else self.s2
            self._wbf16 = dequantize_nvfp4(from_kernel_layout(self.w), self.s, s2,
                                           dtype=torch.bfloat16)
        return self._wbf16

    def rows(self, tokens: int) -> int:
        return tokens * (TOP_K if self.kind == "grouped" and not self.smoke else
                         (2 if self.kind == "grouped" else 1))

    def setup(self, tokens: int):
        """(x, offsets or None) at ``tokens``."""
        if tokens in self.inputs:
            return self.inputs[tokens]
        g = torch.Generator(device=self.device).manual_seed(tokens)
        dev = self.device
        h = torch.randn((tokens, self.k), device=dev, generator=g).bfloat16()
        offsets = None
        if self.kind == "grouped":  # top-k of noisy logits with a skewed expert popularity
            topk = self.rows(tokens) // tokens
            pop = torch.randn(self.e, device=dev, generator=g) * 0.7
            logits = torch.randn((tokens, self.e), device=dev, generator=g) + pop
            ids = logits.topk(topk, dim=-1).indices
            order, offsets = sort_by_expert_reference(ids, self.e)
            x = h[order // topk].contiguous()
        else:
            x = h
        self.inputs[tokens] = (x, offsets)
        return self.inputs[tokens]

    def reference(self, tokens: int):
        """The torch reference output at ``tokens`` (kept for the token count in use)."""
        if self._ref[0] != tokens:
            x, offsets = self.setup(tokens)
            if self.kind == "grouped":
                ref = tw.grouped_w4a16_reference(x, offsets, self.w, self.s, self.s2)
            else:
                ref = tw.w4a16_linear_reference(x, self.w, self.s, self.s2)
            self._ref = (tokens, torch.square(torch.relu(ref)) if self.relu2 else ref)
        return self._ref[1]

    def flops(self, tokens: int) -> float:
        return 2.0 * self.rows(tokens) * self.n * self.k

    def call(self, method: str, cfg: dict | None, tokens: int):
        """A no-argument function running ``method`` (with ``cfg``) at ``tokens``."""
        x, offsets = self.setup(tokens)
        relu = (lambda y: torch.square(torch.relu(y))) if self.relu2 else (lambda y: y)
        if method in ("w4a16", "legacy"):
            kw = {k: v for k, v in cfg.items() if k != "block_m"} | {"dequant": False}
            if self.kind == "grouped":
                blocks = tw.grouped_blocks(offsets, x.shape[0], block_m=cfg["block_m"])
                xo = x
                if self.relu2 and cfg.get("x_perm") and self.k % cfg["block_k"] == 0:
                    # the MoE's up projection gets x in stream order from its gather
                    xo, kw = tw.stream_order(x, cfg["block_k"]), {**kw, "x_ordered":
                                                                  cfg["block_k"]}
                return lambda: tw.grouped_w4a16(xo, offsets, self.w, self.s, self.s2,
                                                blocks=blocks, relu2=self.relu2, **kw)
            return lambda: tw.w4a16_linear(x, self.w, self.s, self.s2, relu2=self.relu2,
                                           block_m=cfg["block_m"], **kw)
        if method == "launcher":
            if self.kind == "grouped":
                blocks = tw.grouped_blocks(offsets, x.shape[0], shape=(self.n, self.k))
                chunk = tw.grouped_x_chunk(self.n, self.k, x.shape[0], self.e) * self.relu2
                xo = tw.stream_order(x, chunk) if chunk else x
                return lambda: tw.grouped_w4a16(xo, offsets, self.w, self.s, self.s2,
                                                blocks=blocks, relu2=self.relu2,
                                                x_ordered=chunk)
            return lambda: tw.w4a16_linear(x, self.w, self.s, self.s2, relu2=self.relu2)
        if method == "dequant+gemm":  # the launchers' dequant path: Triton dequant, then cuBLAS
            if self.kind == "grouped":
                return lambda: tw.grouped_w4a16(x, offsets, self.w, self.s, self.s2,
                                                relu2=self.relu2, dequant=True)
            return lambda: tw.w4a16_linear(x, self.w, self.s, self.s2, relu2=self.relu2,
                                           dequant=True)
        wb = self.wbf16()
        if self.kind == "grouped":
            offs = offsets[1:].to(torch.int32)
            gemm = lambda: relu(torch._grouped_mm(x, wb.transpose(-2, -1), offs=offs))
        else:
            gemm = lambda: relu(torch.matmul(x, wb.t()))
        return gemm  # bf16_gemm: the GEMM alone, weights already bf16 (2x+ the memory)

    def legacy_config(self, tokens: int) -> dict:
        """The decode-era built-in tile at this M (what the launcher chose before prefill)."""
        rows = self.rows(tokens)
        if self.kind == "grouped":
            bm = pick_block_m(max(1, rows // self.e))
            c = tw.v2_default_config(self.n, self.k, bm, blocks=rows // bm, tuned=False)
        else:
            c = tw.v2_default_config(self.n, self.k, rows, tuned=False)
            bm = c["block_m"]
        return _cfg(bm, c["block_n"], c["block_k"], c["num_warps"], c["num_stages"],
                    bool(c["swap"]), False)


def measure(p: Problem, method: str, cfg: dict | None, tokens: int, reps: int) -> dict:
    """One point: run once and check against the reference, then time it."""
    rec = {"shape": p.name, "kind": p.kind, "n": p.n, "k": p.k, "experts": p.e,
           "tokens": tokens, "rows": p.rows(tokens), "method": method, "config": cfg,
           "status": "ok", "ms": None, "tflops": None, "err": None}
    try:
        fn = p.call(method, cfg, tokens)
        y = fn()
        ref = p.reference(tokens)
        rec["err"] = err = rel_err(y, ref)
        if not err <= TOL:
            rec["status"] = "mismatch"
            return rec
        rec["ms"] = ms = event_time_ms(fn, reps, p.device, warmup=2 if reps > 3 else 1)
        rec["tflops"] = p.flops(tokens) / (ms * 1e-3) / 1e12
    except Exception as e:  # noqa: BLE001 (a failing config is a result, not a crash)
        rec["status"], rec["error"] = "failed", f"{type(e).__name__}: {str(e)[:300]}"
        if not _device_ok(p.device):  # a fault sticks to the context: the parent restarts us
            rec["error"] += " (CUDA context lost)"
            rec["fatal"] = True
    return rec


def _device_ok(device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device=device).sum().item() == 1.0
    except Exception:  # noqa: BLE001
        return False


def plan(args, records: list[dict]) -> list[tuple[str, str, dict | None, int]]:
    """The points of ``args.stage`` in priority order: (shape, method, config, tokens). Stage 0:
    the lm_head check, then per shape the launcher, legacy and torch points and the stage-0
    configs; stage 1: the stage-1 configs around each shape's best so far (``records``)."""
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    tokens = args.tokens or ([128] if args.smoke else [2048, 4096, 8192])
    points: list[tuple[str, str, dict | None, int]] = []
    if args.stage == 0:
        points += [("lm_head", "launcher", None, 1), ("lm_head", "dequant+gemm", DEQUANT, 1)]
        for name in shapes:
            for t in tokens:
                points += [(name, "launcher", None, t), (name, "dequant+gemm", DEQUANT, t),
                           (name, "bf16_gemm", None, t)]
                points.append((name, "legacy", "legacy", t))
    per_shape = []
    for name, (kind, _n, k, _r) in shapes.items():
        best = (best_of(records, name, methods=("w4a16", "legacy")) if args.stage == 1
                else None)  # stage 1 varies the best tile, whatever the dequant point did
        per_shape.append([(name, "w4a16", cfg, t) for cfg in stage_configs(
            kind, k, args.stage, best and best["config"], args.smoke) for t in tokens])
    # config-major across shapes, so a budget cut trims every shape's least likely configs
    for group in itertools.zip_longest(*per_shape):
        points += [pt for pt in group if pt is not None]
    return points


def worker(args) -> None:
    """Phase ``measure``: every point of the stage the --out file does not hold yet. Phase
    ``compile`` (shard ``args.shard`` of ``args.shards``): runs each kernel point of the stage
    once at its first token count, so the measuring worker finds Triton's disk cache warm."""
    out = Path(args.out)
    records = _read(out)
    done = {(r["shape"], r["method"], config_key(r["config"]), r["tokens"]) for r in records}
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    experts = 4 if args.smoke else EXPERTS
    probs: dict[str, Problem] = {}

    def problem(name: str) -> Problem:
        if name not in probs:
            if name == "lm_head":
                spec, e = (SMOKE_LM_HEAD if args.smoke else LM_HEAD), 1
            else:
                spec, e = shapes[name], experts
            probs[name] = Problem(name, *spec, e, device, args.smoke)
        return probs[name]

    points = plan(args, records)
    if args.phase == "compile":
        seen, mine = set(), []
        for name, method, cfg, t in points:
            if method in ("w4a16", "legacy", "launcher") and (name, config_key(cfg)) not in seen:
                seen.add((name, config_key(cfg)))
                mine.append((name, method, cfg, t))
        for name, method, cfg, t in mine[args.shard::args.shards]:
            if time.time() > args.deadline:
                return
            p = problem(name)
            try:
                p.call(method, p.legacy_config(t) if cfg == "legacy" else cfg, t)()
                if device.type == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 (the measuring worker records it)
                print(f"compile {name} {config_key(cfg)}: {type(e).__name__}", flush=True)
        return
    for name, method, cfg, t in points:
        p = problem(name)
        if cfg == "legacy":
            cfg = p.legacy_config(t)
        key = (p.name, method, config_key(cfg), t)
        if key in done:
            continue
        done.add(key)
        if time.time() > args.deadline:
            rec = {"shape": p.name, "kind": p.kind, "n": p.n, "k": p.k, "tokens": t,
                   "rows": p.rows(t), "method": method, "config": cfg, "status": "skipped"}
        else:
            Path(args.progress).write_text(json.dumps(list(key)))
            rec = measure(p, method, cfg, t, args.reps)
        fatal = rec.pop("fatal", False)
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        ms = f"{rec['ms']:.3f} ms {rec['tflops']:.1f} TFLOP/s" if rec.get("ms") else ""
        print(f"[{time.time() - args.start:6.1f}s] {p.name} M={t} {method} "
              f"{config_key(cfg)} {rec['status']} {ms} {rec.get('error', '')}", flush=True)
        if fatal:
            Path(args.progress).unlink(missing_ok=True)
            os._exit(3)  # no CUDA teardown on a broken context


# ------------------------------------------------------------------------------ parent
def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table_entries(records: list[dict]) -> list[str]:
    """``PREFILL_TABLE`` lines: per shape and token count its best config; routed down's at
    the block_m of routed up's best (the two share one row-block table)."""
    lines = []
    for r in sorted({(r["shape"], r["tokens"]) for r in records if r["shape"] != "lm_head"}):
        shape, tokens = r
        bm = None
        if shape == "routed_down":
            up = best_of(records, "routed_up", tokens)
            bm = up and up["config"] and up["config"].get("block_m", 128)
        best = best_of(records, shape, tokens, bm) or best_of(records, shape, tokens)
        if best is None or best["config"] is None:
            continue
        key = (best["kind"], best["n"], best["k"], m_bucket(best["rows"]))
        lines.append(f"    {key!r}: {best['config']!r},  # {shape} M={tokens}: "
                     f"{best['ms']:.3f} ms, {best['tflops']:.0f} TFLOP/s")
    return lines


def report(records: list[dict]) -> None:
    print(f"\n{'shape':12} {'M':>5} {'rows':>6} {'method':13} {'ms':>8} {'TFLOP/s':>8}  config")
    order = {m: i for i, m in enumerate(("launcher", "legacy", "w4a16", "dequant+gemm",
                                         "bf16_gemm"))}
    for r in sorted(records, key=lambda r: (r["shape"], r["tokens"], order.get(r["method"], 9),
                                            r.get("ms") or 1e9)):
        ms = f"{r['ms']:8.3f} {r['tflops']:8.1f}" if r.get("ms") else f"{r['status']:>17}"
        print(f"{r['shape']:12} {r['tokens']:5} {r['rows']:6} {r['method']:13} {ms}  "
              f"{config_key(r['config'])} {r.get('error') or ''}")
    print("\nbest per shape:")
    for shape, tokens in sorted({(r["shape"], r["tokens"]) for r in records}):
        b = best_of(records, shape, tokens, methods=("w4a16", "legacy", "launcher"))
        alt = [r for r in records if r["shape"] == shape and r["tokens"] == tokens
               and r["method"] in ("dequant+gemm", "bf16_gemm") and r.get("ms")]
        alts = ", ".join(f"{r['method']} {r['ms']:.3f} ms" for r in alt)
        if b:
            print(f"  {shape:12} M={tokens:5}: {b['ms']:.3f} ms {b['tflops']:.0f} TFLOP/s "
                  f"{b['method']} {config_key(b['config'])}  [{alts}]")
    print("\nMoE layer per token count (routed up + down + shared up + down), ms:")
    for tokens in sorted({r["tokens"] for r in records if r["shape"] in SHAPES}):
        row = []
        for label, methods in (("legacy", ("legacy",)), ("launcher", ("launcher",)),
                               ("best", ("w4a16", "legacy", "launcher")),
                               ("dequant+gemm", ("dequant+gemm",)), ("bf16", ("bf16_gemm",))):
            got = [best_of(records, sh, tokens, methods=methods) for sh in SHAPES]
            if all(got):
                row.append(f"{label} {sum(g['ms'] for g in got):.3f}")
        print(f"  M={tokens}: " + ", ".join(row))
    print("\nTABLE (replaces PREFILL_TABLE in blockspec/kernels/w4a16_prefill.py):")
    print("PREFILL_TABLE: dict[tuple[str, int, int, int], dict] = {")
    for line in table_entries(records):
        print(line)
    print("}")


def _run_watched(cmd: list[str], env: dict, end: float, progress: Path) -> int:
    """Exit status of a measuring worker, killed (-9) once one point has run for
    ``POINT_TIMEOUT_S`` (a hung kernel) or the phase is 30 s past ``end``."""
    proc = subprocess.Popen(cmd, env=env)
    while True:
        try:
            return proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        now = time.time()
        try:
            stuck = now - progress.stat().st_mtime > POINT_TIMEOUT_S
        except FileNotFoundError:
            stuck = False
        if stuck or now > end + 30:
            proc.kill()
            proc.wait()
            return -9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON lines, one per measurement (appended)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, two configs, CPU under TRITON_INTERPRET=1")
    ap.add_argument("--budget-s", type=float, default=190.0,
                    help="no new point starts after this many seconds (default 190)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per point (20)")
    ap.add_argument("--tokens", type=int, nargs="*", default=None)
    ap.add_argument("--fresh", action="store_true", help="truncate --out first")
    ap.add_argument("--jobs", type=int, default=None,
                    help="compile processes before each measuring stage (GPU: 12; smoke: 1)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="measure", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--shards", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--start", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--progress", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.reps = args.reps or (1 if args.smoke else 20)
    if args.jobs is None:
        args.jobs = 1 if args.smoke else max(1, min(12, (os.cpu_count() or 2) - 2))
    if args.worker:
        worker(args)
        return 0
    out = Path(args.out)
    if args.fresh and out.exists():
        out.unlink()
    start = time.time()
    progress = out.with_suffix(out.suffix + ".progress")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
    base = [sys.executable, __file__, "--worker", "--out", str(out), "--reps", str(args.reps),
            "--start", str(start),
            "--progress", str(progress)] + (["--smoke"] if args.smoke else []) + (
            ["--tokens", *map(str, args.tokens)] if args.tokens else [])
    # Each phase ends by its share of the budget (compiling stage 0, measuring it, compiling and
    # measuring stage 1), so slow compiles cannot leave nothing measured.
    ends = [start + f * args.budget_s for f in PHASE_ENDS]
    for stage in (0, 1):
        cmd = base + ["--stage", str(stage)]
        if args.jobs > 1:  # compile in parallel first (Triton's disk cache is shared)
            t0 = time.time()
            procs = [subprocess.Popen(cmd + ["--phase", "compile", "--shard", str(i),
                                             "--shards", str(args.jobs),
                                             "--deadline", str(ends[2 * stage])], env=env)
                     for i in range(args.jobs)]
            for proc in procs:
                try:
                    proc.wait(timeout=max(10.0, ends[2 * stage] + 30 - time.time()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            print(f"stage {stage}: compiled in {args.jobs} processes in {time.time() - t0:.0f} s",
                  flush=True)
        for attempt in range(8):
            progress.unlink(missing_ok=True)
            rc = _run_watched(cmd + ["--phase", "measure", "--deadline",
                                     str(ends[2 * stage + 1])], env, ends[2 * stage + 1], progress)
            if rc == 0:
                break
            # The worker died: record the point it was on as failed, then go on without it.
            key = json.loads(progress.read_text()) if progress.exists() else None
            print(f"worker exited with {rc} (attempt {attempt + 1}) at {key}", flush=True)
            if key is None:
                if rc == 3:  # it recorded the fault itself
                    continue
                break
            shape, method, cfg, tokens = key
            with out.open("a") as f:
                f.write(json.dumps({"shape": shape, "kind": "?", "tokens": tokens, "rows": 0,
                                    "method": method, "config": json.loads(cfg) if cfg != "-"
                                    else None, "status": "failed",
                                    "error": f"worker died (exit {rc})"}) + "\n")
    progress.unlink(missing_ok=True)
    report(_read(out))
    print(f"\nsweep took {time.time() - start:.0f} s; {len(_read(out))} points in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
