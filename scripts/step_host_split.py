"""Where a bench step's wall time goes: GPU time of each graph replay (CUDA events around it),
the GPU's idle time between replays, and the host's parts of that idle time, full quantized
Lightning, batch 1, 256 tokens, simulated acceptance (DFlash w6 tau 4.2, DSpark gamma 3 tau 3.7).
Three runs per kind; the third with Python's GC frozen and off.

    python scripts/step_host_split.py ar dflash dspark
"""
import argparse, gc, sys, time, statistics, torch
from blockspec.bench.bench_args import add_arguments
from blockspec.bench.engine_bench import build_engine
p = argparse.ArgumentParser(); add_arguments(p)
med = lambda xs: statistics.median(xs) if xs else float("nan")
for kind in sys.argv[1:]:
    ns = p.parse_args([]); ns.device = "cuda"; ns.preset = "nemotron-3.5-lightning"
    ns.quantized = True; ns.input_len = 128; ns.output_len = 256
    if kind != "ar":
        ns.random_draft = kind; ns.speculative_num_draft_tokens = 6 if kind == "dflash" else 4
    engine, _ = build_engine(ns, 1)
    if kind != "ar":
        engine.drafter.simulate_accept_length = 4.2 if kind == "dflash" else 3.7
    runner, sched = engine.runner, engine.scheduler
    g = runner.graphs
    ev, st = [], []   # per replay: events; host stamps dict
    cur = {}
    o_replay, o_fill, o_run, o_step = g.replay, runner.inputs.fill, runner.run_step, sched.step
    def replay(key):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cur["replay"] = time.perf_counter(); a.record(); out = o_replay(key); b.record()
        ev.append((a, b)); return out
    def fill(*a, **k):
        cur["fill"] = time.perf_counter(); return o_fill(*a, **k)
    def run_step(*a, **k):
        cur["run"] = time.perf_counter(); out = o_run(*a, **k); cur["ret"] = time.perf_counter()
        return out
    def step():
        cur.clear(); cur["step"] = time.perf_counter(); out = o_step()
        cur["end"] = time.perf_counter(); st.append(dict(cur)); return out
    g.replay, runner.inputs.fill, runner.run_step, sched.step = replay, fill, run_step, step
    sp = {"max_new_tokens": 256, "ignore_eos": True}
    prompt = torch.randint(3, 100000, (128,)).tolist()
    engine.generate(input_ids=[prompt], sampling_params=sp)
    for r in range(3):  # run 2: gc frozen and off
        ev.clear(); st.clear()
        if r == 2:
            gc.collect(); gc.freeze(); gc.disable()
        o = engine.generate(input_ids=[prompt], sampling_params=sp)[0]
        torch.cuda.synchronize()
        gpu = [a.elapsed_time(b) for a, b in ev]
        idle = [ev[i][1].elapsed_time(ev[i + 1][0]) for i in range(len(ev) - 1)]
        dec = (o["meta_info"]["e2e_latency"] - o["meta_info"]["ttft"]) * 1e3
        steps = o["meta_info"].get("spec_verify_ct") or 255
        s = [x for x in st if "replay" in x]
        post = [(x["end"] - x["ret"]) * 1e3 for x in s]
        loop = [(b["step"] - a["end"]) * 1e3 for a, b in zip(s, s[1:])]
        pre = [(x["run"] - x["step"]) * 1e3 for x in s]
        fil = [(x["replay"] - x["fill"]) * 1e3 for x in s]
        print(f"{kind} run{r}{' gc off' if r == 2 else ''}: steps {steps} {dec / steps:.3f} ms/step | "
              f"replay GPU {med(gpu):.3f} | GPU idle median {med(idle):.3f} mean "
              f"{statistics.mean(idle):.3f} | host ms: after readback {med(post):.3f}, loop "
              f"{med(loop):.3f}, before run_step {med(pre):.3f}, fill+upload {med(fil):.3f}",
              flush=True)
    gc.enable(); gc.unfreeze()
    del engine; torch.cuda.empty_cache()
