"""Where a decode / speculative step spends its time (torch profiler), for the notes that the
performance work builds on.

    python scripts/profile_step.py --model-path M [--draft D --algo DFLASH] --out FILE
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from blockspec import Engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--draft")
    p.add_argument("--algo", default="DFLASH")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    kw = {"speculative_algorithm": a.algo, "speculative_draft_model_path": a.draft} if a.draft else {}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    e = Engine(model_path=a.model_path, device=dev, dtype="bfloat16" if dev == "cuda" else "float32", **kw)
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(128)] for i in range(a.batch_size)]
    sp = {"max_new_tokens": a.steps, "temperature": 0, "ignore_eos": True}
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    e.generate(input_ids=prompts, sampling_params=sp)          # warm-up
    sync()
    with profile(activities=acts) as prof:
        e.generate(input_ids=prompts, sampling_params=sp)
        sync()
    with open(a.out, "w") as f:
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
        f.write("\n\n")
        if dev == "cuda":
            f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
        phases = [ev for ev in prof.key_averages() if ev.key.startswith(("spec.", "decode."))]
        f.write("\nphase                 calls   cpu total ms   (per call ms)\n")
        for ev in sorted(phases, key=lambda ev: ev.key):
            f.write(f"{ev.key:20s} {ev.count:6d} {ev.cpu_time_total / 1e3:12.2f} "
                    f"{ev.cpu_time_total / 1e3 / ev.count:10.3f}\n")
        syncs = sum(ev.count for ev in prof.key_averages()
                    if ev.key in ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize",
                                  "cudaDeviceSynchronize", "aten::nonzero"))
        f.write(f"\nhost-sync-like calls in {a.steps} steps: {syncs}\n")


if __name__ == "__main__":
    main()
