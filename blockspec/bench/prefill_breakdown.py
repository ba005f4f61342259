"""Where one prefill's time goes, by layer kind: Mamba mixers (with their in projection, conv,
chunked scan and gated norm + out projection), attention, MoE (with its router and, where it
runs on its own, the shared expert), MLP, norms, embedding, lm_head, the rest of the model
forward and the engine outside it.

Spans are taken around the model's own calls without editing the model: forward hooks on
modules that are called (attention and MoE mixers, the embedding, the router, the shared
expert), and per-instance wrappers where the model calls a method (``_mamba``, the blocks'
``RMSNorm.add_forward``, ``compute_logits``, the mixer's ``_in`` / ``_conv`` / ``_norm_out``),
and the Mamba module's kernel functions for the duration. On CUDA a span is a pair of CUDA events (no
synchronization inside the prefill; the device time between the two points, launch gaps
included); on CPU it is wall time, the ops being synchronous there. Everything is removed
afterwards, so the engine runs unchanged. The top-level parts are disjoint, so they sum to at
most the forward time; ``other_forward`` is the remainder (residual adds, state copies, ...).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch

from blockspec.bench.timing import timed_generate
from blockspec.layers import mamba2

# disjoint parts of the forward, in table order; "moe.*" are inside "moe"
TOP = ("mamba", "attention", "moe", "mlp", "norm", "embed", "lm_head")
NESTED = ("mamba.in_proj", "mamba.conv", "mamba.scan", "mamba.out_proj", "moe.router",
          "moe.shared")
# the parts of ``bench.flops.prefill_flops`` each timed part runs
FLOPS_OF = {"mamba": ("mamba_proj", "mamba_scan"), "attention": ("attn_proj", "attn_scores"),
            "moe": ("moe_router", "moe_routed", "moe_shared"), "mlp": ("mlp",),
            "lm_head": ("lm_head",)}


class Spans:
    """Summed durations by label: CUDA events read once at the end, or wall time on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.open: dict[object, object] = {}
        self.pairs: list[tuple[str, object, object]] = []

    def start(self, key: object) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            self.open[key] = ev
        else:
            self.open[key] = time.perf_counter()

    def stop(self, key: object, label: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
        else:
            ev = time.perf_counter()
        self.pairs.append((label, self.open.pop(key), ev))

    def totals(self) -> dict[str, float]:
        """Seconds by label (synchronizes once on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        out: dict[str, float] = {}
        for label, a, b in self.pairs:
            s = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[label] = out.get(label, 0.0) + s
        return out


@contextmanager
def _hooked(module: torch.nn.Module, spans: Spans, label: str) -> Iterator[None]:
    key = id(module)
    pre = module.register_forward_pre_hook(lambda *_: spans.start(key))
    post = module.register_forward_hook(lambda *_: spans.stop(key, label))
    try:
        yield
    finally:
        pre.remove()
        post.remove()


@contextmanager
def _wrapped(obj: object, name: str, spans: Spans, label: str) -> Iterator[None]:
    """Time ``obj.name(...)`` through an instance attribute that shadows the method."""
    inner: Callable = getattr(obj, name)
    key = (id(obj), name)

    def timed(*a, **kw):
        spans.start(key)
        try:
            return inner(*a, **kw)
        finally:
            spans.stop(key, label)

    setattr(obj, name, timed)
    try:
        yield
    finally:
        delattr(obj, name)


@contextmanager
def _patched(module: object, name: str, spans: Spans, label: str) -> Iterator[None]:
    """Time calls of the module-level function ``module.name`` (restored afterwards)."""
    inner: Callable = getattr(module, name)

    def timed(*a, **kw):
        spans.start((id(module), name))
        try:
            return inner(*a, **kw)
        finally:
            spans.stop((id(module), name), label)

    setattr(module, name, timed)
    try:
        yield
    finally:
        setattr(module, name, inner)


def instrument(model: torch.nn.Module, spans: Spans, stack: ExitStack) -> None:
    """Attach every span of the table to ``model`` (undone when ``stack`` closes)."""
    stack.enter_context(_hooked(model, spans, "forward"))
    stack.enter_context(_hooked(model.backbone.embeddings, spans, "embed"))
    stack.enter_context(_wrapped(model, "_mamba", spans, "mamba"))
    for fn in ("causal_conv1d", "ssd_scan", "ssd_chunked_scan"):
        stack.enter_context(_patched(mamba2, fn, spans, "mamba.conv" if "conv" in fn else "mamba.scan"))
    stack.enter_context(_wrapped(model, "compute_logits", spans, "lm_head"))
    stack.enter_context(_hooked(model.backbone.norm_f, spans, "norm"))
    stack.enter_context(_wrapped(model.backbone.norm_f, "add_forward", spans, "norm"))
    for block in model.backbone.layers:
        stack.enter_context(_hooked(block.norm, spans, "norm"))
        stack.enter_context(_wrapped(block.norm, "add_forward", spans, "norm"))
        if block.kind == "mamba":
            for name, label in (("_in", "mamba.in_proj"), ("_conv", "mamba.conv"),
                                ("_norm_out", "mamba.out_proj")):
                stack.enter_context(_wrapped(block.mixer, name, spans, label))
        elif block.kind in ("attention", "mlp"):
            stack.enter_context(_hooked(block.mixer, spans, block.kind))
        elif block.kind == "moe":
            stack.enter_context(_hooked(block.mixer, spans, "moe"))
            stack.enter_context(_hooked(block.mixer.gate, spans, "moe.router"))
            if block.mixer.shared_experts is not None:
                stack.enter_context(_hooked(block.mixer.shared_experts, spans, "moe.shared"))


def breakdown(engine, input_len: int, prompt: list[int], flops: dict[str, int] | None = None) -> dict:
    """One batch-1 prefill of ``prompt`` (after an unhooked warm-up of the same length), split
    by layer kind. Returns seconds by part, their share of the TTFT, the TTFT, and given the
    prefill's ``flops`` by part (``bench.flops.prefill_flops``), each part's achieved TFLOP/s."""
    if len(prompt) != input_len:
        raise ValueError(f"prompt has {len(prompt)} tokens, expected input_len={input_len}")
    sp = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    warm = [(t + 1) % engine.config.vocab_size or 3 for t in prompt]
    engine.generate(input_ids=[warm], sampling_params=sp)
    spans = Spans(engine.device)
    with ExitStack() as stack:
        instrument(engine.model, spans, stack)
        ttft, _ = timed_generate(engine, [prompt], sp)
    got = spans.totals()
    forward = got.get("forward", 0.0)
    parts = {k: got.get(k, 0.0) for k in TOP}
    parts["other_forward"] = max(forward - sum(parts.values()), 0.0)
    parts["engine"] = max(ttft - forward, 0.0)
    nested = {k: got[k] for k in NESTED if k in got}
    achieved = {} if flops is None else {
        k: sum(flops[f] for f in fs) / parts[k] / 1e12 for k, fs in FLOPS_OF.items() if parts[k] > 0}
    return {
        "bench": "prefill_breakdown", "input_len": input_len, "ttft_s": ttft,
        "forward_s": forward, "forwards": sum(1 for p in spans.pairs if p[0] == "forward"),
        "parts_s": parts, "nested_s": nested,
        "pct_of_ttft": {k: 100 * v / ttft for k, v in parts.items()},
        "achieved_tflops": achieved,
    }


def format_table(row: dict) -> str:
    """The breakdown as an aligned text table (ms and % of TTFT)."""
    ttft = row["ttft_s"]
    title = (f"prefill breakdown: input_len={row['input_len']} ttft={ttft * 1e3:.2f} ms "
             f"({row['forwards']} forward(s))")
    lines = [title, f"{'part':<16}{'ms':>12}{'% ttft':>9}{'TFLOP/s':>10}"]
    for k, v in row["parts_s"].items():
        rate = row["achieved_tflops"].get(k)
        rate_s = "" if rate is None else f"{rate:>10.4g}"
        lines.append(f"{k:<16}{v * 1e3:>12.3f}{100 * v / ttft:>9.1f}{rate_s}")
        for sub, s in row["nested_s"].items():
            if sub.startswith(k + "."):
                lines.append(f"  {sub:<14}{s * 1e3:>12.3f}{100 * s / ttft:>9.1f}")
    return "\n".join(lines)
