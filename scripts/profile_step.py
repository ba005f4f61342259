"""Where one decode / speculative step spends its time, for the notes the performance work
builds on: the step function run eagerly under the torch profiler (kernel count, GPU time by
phase - draft forward, draft logits, Markov walk, verify forward, acceptance, commit - and by
target layer kind, then the kernels by total GPU time), and the same step replayed from its
CUDA graph timed with CUDA events.

    python scripts/profile_step.py --preset lightning-mini [--quantized] [--draft dflash|dspark]
        [--batch-size 1] [--width 4] --out FILE
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockspec.args import DRAFT_LM_HEADS  # noqa: E402
from blockspec.bench import presets  # noqa: E402
from blockspec.bench.accept_profile import accept_length_profile  # noqa: E402
from blockspec.bench.bench_args import RANDOM_DRAFTS  # noqa: E402
from blockspec.bench.draft_presets import algorithm_of, build_random_draft  # noqa: E402
from blockspec.bench.jsonl import emit_text  # noqa: E402
from blockspec.bench.timing import event_time_ms  # noqa: E402
from blockspec.engine import Engine  # noqa: E402
from blockspec.runtime.metadata import StepBatch  # noqa: E402
from blockspec.speculative.simulated_accept import SimulatedAcceptance  # noqa: E402


class Phases:
    """Profiler ranges around the parts of a step, added from outside (forward hooks on modules,
    wrappers on bound methods and module functions), so the model and the worker carry no
    profiling code."""

    def __init__(self) -> None:
        self.open: dict[str, list] = collections.defaultdict(list)

    def _enter(self, name: str) -> None:
        ctx = torch.profiler.record_function(name)
        ctx.__enter__()
        self.open[name].append(ctx)

    def _exit(self, name: str) -> None:
        self.open[name].pop().__exit__(None, None, None)

    def module(self, mod: torch.nn.Module, name: str) -> None:
        mod.register_forward_pre_hook(lambda *_: self._enter(name))
        mod.register_forward_hook(lambda *_: self._exit(name))

    def method(self, obj: object, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def wrapped(*args, **kwargs):
            self._enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self._exit(name)
        setattr(obj, attr, wrapped)


def annotate(phases: Phases, model: torch.nn.Module, draft, worker) -> None:
    """Phase ranges: ``phase:*`` for the step's parts, ``layer:*`` for the target's mixers."""
    for block in model.backbone.layers:
        if block.kind == "mamba":    # the model calls the mixer's step/extend methods directly
            for attr in ("forward_steps", "extend"):
                phases.method(block.mixer, attr, "layer:mamba")
        else:
            phases.module(block.mixer, f"layer:{block.kind}")
    if not model.tied_head:
        phases.module(model.lm_head, "layer:lm_head")
    if draft is None:
        phases.module(model, "phase:target forward")
        return
    import blockspec.speculative.worker as worker_mod

    phases.module(model, "phase:verify forward")
    phases.method(draft, "forward_paged", "phase:draft forward")
    phases.method(worker, "draft_logits", "phase:draft logits")
    if hasattr(draft, "markov_walk"):
        phases.method(draft, "markov_walk", "phase:markov walk")
    phases.method(draft, "write_context", "phase:draft context write")
    if worker.memory.mamba is not None:
        phases.method(worker.memory.mamba, "commit_verify", "phase:mamba commit")
    phases.method(worker_mod, "verify_block", "phase:accept")   # the worker's module-level import


def _is_range(name: str) -> bool:
    return name.startswith(("phase:", "layer:"))


def range_table(prof, total_us: float) -> list[str]:
    """GPU time of the kernels that ran inside each ``phase:``/``layer:`` range, attributed by
    the ranges' spans on the GPU timeline (Triton launches are not linked to the CPU op that
    issued them, so the CPU events' device totals would miss them)."""
    cuda = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(ev.name, ev.time_range.start, ev.time_range.end) for ev in cuda if _is_range(ev.name)]
    sums: collections.Counter = collections.Counter()
    counts = collections.Counter(name for name, _, _ in spans)
    loose_t: collections.Counter = collections.Counter()     # kernels outside every phase
    loose_n: collections.Counter = collections.Counter()
    draft_t: collections.Counter = collections.Counter()     # kernels of the draft forward
    draft_n: collections.Counter = collections.Counter()
    draft_spans = [sp for sp in spans if sp[0] == "phase:draft forward"]
    phase_spans = [sp for sp in spans if sp[0].startswith("phase:")]
    for ev in cuda:
        if _is_range(ev.name):
            continue
        for name, lo, hi in spans:
            if lo <= ev.time_range.start < hi:
                sums[name] += ev.time_range.elapsed_us()
        if any(lo <= ev.time_range.start < hi for _, lo, hi in draft_spans):
            draft_t[ev.name] += ev.time_range.elapsed_us()
            draft_n[ev.name] += 1
        if phase_spans and not any(lo <= ev.time_range.start < hi for _, lo, hi in phase_spans):
            loose_t[ev.name] += ev.time_range.elapsed_us()
            loose_n[ev.name] += 1
    lines = []
    for prefix, title in (("phase:", "by phase"), ("layer:", "target by layer kind")):
        names = [n for n in counts if n.startswith(prefix)]
        if not names:
            continue
        lines.append(f"{title} (GPU ms, share of the step's kernel time):")
        for n in sorted(names, key=lambda n: -sums[n]):
            lines.append(f"  {sums[n] / 1e3:8.3f} ms  {100 * sums[n] / max(total_us, 1e-9):5.1f} %"
                         f"  x{counts[n]:<3d} {n.split(':', 1)[1]}")
        if prefix == "phase:":
            rest = total_us - sum(sums[n] for n in names)
            lines.append(f"  {rest / 1e3:8.3f} ms  {100 * rest / max(total_us, 1e-9):5.1f} %"
                         f"        other (metadata, sampling, output): {sum(loose_n.values())} "
                         f"kernels")
            for n, t in loose_t.most_common(12):
                lines.append(f"      {t / 1e3:8.3f} ms  x{loose_n[n]:<4d} {n[:90]}")
            if draft_t:
                lines.append(f"  draft forward: {sum(draft_n.values())} kernels")
                for n, t in draft_t.most_common(12):
                    lines.append(f"      {t / 1e3:8.3f} ms  x{draft_n[n]:<4d} {n[:90]}")
    return lines


def replay_ms(runner, gkey) -> float:
    """Median ms of 50 replays of a captured graph (after 5 untimed), by CUDA events."""
    return event_time_ms(lambda: runner.graphs.replay(gkey), reps=50, device=runner.device,
                         warmup=5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="lightning-mini", choices=sorted(presets.PRESETS))
    p.add_argument("--quantized", action="store_true")
    p.add_argument("--draft", choices=RANDOM_DRAFTS,
                   help="a random draft as the bench builds it (*-nemotron35: published size, W4A16)")
    p.add_argument("--draft-lm-head", default="auto", choices=DRAFT_LM_HEADS)
    p.add_argument("--width", type=int, default=4, help="verify width with --draft / --verify-only")
    p.add_argument("--step-width", type=int, metavar="W",
                   help="with --draft: run the step at width W <= --width, as the adaptive "
                        "chooser does (1: plain decoding plus the draft-context write)")
    p.add_argument("--verify-only", action="store_true",
                   help="time the target's verify forward of --width tokens alone (no draft, no "
                        "accept, no commit)")
    p.add_argument("--simulate-accept-length", type=float, metavar="TAU",
                   help="with --draft: the bench's simulated acceptance (random proposals, so the "
                        "verify routes like a trained draft's distinct tokens)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev = torch.device("cuda")
    model = presets.build_target(a.preset, dev, torch.bfloat16, a.quantized)
    draft = None
    if a.draft:
        block = a.width if algorithm_of(a.draft) == "dflash" else a.width - 1
        draft = build_random_draft(a.draft, presets.preset_config(a.preset), block, dev,
                                   torch.bfloat16)
    bs = a.batch_size
    e = Engine.from_model(model, draft=draft, max_running_requests=max(bs, 1),
                          max_total_tokens=bs * (a.context + 128 + 64 * max(a.width, 1)),
                          cuda_graph_max_bs=max(bs, 1),
                          speculative_draft_lm_head=a.draft_lm_head,
                          speculative_adaptive=a.step_width is not None)
    runner = e.runner
    # every step advances its inputs on the device (the scheduler's overlap needs it), so the
    # 60 timed replays run at contexts from --context up: reserve them all
    span = a.context + 64 + 64 * max(a.width, 1)
    held = [e.memory.admit(span) for _ in range(bs)]
    # distinct random tokens: one token repeated would route every request to the same experts
    # (at batch 64 the AR replay was 7.5 ms against the bench's 8.9 with random prompts)
    tokens = torch.randint(3, model.cfg.vocab_size, (bs,),
                           generator=torch.Generator().manual_seed(0))
    batch = StepBatch(slots=[h.slot for h in held], prefix_lens=[a.context] * bs,
                      tokens=tokens.tolist(),
                      temperature=[0.0] * bs, top_k=[-1] * bs, top_p=[1.0] * bs, min_p=[0.0] * bs,
                      seeds=list(range(bs)), sample_counters=[0] * bs, verify_counters=[0] * bs)
    fn, kind = (e.drafter.step_fn, "spec") if draft is not None else (runner.decode_step, "decode")
    if draft is not None and a.step_width is not None:
        fn, kind = e.drafter.by_kind(f"spec{a.step_width}")[0], f"spec{a.step_width}"
    if draft is not None and a.simulate_accept_length is not None:
        e.drafter.simulate = SimulatedAcceptance(
            accept_length_profile(a.simulate_accept_length, e.drafter.gamma), dev)
    if a.verify_only:
        from blockspec.forward_metadata import Mode
        from blockspec.runtime.metadata import uniform_metadata

        m = e.memory
        m.set_step_width(a.width)

        # distinct random tokens: one token repeated would route every position alike
        rand_ids = torch.randint(3, model.cfg.vocab_size, (bs, a.width), device=dev)

        def fn(inp, key):   # noqa: F811 - the target's verify forward alone
            ids = rand_ids
            meta = uniform_metadata(inp, a.width, Mode.VERIFY, ids, m.block_table, m.page_size,
                                    runner.decode_attn, m.kv, m.mamba)
            return model(meta).logits
        kind = "verify"
    phases = Phases()
    if not a.verify_only:
        annotate(phases, model, draft, e.drafter if draft is not None else None)
    key = batch.sampling_key()
    lines = [f"preset {a.preset} quantized={a.quantized} draft={a.draft} "
             f"draft_lm_head={a.draft_lm_head} verify_only={a.verify_only} "
             f"simulate={a.simulate_accept_length} "
             f"width={a.width if draft or a.verify_only else 1} step_width={a.step_width} "
             f"batch {bs} context {a.context}"]
    with torch.inference_mode():
        runner.inputs.fill(batch, bs)
        for _ in range(3):
            fn(runner.inputs.view(bs), key)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn(runner.inputs.view(bs), key)
            torch.cuda.synchronize()
        kernels = collections.Counter()
        times = collections.Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA and not _is_range(ev.name):
                kernels[ev.name] += 1
                times[ev.name] += ev.device_time_total
        total = sum(times.values())
        lines.append(f"eager step: {sum(kernels.values())} GPU kernels, {total / 1e3:.3f} ms of GPU time")
        lines += range_table(prof, total)
        for name, t in times.most_common(25):
            lines.append(f"  {t / 1e3:8.3f} ms  x{kernels[name]:<4d} {name[:110]}")
        gkey = runner.ensure_graph(kind, key, bs, fn)
        runner.inputs.fill(batch, bs)
        lines.append(f"graph replay: {replay_ms(runner, gkey):.3f} ms per step (median of 50)")
        if draft is not None:
            # the same graph on the rows the adaptive cost table times (speculative/worker.py):
            # every row the dummy slot at context 0, distinct tokens; then the batch's rows all
            # on one request's slot at its context (is a gap between the two the shared slot?)
            runner.inputs.fill_timing_rows(tokens)
            lines.append(f"graph replay, the cost table's dummy rows: "
                         f"{replay_ms(runner, gkey):.3f} ms per step")
            batch.slots = [held[0].slot] * bs
            runner.inputs.fill(batch, bs)
            lines.append(f"graph replay, every row on one slot: {replay_ms(runner, gkey):.3f} ms per step")
    emit_text(lines, a.out)


if __name__ == "__main__":
    main()
