"""Distinct routed experts per MoE layer in the verify forwards of the simulated bench (eager),
and the distinct tokens per verify block: full quantized Lightning, batch 1, 48 tokens.

    python scripts/verify_distinct_experts.py
"""
import argparse, statistics, torch
from blockspec.bench.accept_profile import accept_length_profile
from blockspec.bench.bench_args import add_arguments
from blockspec.bench.engine_bench import build_engine
from blockspec.layers.moe import MoE
from blockspec.speculative.simulated_accept import SimulatedAcceptance
p = argparse.ArgumentParser(); add_arguments(p)
seen = []
orig = MoE.routed_pairs
def routed_pairs(self, h, ids, w, *a, **k):
    if ids.shape[0] > 1:
        seen.append((ids.shape[0], len(set(ids.reshape(-1).tolist()))))
    return orig(self, h, ids, w, *a, **k)
MoE.routed_pairs = routed_pairs
for kind in ("dflash", "dspark"):
    ns = p.parse_args([]); ns.device = "cuda"; ns.preset = "nemotron-3.5-lightning"
    ns.quantized = True; ns.input_len = 128; ns.output_len = 48; ns.disable_cuda_graph = True
    ns.random_draft = kind; ns.speculative_num_draft_tokens = 6 if kind == "dflash" else 4
    engine, _ = build_engine(ns, 1)
    tau = 4.2 if kind == "dflash" else 3.7
    engine.drafter.simulate = SimulatedAcceptance(accept_length_profile(tau, engine.drafter.gamma),
                                                  engine.device)
    toks = []
    tgt = engine.drafter.target
    of = tgt.forward
    def fwd(meta, *a, **k):
        if meta.input_ids.numel() > 1 and meta.input_ids.numel() <= 8:
            toks.append(meta.input_ids.tolist())
        return of(meta, *a, **k)
    tgt.forward = fwd
    seen.clear()
    prompt = torch.randint(3, 100000, (128,)).tolist()
    engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 48, "ignore_eos": True})
    d = [x[1] for x in seen]
    print(f"{kind}: {len(d)} verify MoE calls, tokens {seen[0][0]}: distinct experts per call "
          f"mean {statistics.mean(d):.1f} min {min(d)} max {max(d)}; distinct tokens per block "
          f"{statistics.mean(len(set(t)) for t in toks):.2f}; first blocks {toks[:3]}", flush=True)
    del engine; torch.cuda.empty_cache()
