"""SASS of the W4A16 v2 kernel without a GPU: compile it for sm_90 with the ptxas/nvdisasm that
ship in the triton wheel, find the K loop (the backward branch) and count its instructions by
opcode. The loop of a pair-mode verify call (dedup, shared expert riding, relu2) is where a
step's MoE time goes; instructions per weight say whether a change can help before any device
time is spent (docs/benchmarks.md).

    python scripts/sass_w4a16.py [--block-n 64] [--block-k 128] [--warps 2] [--stages 3]
        [--maxnreg 128] [--dense] [--sass FILE]
"""
import argparse, collections, os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from blockspec.kernels.w4a16 import v2_kernel

p = argparse.ArgumentParser()
p.add_argument("--block-n", type=int, default=64)
p.add_argument("--block-k", type=int, default=128)
p.add_argument("--warps", type=int, default=2)
p.add_argument("--stages", type=int, default=3)
p.add_argument("--maxnreg", type=int)
p.add_argument("--swap", action="store_true", help="W @ x^T (wgmma, x in shared memory)")
p.add_argument("--dense", action="store_true", help="a dense call instead of the pair mode")
p.add_argument("--sass", help="also write the whole SASS here")
a = p.parse_args()

os.environ.pop("TRITON_INTERPRET", None)   # the compiled kernel, whatever the shell asks
kern = v2_kernel()
names = list(kern.arg_names)
ptrs = {"x_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "ws2_ptr": "*fp32", "out_ptr": "*bf16",
        "part_ptr": "*bf16", "cnt_ptr": "*fp32", "blk_expert_ptr": "*i32", "blk_row0_ptr": "*i32",
        "blk_row1_ptr": "*i32"}
const = dict(BLOCK_M=16, BLOCK_N=a.block_n, BLOCK_K=a.block_k, SLICES=1, SPLIT=1, SWAP=a.swap,
             DECODE=1, GROUPED=False, EVEN_N=True, MASK_K=False, SCALE_WORDS=a.block_k >= 128,
             K_ITERS=0, N_INNER=False, X_PERM=False, COL_SCALE=False)
if a.dense:
    const.update(PAIRS=0, TOPK=1, X_PER_PAIR=False, DEDUP=False, RELU2=False, DISTINCT=False,
                 SHARED=0, SHARED_BASE=0)
else:             # the 36-pair verify up call: 6 tokens x top-6, the shared expert's 2 slices
    const.update(PAIRS=1, TOPK=6, X_PER_PAIR=False, DEDUP=True, RELU2=True, DISTINCT=True,
                 SHARED=2, SHARED_BASE=128)
sig = {n: ("constexpr" if n in const else ptrs.get(n, "i32")) for n in names}
# what the launcher's specialization tells the compiler at Lightning's shapes: 16-byte aligned
# pointers, N / K / strides divisible by 16 (stride_sn = K/16 = 168 is not)
div16 = [n for n in ptrs] + ["N", "K", "k_per_split", "stride_xm", "stride_we", "stride_wn",
                             "stride_se", "stride_om"]
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
src = ASTSource(fn=kern, signature=sig,
                constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
opts = {"num_warps": a.warps, "num_stages": a.stages}
if a.maxnreg:
    opts["maxnreg"] = a.maxnreg
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(c.asm["cubin"]); f.flush()
    sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", f.name], capture_output=True,
                          text=True, check=True).stdout
if a.sass:
    open(a.sass, "w").write(sass)
labels, ins = {}, []
for line in sass.splitlines():
    m = re.match(r"^\.(L_x_\d+):", line.strip())
    if m:
        labels[m.group(1)] = len(ins)
        continue
    m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
    if m:
        ins.append(m.group(1).strip())
weights = a.block_n * a.block_k // (32 * a.warps)
print(f"shared memory {c.metadata.shared} B; {weights} weights per thread per K step")
for i, s in enumerate(ins):
    m = re.search(r"BRA.*`\(\.(L_x_\d+)\)", s)
    if m and labels.get(m.group(1), 1 << 30) < i:
        body = ins[labels[m.group(1)]:i + 1]
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0]
                                  for x in body)
        print(f"K loop: {len(body)} instructions ({len(body) / weights:.2f} per weight): "
              + ", ".join(f"{k} {v}" for k, v in ops.most_common(14)))
