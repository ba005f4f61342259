"""Bracket for the simulated-acceptance bench: the same b1 benches with the draft's proposals
replaced by uniformly random tokens (every verify token distinct, routing as diverse as this
random-weight target gives), next to the normal ones, and AR, in one process on one GPU: a
random draft's proposals repeat tokens (DFlash), so its verify touches fewer experts than a
trained draft's would.

    python scripts/bench_random_verify_tokens.py
"""
import argparse, gc, torch
from blockspec.bench.bench_args import add_arguments
from blockspec.bench import engine_bench
from blockspec.speculative.worker import SpecWorker
p = argparse.ArgumentParser(); add_arguments(p)
orig = SpecWorker.draft_logits
def random_tokens(self, h):
    base = orig(self, h)
    idx = torch.randint(3, base.shape[-1], base.shape[:-1], device=base.device)
    return base.scatter(-1, idx[..., None], 1e9)
for mode in ("normal", "random-tokens"):
    SpecWorker.draft_logits = orig if mode == "normal" else random_tokens
    for kind, w, tau in (("dflash", 6, 4.2), ("dspark", 4, 3.7)):
        a = p.parse_args(["--device", "cuda", "--preset", "nemotron-3.5-lightning", "--quantized",
                          "--batch-size", "1", "--output-len", "256", "--repeats", "2",
                          "--random-draft", kind, "--speculative-num-draft-tokens", str(w),
                          "--simulate-accept-length", str(tau)])
        r = engine_bench.run(a)[0]
        print(mode, kind, {k: r[k] for k in ("step_ms", "accept_length", "decode_tok_per_s")}, flush=True)
        gc.collect(); torch.cuda.empty_cache()
a = p.parse_args(["--device", "cuda", "--preset", "nemotron-3.5-lightning", "--quantized",
                  "--batch-size", "1", "--output-len", "256", "--repeats", "2"])
r = engine_bench.run(a)[0]
print("AR", {k: r[k] for k in ("step_ms", "accept_length", "decode_tok_per_s")}, flush=True)
