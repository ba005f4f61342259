"""SASS of the Mamba-2 step kernel without a GPU: compile ``_mamba_steps_kernel`` for sm_90 at
Lightning's shapes with the ptxas/nvdisasm that ship in the triton wheel, then count what a
step costs: instructions by kind, global loads, and where in the program the loads sit. A
load placed after the previous step's stores waits a DRAM round trip per step; loads all at
the front are in flight together.

    python scripts/sass_mamba_step.py [--steps 7] [--block-p 32] [--warps 4] [--sass FILE]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)   # the compiled kernel, whatever the shell asks

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockspec.kernels.mamba_step import _KERNELS  # noqa: E402
from blockspec.kernels.triton_loader import load_kernels, next_pow2  # noqa: E402

# Lightning's Mamba: 64 heads of 64 channels, state 128, 8 groups, bf16 in_proj output
H, P, N, G = 64, 64, 128, 8
POINTERS = {"ZXBCDT": "*bf16", "CONV_W": "*bf16", "CONV_B": "*bf16", "DT_BIAS": "*fp32",
            "A_LOG": "*fp32", "D_SKIP": "*fp32", "CONV_STATE": "*fp32", "SSM_STATE": "*fp32",
            "SLOTS": "*i32", "Y": "*fp32", "STEP_SCRATCH": "*fp32", "XBC_SCRATCH": "*fp32"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=7, help="T: 1 is decode (commits)")
    ap.add_argument("--block-p", type=int, default=32)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--sass", help="also write the whole SASS here")
    a = ap.parse_args()
    kern = load_kernels(_KERNELS)._mamba_steps_kernel
    names = list(kern.arg_names)
    const = dict(T=a.steps, T_PAD=next_pow2(a.steps), H=H, P=P, N=N, G=G, DINNER=H * P,
                 CONV=H * P + 2 * G * N, BLOCK_P=a.block_p, COMMIT=a.steps == 1, HAS_BIAS=True,
                 CLAMP=False)
    const = {k: v for k, v in const.items() if k in names}
    sig = {n: "constexpr" if n in const else POINTERS.get(n, "fp32" if n.startswith("dt_")
                                                            else "i32") for n in names}
    src = ASTSource(fn=kern, signature=sig,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": a.warps, "enable_fp_fusion": False})
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", f.name],
                              capture_output=True, text=True, check=True).stdout
    if a.sass:
        Path(a.sass).write_text(sass)
    body = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", line).split(";")[0]
            for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
    ops = [(x.split()[1] if x.startswith("@") else x.split()[0]).split(".")[0] for x in body]
    loads = [i for i, op in enumerate(ops) if op == "LDG"]
    stores = [i for i, op in enumerate(ops) if op == "STG"]
    count = collections.Counter(ops)
    where = [round(loads[int(q * (len(loads) - 1))] / len(ops), 2) for q in (0, .5, .9, 1)]
    print(f"T={a.steps} block_p={a.block_p} warps={a.warps}: {len(ops)} instructions, "
          f"{len(loads)} global loads ({sum(i > stores[0] for i in loads) if stores else 0} "
          f"after the first store), {len(stores)} stores; loads at fractions {where} of the "
          f"program (min, median, 90 %, max)")
    print(" ".join(f"{k}={count[k]}" for k in ("FFMA", "FMUL", "FADD", "MUFU", "SHFL", "BAR",
                                               "STS", "LDS")))


if __name__ == "__main__":
    main()
