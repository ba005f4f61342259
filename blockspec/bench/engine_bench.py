"""End-to-end decode benchmark: tokens/s, per-step time and achieved weight bandwidth.

    blockspec bench [--model-path P | --preset lightning-mini|nemotron-3.5-lightning|tiny
        [--quantized]] [--random-draft dflash|dspark|dflash-nemotron35|dspark-nemotron35
        [--simulate-accept-length TAU | --simulate-accept-profile P1,P2,...|NAME]
        [--simulate-low-accept-phases every=N,len=L,scale=S]]
        [--speculative-adaptive [--fixed-widths 2,4,6]]
        --batch-size 1,4,16,64 --input-len 128 --output-len 64 [--compare-eager]
        [--compare-transformers] [--json-schema FILE]

Presets are random models built directly on the device; nothing is written to disk. One JSON
line per (batch size, graphs on/off) and one for transformers when asked.

Decode time excludes prefill (a max_new_tokens=1 run is timed separately and subtracted).
Achieved GB/s = weight bytes one step must read / step time, where the bytes are every dense
parameter plus, per MoE layer, the expected number of distinct experts a step touches under
uniform routing, D(n) = E (1 - (1 - k/E)^n) for n = batch x verify width tokens (each token picks
k of E experts; an expert is missed by all n with probability (1 - k/E)^n). The floor is those
bytes at the H200's 4.8 TB/s (NVIDIA's HBM3e figure; a device copy measures about 4.2-4.3 TB/s,
so 100 % of the floor is out of reach).

Simulated acceptance (``bench/accept_profile.py``, ``speculative/simulated_accept.py``)
forces which drafts a verify accepts; a speculative row reports the realised per-position
rates (``accept_rates``: P(draft i accepted | drafts before it accepted), from the pooled
accept histogram) and, when simulated, what the profile and phases predict for the same steps;
without phases also ``expected_decode_tok_per_s``, the tokens the profile commits on average
at the widths the steps ran, over the decode time (the realised coins' noise removed: a batch
1 run of 128 tokens has about 30 verifies, so its accept length varies by several per cent).
``--fixed-widths`` pins an adaptive engine's width for extra rows, so adaptive and the fixed
widths share one engine.

``--json-schema`` constrains every sequence to a schema; a sequence may then end before
``--output-len`` (when its JSON closes), so steps are counted from the tokens produced.
``--prefill`` runs ``bench/prefill_bench.py`` instead (TTFT against the compute floor).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch

from blockspec.bench import accept_profile, draft_presets, presets
from blockspec.bench.bench_args import with_lengths
from blockspec.bench.jsonl import append_rows
from blockspec.bench.presets import preset_config
from blockspec.bench.steady_state import measure_steady
from blockspec.bench.synthetic_tokenizer import synthetic_tokenizer
from blockspec.bench.timing import sync_device, timed_generate
from blockspec.checkpoint import DTYPES
from blockspec.engine import Engine
from blockspec.engine.engine import resolve_device
from blockspec.speculative.simulated_accept import SimulatedAcceptance

H200_BW = 4.8e12


def step_weight_bytes(model: torch.nn.Module, tokens_per_step: int) -> float:
    """Bytes of weights one forward over ``tokens_per_step`` tokens must read."""
    cfg = model.cfg
    total = 0.0
    for name, t in model.state_dict().items():
        size = t.numel() * t.element_size()
        if ".experts." in name:
            E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
            touched = E * (1 - (1 - k / E) ** tokens_per_step)
            size *= touched / E
        if name == "backbone.embeddings.weight":
            size = tokens_per_step * cfg.hidden_size * t.element_size()
        total += size
    return total


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def build_engine(args: argparse.Namespace, max_bs: int, **engine_kw):
    """The engine under test: a folder, or a preset built on the device (+ a random draft);
    ``engine_kw`` are further EngineArgs fields (the prefix cache's, for its bench). The
    simulated-acceptance flags are checked before anything is built, and applied after."""
    accept_profile.check_simulation_flags(*simulation_flags(args), getattr(args, "json_schema", None),
                                          bool(getattr(args, "simulate_text", False)))
    cache = max_bs * (args.input_len + args.output_len + 64)
    common = dict(max_running_requests=max_bs, max_total_tokens=cache, **engine_kw,
                  cuda_graph_max_bs=max_bs, disable_cuda_graph=args.disable_cuda_graph,
                  speculative_draft_lm_head=args.speculative_draft_lm_head,
                  speculative_adaptive=bool(getattr(args, "speculative_adaptive", False)))
    sizes = getattr(args, "chunked_prefill_size", None)
    if sizes is not None:       # a list (--prefill runs each): the engine is built for the largest
        common["chunked_prefill_size"] = max(sizes) if isinstance(sizes, list) else sizes
    if args.model_path is not None:
        kw = {k: getattr(args, k) for k in ("device", "dtype", "speculative_algorithm",
                                             "speculative_draft_model_path",
                                             "speculative_num_draft_tokens") if getattr(args, k) is not None}
        if args.random_draft:
            raise ValueError("--random-draft builds a draft for a --preset target; with --model-path "
                             "give --speculative-draft-model-path")
        return _simulated(Engine(model_path=args.model_path, **common, **kw), args), args.model_path
    device = resolve_device(args.device or "auto")
    dtype = DTYPES[args.dtype] if args.dtype not in (None, "auto") else torch.bfloat16
    cfg = presets.preset_config(args.preset)
    need = presets.weight_bytes(cfg, dtype, args.quantized)
    if device.type == "cpu" and need > 0.6 * _memory_bytes():
        raise ValueError(f"preset {args.preset} needs {need / 2**30:.1f} GiB of weights in "
                         f"{str(dtype).split('.')[-1]}, more than this machine's memory allows "
                         f"({_memory_bytes() / 2**30:.1f} GiB); run it on a GPU")
    model = presets.build_target(args.preset, device, dtype, args.quantized)
    draft = None
    if args.random_draft:
        draft = draft_presets.build_random_draft(args.random_draft, cfg, random_draft_block(args),
                                                 device, dtype)
    label = f"random:{args.preset}" + (":lightning-quant" if args.quantized else "")
    tokenizer = synthetic_tokenizer(cfg["vocab_size"]) if args.json_schema else None
    return _simulated(Engine.from_model(model, draft=draft, tokenizer=tokenizer, **common), args), label


def _simulated(engine, args: argparse.Namespace):
    """``engine`` with the simulated acceptance the flags ask for (every bench honours them)."""
    try:
        attach_simulation(engine, simulation_flags(args), bool(getattr(args, "simulate_text", False)))
    except ValueError:
        engine.shutdown()
        raise
    return engine


def random_draft_block(args: argparse.Namespace) -> int:
    """Block size of ``--random-draft``: DFlash block W, DSpark gamma W - 1 (default W 4)."""
    width = args.speculative_num_draft_tokens or 4
    return width if draft_presets.algorithm_of(args.random_draft) == "dflash" else width - 1


def _round4(xs: list[float | None]) -> list[float | None]:
    return [None if x is None else round(x, 4) for x in xs]


def acceptance_fields(engine, outs: list[dict], decode_s: float) -> dict:
    """Realised per-position rates of a speculative run and, under simulated acceptance, the
    mean and rates the profile and phases predict for the same requests' verify steps (and,
    without phases, the tokens per second the profile predicts at the widths run)."""
    hists = [o["meta_info"].get("spec_accept_histogram") or [] for o in outs]
    width = engine.drafter.width
    pooled = [sum(h[i] for h in hists if len(h) > i) for i in range(width)]
    # a batch that starts together runs until its slowest request: the spread of the
    # requests' verify counts is decode time that their mean acceptance does not predict
    steps = [o["meta_info"]["spec_verify_ct"] for o in outs]
    out = {"accept_histogram": pooled,
           "accept_rates": _round4(accept_profile.histogram_rates(pooled)),
           "verify_steps_mean": round(statistics.mean(steps), 2), "verify_steps_max": max(steps)}
    # request steps per verify width (index w - 1; 1 = plain decode)
    widths = [o["meta_info"].get("spec_width_histogram") or [] for o in outs]
    hist = [sum(h[i] for h in widths if len(h) > i) for i in range(width)]
    if engine.drafter.adaptive:     # rates above then mix widths
        out.update(width_histogram=hist, mean_verify_width=round(
            sum((i + 1) * n for i, n in enumerate(hist)) / max(sum(hist), 1), 3))
    sim = engine.drafter.simulate
    if sim is not None:
        phases = (accept_profile.LowAcceptPhases(sim.every, sim.low_len, sim.low_scale)
                  if sim.every else None)
        low = sum(phases.low_steps(n) for n in steps) if phases else 0
        mean, rates = accept_profile.expected_rates(sim.probs, width - 1, phases,
                                                    sum(steps) - low, low)
        out.update(simulated_expected_accept_length=round(mean, 4),
                   simulated_expected_rates=_round4(rates), simulated_low_phase_steps=low)
        if phases is None:      # what the steps' widths commit on average: no coin noise
            tokens = sum(n * accept_profile.mean_accept_length(sim.probs, i)
                         for i, n in enumerate(hist))
            out["expected_decode_tok_per_s"] = round(tokens / decode_s, 2)
    return out


def decode_window(outs: list[dict]) -> float | None:
    """Seconds from a run's last first token to its last finish, or None when the first tokens
    came from more than one prefill (spread over more than 1 % of the window)."""
    info = [o["meta_info"] for o in outs]
    first = [i["ttft"] for i in info]
    window = max(i["e2e_latency"] for i in info) - max(first)
    return window if window > 0 and max(first) - min(first) <= 0.01 * window else None


def measure(engine, batch: int, args: argparse.Namespace) -> dict:
    """Median decode time of ``repeats`` runs of ``batch`` random prompts, each run's own
    window from its last first token to its last finish when one prefill gave every request its
    first token (at batch 1 always; prefill time is then the runs' own last first token), else
    the run minus a prefill-only run (prefill chunks then interleave with other requests'
    decode steps: the batch has no clean first-token time). A separate prefill run's time
    varies by a few decode steps at small batches, so it is run only where it must be."""
    g = torch.Generator().manual_seed(batch)
    vocab = engine.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.input_len,), generator=g).tolist() for _ in range(batch)]
    sp = {"max_new_tokens": args.output_len, "temperature": args.temperature, "ignore_eos": True}
    if args.json_schema:
        sp["json_schema"] = Path(args.json_schema).read_text()

    def timed(params: dict) -> tuple[float, list[dict]]:
        return timed_generate(engine, prompts, params)

    timed(sp)                                              # warm-up: allocations, graph capture
    runs = [timed(sp) for _ in range(args.repeats)]
    outs = runs[0][1]
    windows = [decode_window(r[1]) for r in runs]
    if all(w is not None for w in windows):
        decode = statistics.median(windows)
        prefill = statistics.median(max(o["meta_info"]["ttft"] for o in r[1]) for r in runs)
    else:   # chunks interleaved with decode: a prefill-only run subtracted
        prefill = statistics.median(timed({**sp, "max_new_tokens": 1})[0]
                                    for _ in range(args.repeats))
        decode = max(statistics.median(r[0] for r in runs) - prefill, 1e-9)
    new_tokens = sum(len(o["output_ids"]) for o in outs) - len(outs)     # first token is prefill's
    width, tau = width_and_accept_length(engine, outs)
    steps = (max(o["meta_info"]["spec_verify_ct"] for o in outs) if engine.drafter is not None
             else max(len(o["output_ids"]) for o in outs) - 1)
    step_s = decode / max(steps, 1)
    spec = speculative_fields(engine, batch, outs, decode)
    # adaptive: the weight bytes of a step at the mean width the chooser ran
    wbytes = step_weight_bytes(engine.model, round(batch * spec.get("mean_verify_width", width)))
    floor_s = wbytes / H200_BW
    return {
        "batch_size": batch, "verify_width": width, "accept_length": round(tau, 3), **spec,
        "mean_output_len": round(statistics.mean(len(o["output_ids"]) for o in outs), 1),
        "prefill_s": round(prefill, 4), "decode_s": round(decode, 4),
        "decode_tok_per_s": round(new_tokens / decode, 2),
        "tok_per_s_per_seq": round(new_tokens / decode / batch, 2),
        "step_ms": float(f"{step_s * 1e3:.4g}"), "weight_bytes_per_step": int(wbytes),
        "achieved_GBps": float(f"{wbytes / step_s / 1e9:.4g}"),
        "floor_step_ms_at_4.8TBps": float(f"{floor_s * 1e3:.4g}"),
        "pct_of_floor": float(f"{100 * floor_s / step_s:.3g}"),
    }


def width_and_accept_length(engine, outs: list[dict]) -> tuple[int, float]:
    """The verify width a row names (the maximum, for an adaptive engine) and the requests'
    mean tokens committed per step (1 for plain decoding)."""
    if engine.drafter is None:
        return 1, 1.0
    return (engine.drafter.width,
            statistics.mean(o["meta_info"]["spec_accept_length"] for o in outs))


def speculative_fields(engine, batch: int, outs: list[dict], decode_s: float) -> dict:
    """A speculative row's acceptance fields and, for an adaptive engine, the chooser's step
    times at this batch (its captured or eager size), widths 1..W: at the end of the run
    (refined by the steps it ran) and as timed at start-up. Empty without a draft."""
    if engine.drafter is None:
        return {}
    spec = acceptance_fields(engine, outs, decode_s)
    if engine.drafter.adaptive and engine.drafter.cost.measured:
        cost, widths = engine.drafter.cost, engine.drafter.widths
        spec["cost_ms_by_width"] = [round(cost.time(batch, w) * 1e3, 3) for w in widths]
        spec["startup_cost_ms_by_width"] = [round(cost.startup(batch, w) * 1e3, 3) for w in widths]
    return spec


def steady_row(engine, batch: int, args: argparse.Namespace) -> dict:
    """``--steady-state``'s row (``bench/steady_state.py``) with the speculative fields."""
    row, outs = measure_steady(engine, batch, args)
    spec = speculative_fields(engine, batch, outs, row["wall_s"])
    width, tau = width_and_accept_length(engine, outs)
    return {"verify_width": width, "accept_length": round(tau, 3), **row, **spec}


def pinned_widths(engine, widths: list[int] | None) -> list[int]:
    """``--fixed-widths``, checked against the adaptive engine's candidate widths."""
    if not widths:
        return []
    if engine.drafter is None or not engine.drafter.adaptive:
        raise ValueError("--fixed-widths pins the width of an adaptive engine: give "
                         "--speculative-adaptive and a draft")
    bad = [w for w in widths if w not in engine.drafter.widths]
    if bad:
        raise ValueError(f"--fixed-widths {','.join(map(str, bad))}: not a candidate width of "
                         f"this engine ({','.join(map(str, engine.drafter.widths))})")
    return list(widths)


def transformers_decode(model_path: str | None, preset_cfg: dict | None, device: torch.device,
                        batch: int, args: argparse.Namespace, new_tokens: int) -> dict:
    """transformers' NemotronHForCausalLM on the same shapes and prompts: greedy ``generate``,
    timed the same way (prefill-only run subtracted). Its weights are its own random init for a
    preset (timing does not depend on the values), the folder's weights otherwise."""
    import transformers  # lazy: an optional dependency (the test extra)

    gc.collect()
    if model_path is not None:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(device)
    else:
        from transformers import NemotronHConfig, NemotronHForCausalLM  # lazy: as above

        cfg = {k: v for k, v in preset_cfg.items() if k not in ("architectures", "model_type", "dtype")}
        pattern = cfg.pop("hybrid_override_pattern")
        names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
        try:
            hf_cfg = NemotronHConfig(**cfg, layers_block_type=[names[c] for c in pattern])
        except (TypeError, ValueError):            # an older transformers: the legacy spelling
            hf_cfg = NemotronHConfig(**cfg, hybrid_override_pattern=pattern)
        with torch.device(device):
            hf = NemotronHForCausalLM._from_config(hf_cfg, dtype=torch.bfloat16)
    hf.eval()
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, hf.config.vocab_size, (batch, args.input_len), generator=g).to(device)

    def timed(n: int) -> float:
        sync_device(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync_device(device)
        return time.perf_counter() - t0

    timed(2)
    prefill = timed(1)
    total = timed(new_tokens)
    step_s = max(total - prefill, 1e-9) / max(new_tokens - 1, 1)
    del hf
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return {"engine": f"transformers {transformers.__version__}", "batch_size": batch,
            "new_tokens": new_tokens, "step_ms": float(f"{step_s * 1e3:.4g}"),
            "decode_tok_per_s": round(batch / step_s, 2)}


def simulation_flags(args: argparse.Namespace) -> tuple:
    """(profile, length, phases) of the simulated-acceptance flags (None where not given)."""
    return (getattr(args, "simulate_accept_profile", None),
            getattr(args, "simulate_accept_length", None),
            getattr(args, "simulate_low_accept_phases", None))


def simulation_for(engine, flags: tuple) -> accept_profile.Simulation | None:
    """The simulation the flags ask of ``engine``'s drafter (None: no simulation)."""
    profile, length, _ = flags
    if profile is None and length is None:
        return None
    if engine.drafter is None:
        flag = accept_profile.PROFILE_FLAG if profile is not None else accept_profile.LENGTH_FLAG
        raise ValueError(f"{flag} needs a draft (--random-draft or --speculative-draft-model-path)")
    return accept_profile.resolve_simulation(*flags, engine.drafter.gamma)


def attach_simulation(engine, flags: tuple, text: bool = False) -> None:
    """Set the drafter's simulated acceptance from the (profile, length, phases) flags; with
    it, or with ``text`` (``--simulate-text``), every step commits the simulated text."""
    sim = simulation_for(engine, flags)
    if text and sim is None and engine.drafter is not None:
        raise ValueError(f"{accept_profile.TEXT_FLAG} with a draft needs "
                         f"{accept_profile.LENGTH_FLAG} or {accept_profile.PROFILE_FLAG} (which "
                         f"imply it): a verify commits the simulated text only when the "
                         f"simulation decides what it accepts")
    engine.runner.simulate_text = text or sim is not None
    if sim is None:
        return
    p = sim.phases
    engine.drafter.simulate = SimulatedAcceptance(
        sim.probs, engine.device, every=p.every if p else 0, low_len=p.length if p else 0,
        low_scale=p.scale if p else 1.0)


def single_input_len(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``input_len`` one int: the decode bench takes one prompt length."""
    lens = args.input_len if isinstance(args.input_len, list) else [args.input_len]
    if len(lens) != 1:
        raise ValueError(f"--input-len takes one length for the decode benchmark (a list only "
                         f"with --prefill), got {','.join(map(str, lens))}")
    return argparse.Namespace(**{**vars(args), "input_len": lens[0]})


def run(args: argparse.Namespace) -> list[dict]:
    args = single_input_len(with_lengths(args))
    if isinstance(args.chunked_prefill_size, list) and len(args.chunked_prefill_size) > 1:
        raise ValueError("--chunked-prefill-size takes one size for the decode benchmark (a "
                         "list only with --prefill)")
    if getattr(args, "breakdown", False):
        raise ValueError("--breakdown splits a prefill: use it with --prefill")
    steady = getattr(args, "steady_state", None)
    if steady is not None and (steady < 1 or args.compare_transformers):
        raise ValueError(f"--steady-state takes the rounds of requests a batch size runs (>= 1, "
                         f"got {steady}), and not with --compare-transformers (fixed batches)")
    batches = args.batch_size if isinstance(args.batch_size, list) else [args.batch_size]
    flags = simulation_flags(args)
    engine, label = build_engine(args, max(batches))
    # whole prefill chunks while requests decode too: a batch's decode time is its run less a
    # prefill-only run, which must prefill the prompts the same way
    engine.scheduler.decoding_chunk = engine.scheduler.chunk
    sim = simulation_for(engine, flags)
    sizes = {}
    if args.random_draft and args.model_path is None:
        sizes = draft_presets.draft_sizes(args.random_draft, preset_config(args.preset),
                                          random_draft_block(args))
    base = {
        "model": label, "device": torch.cuda.get_device_name(engine.device)
        if engine.device.type == "cuda" else "cpu", "dtype": str(engine.dtype).split(".")[-1],
        "input_len": args.input_len, "output_len": args.output_len,
        "speculative": type(engine.drafter.draft).__name__ if engine.drafter else None,
        "speculative_adaptive": bool(engine.drafter and engine.drafter.adaptive),
        "simulated_text": engine.runner.simulate_text,
        "simulated_accept_length": args.simulate_accept_length,
        "simulated_accept_profile": None if sim is None else sim.label,
        "simulated_profile_accept_length": None if sim is None else round(
            accept_profile.mean_accept_length(sim.probs, len(sim.probs)), 4),
        "simulated_low_accept_phases": None if sim is None or sim.phases is None else {
            "every": sim.phases.every, "len": sim.phases.length, "scale": sim.phases.scale},
        "random_draft": args.random_draft, **sizes,
        "draft_lm_head": (None if engine.drafter is None else
                          "nvfp4" if engine.drafter.head is not None else "target"),
        "attention_backend": engine.backends.decode,
        "json_schema": args.json_schema,
    }
    try:
        pinned = pinned_widths(engine, getattr(args, "fixed_widths", None))
    except ValueError:
        engine.shutdown()
        raise
    results = []

    def emit(row: dict) -> None:
        """Print a row and append it to ``--out`` as soon as it is measured (a run cut short
        by a time limit keeps the rows it finished)."""
        results.append(row)
        print(json.dumps(row), flush=True)
        append_rows(getattr(args, "out", None), [row])

    graphs = engine.runner.graphs
    for batch in batches:
        modes = [graphs is not None]
        if args.compare_eager and graphs is not None:
            modes.append(False)
        for use_graph in modes:
            engine.runner.graphs = graphs if use_graph else None
            for w in pinned + [None]:
                if engine.drafter is not None:
                    engine.drafter.chooser.force = None if w is None else itertools.repeat(w)
                row = (steady_row if steady else measure)(engine, batch, args)
                if pinned:
                    row.update(pinned_width=w, verify_width=w or row["verify_width"])
                emit({**base, "cuda_graph": use_graph, **row})
        engine.runner.graphs = graphs
    cfg_dict = None if args.model_path else preset_config(args.preset)
    device, dtype = engine.device, engine.dtype
    engine.shutdown()
    del engine
    if args.compare_transformers:
        if dtype != torch.bfloat16 or args.quantized:
            raise ValueError("--compare-transformers compares the bf16 model")
        for batch in batches[:1]:
            try:
                hf = {**base, **transformers_decode(args.model_path, cfg_dict, device, batch, args,
                                                    min(args.output_len, 16))}
            except Exception as e:      # noqa: BLE001 - report it; the other rows stand
                emit({**base, "engine": "transformers", "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            ours = next(r for r in results if r["batch_size"] == batch and r["cuda_graph"] == (graphs is not None))
            hf["blockspec_speedup"] = round(hf["step_ms"] / ours["step_ms"] * ours["accept_length"], 2)
            emit(hf)
    return results


def main(args: argparse.Namespace) -> int:
    run(args)           # each row reaches --out as it is measured
    return 0
