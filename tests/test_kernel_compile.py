"""Kernels compile for sm_90 without a GPU (Triton's own ptxas): the interpreter runs the
kernels' Python, not the compiler, so a construct it accepts could still fail to compile on the
GPU. The paged attention kernel in both prefill variants (masked and unmasked full blocks) at
the tile shapes ``scripts/tune_attention_prefill.py`` sweeps; a speculative step's commit
(tokens, output columns, EWMA, inputs' advance) at batch blocks from 1 to 256 rows;
silu(gate) * up in bf16."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
needs_ptxas = pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel has no ptxas")

# run in a fresh process (no TRITON_INTERPRET): sm90(kernel, ptrs, const, **options) compiles
# one specialisation, pointer/float arguments typed by ``ptrs``, the rest i32
PRELUDE = r'''
from triton import compile as tcompile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from blockspec.kernels.triton_loader import load_kernels


def sm90(k, ptrs, const, **options):
    names = list(k.arg_names)
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in names}
    src = ASTSource(fn=k, signature=sig,
                    constexprs={(names.index(c),): v for c, v in const.items()})
    assert tcompile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]
'''

ATTENTION = r'''
from blockspec.kernels import paged_attention as pa
k = load_kernels(pa._KERNELS)._attn_kernel
ptrs = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", PM="*fp32", PL="*fp32", PO="*fp32",
            BT="*i32", SLOTS="*i64", SEQ="*i64", QST="*i64", TILE_REQ="*i32", TILE_R0="*i32",
            SINK="*fp32", scale="fp32")
for full in (False, True):
    for bm, bn, warps, stages in ((64, 64, 4, 3), (128, 128, 8, 3), (256, 64, 8, 2)):
        sm90(k, ptrs, dict(G=16, D=128, BLOCK_D=128, PAGE=16, BLOCK_M=bm, BLOCK_N=bn, SPLITS=1,
                           CAUSAL=True, WINDOWED=False, HAS_SINK=False, IEEE=False,
                           STATIC_ITERS=0, FULL_BLOCKS=full, EVEN_D=True),
             num_warps=warps, num_stages=stages)
print("compiled")
'''

SPEC_COMMIT = r'''
from blockspec.kernels import spec_commit as sc
k = load_kernels(sc._KERNELS)._spec_commit_kernel
i64 = "*i64"
ptrs = dict(ACC=i64, BONUS=i64, DRAFTS=i64, SLOT=i64, CTR=i64, TOKEN=i64, PREFIX=i64, SCTR=i64,
            TABLE="*fp32", ENGINE="*fp32", ENGINE_N="*fp32", ENDED="*i32", OUT="*fp64",
            TOKS=i64, STOP=i64, alpha="fp32", engine_alpha="fp32", engine_prior_n="fp32")
for bb, t, g, ewma, stops, warps in ((1, 1, 7, True, 1, 4), (1, 8, 7, False, 0, 4),
                                     (64, 5, 4, True, 2, 4), (256, 8, 7, True, 0, 8)):
    sm90(k, ptrs, dict(T=t, G=g, HAS_EWMA=ewma, N_STOP=stops, BLOCK_B=bb, BLOCK_T=8,
                       BLOCK_G=8), num_warps=warps)
print("compiled")
'''

SILU_MUL = r'''
from blockspec.kernels import silu_mul as sm
k = load_kernels(sm._KERNELS)._silu_mul_kernel
sm90(k, dict(GU="*bf16", Y="*bf16"), dict(BLOCK=1024), num_warps=4)
print("compiled")
'''


def _compiles(body: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, "-c", PRELUDE + body], env=env, capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]


@needs_ptxas
def test_paged_attention_compiles_for_sm90():
    _compiles(ATTENTION)


@needs_ptxas
def test_spec_commit_compiles_for_sm90():
    _compiles(SPEC_COMMIT)


@needs_ptxas
def test_silu_mul_compiles_for_sm90():
    _compiles(SILU_MUL)
