"""Quantized Linear and Embedding modules holding ModelOpt tensors as they are stored.

Buffers carry the checkpoint names (``weight``, ``weight_scale``, ``weight_scale_2``,
``input_scale``, ``bias``) so loading stays a name-for-name ``copy_``.  Packed weights stay
packed in memory: on CPU each forward dequantizes exactly (fp32) and runs ``F.linear`` in the
input's dtype; on CUDA NVFP4 runs the Triton W4A16 kernel, which decodes in registers.

``input_scale`` of W4A4 (``nvfp4``) checkpoints is loaded but never applied: blockspec runs
them with bf16 activations (see docs/quantization.md). FP8 layers apply theirs on the GPU only:
there (bf16/fp16 activations, sm89+) they run W8A8 on the FP8 tensor cores, as sglang and vLLM
run ModelOpt FP8 checkpoints: the activations are quantized to E4M3 with the checkpoint's static
``input_scale`` (a per-tensor scale from the activations' absolute maximum when a checkpoint
has none) in one Triton launch (``kernels/fp8_quant.py``) and ``torch._scaled_mm`` multiplies;
no weight is dequantized per call. ``fp8_w8a8_reference`` is the same math in plain torch.
Elsewhere (CPU, fp32) FP8 layers run as W8A16 against the exactly dequantized weight, the
reference the parity tests use.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.kernels.fp8_quant import quantize_fp8_act
from blockspec.kernels.fp8_quant import quantize_fp8_act_reference as _quantize_act
from blockspec.kernels.triton_loader import triton_available, use_triton
from blockspec.kernels.w4a16 import w4a16_linear
from blockspec.quant.config import FORMATS, FP8, NVFP4, W4A16_NVFP4
from blockspec.quant.fp8 import dequantize_fp8, fp8_scale
from blockspec.quant.nvfp4 import GROUP_SIZE, dequantize_nvfp4, dequantize_nvfp4_rows
from blockspec.kernels.w4a16_layout import from_kernel_layout, to_kernel_layout, to_kernel_layout_

# Buffers whose dtype is part of the format: ``module.to(dtype)`` / ``.half()`` must only move
# them, never cast them.
_FIXED_DTYPE = ("weight", "weight_scale", "weight_scale_2", "input_scale")


class _QuantBase(nn.Module):
    """Shared buffer handling: fixed storage dtypes and shape messages for the loader."""

    fmt: str
    prefix: str

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        # A model-wide ``.to(torch.bfloat16)`` would otherwise turn fp8 scales and the fp32
        # global scale into bf16; keep their dtype and honour only the device move.
        originals = {name: buf for name, buf in self._buffers.items()
                     if name in _FIXED_DTYPE and buf is not None}
        super()._apply(fn, recurse)
        for name, orig in originals.items():
            buf = self._buffers[name]
            if buf is not None and buf.dtype != orig.dtype:
                self._buffers[name] = orig.to(buf.device)
        return self

    def _register_input_scale_and_bias(self, out_features: int, has_input_scale: bool,
                                       bias: bool, dtype: torch.dtype | None) -> None:
        """``input_scale`` only when the checkpoint has one (loaded, never applied)."""
        if has_input_scale:
            self.register_buffer("input_scale", torch.zeros((), dtype=torch.float32))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype or torch.float32)
                             if bias else None)

    def logical_shape_message(self, local_name: str, found_shape: tuple[int, ...] | torch.Size
                              ) -> str | None:
        """Shape error naming the logical [out, in] shape expected and found, or None if fine."""
        found = tuple(found_shape)
        buf = self._buffers.get(local_name)
        if buf is None or tuple(buf.shape) == found:
            return None
        out_f, in_f = self._logical_shape()
        name = f"{self.prefix}.{local_name}" if self.prefix else local_name
        expected = tuple(buf.shape)
        if local_name == "weight" and self.fmt in (NVFP4, W4A16_NVFP4):
            got = _logical_from(found, 2)
            return (f"{name}: packed NVFP4 weight (2 values per byte) expected stored shape "
                    f"{list(expected)} = logical [out, in] {[out_f, in_f]}; found stored "
                    f"{list(found)} = logical {got}")
        if local_name == "weight_scale" and self.fmt in (NVFP4, W4A16_NVFP4):
            got = _logical_from(found, GROUP_SIZE)
            return (f"{name}: NVFP4 block scales (one per {GROUP_SIZE} inputs) expected "
                    f"{list(expected)} for logical [out, in] {[out_f, in_f]}; found "
                    f"{list(found)} = logical {got}")
        return (f"{name}: expected shape {list(expected)} for logical [out, in] "
                f"{[out_f, in_f]} ({self.fmt}); found {list(found)}")

    def _logical_shape(self) -> tuple[int, int]:
        raise NotImplementedError


def _logical_from(found: tuple[int, ...], factor: int) -> list[int] | str:
    if len(found) != 2:
        return f"(not 2-D: {list(found)})"
    return [found[0], found[1] * factor]


def w4a16_runs(x: torch.Tensor) -> bool:
    """Whether the W4A16 kernel takes ``x`` (16-bit on CUDA, Triton importable); elsewhere an
    NVFP4 product runs on the exactly dequantized weight. triton_available, not use_triton:
    the kernel also runs with gradients enabled, where use_triton would fall back to
    dequantizing the whole weight."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and triton_available()


class NVFP4Linear(_QuantBase):
    """NVFP4 weight (``w4a16_nvfp4``, or ``nvfp4`` = W4A4 checkpoint run as W4A16)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None, prefix: str = "",
                 has_input_scale: bool = False) -> None:
        super().__init__()
        if in_features % GROUP_SIZE:
            raise ValueError(f"{prefix}: NVFP4 needs in_features % {GROUP_SIZE} == 0, "
                             f"got in_features={in_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.prefix = prefix
        self.fmt = NVFP4 if has_input_scale else W4A16_NVFP4
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2,
                                                   dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(
            out_features, in_features // GROUP_SIZE, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale_2", torch.zeros((), dtype=torch.float32))
        self._register_input_scale_and_bias(out_features, has_input_scale, bias, dtype)
        # ``weight`` holds the W4A16 kernel's layout (w4a16_layout.py) once the kernel has run
        # on it or the MoE stacked it; until then the checkpoint's bytes.
        self.kernel_layout = False

    def _logical_shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def checkpoint_weight(self) -> torch.Tensor:
        """The packed weight in the checkpoint's layout, whichever layout ``weight`` holds."""
        return from_kernel_layout(self.weight) if self.kernel_layout else self.weight

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exactly dequantized [out, in] (fp32 unless asked otherwise)."""
        return dequantize_nvfp4(self.checkpoint_weight(), self.weight_scale,
                                self.weight_scale_2, dtype=dtype)

    def kernel_weight(self) -> torch.Tensor:
        """``weight`` in the kernel's layout, converted in place on first use (so a model keeps
        one copy; warm-up runs it before any CUDA graph is captured)."""
        if not self.kernel_layout:
            to_kernel_layout_(self.weight)
            self.kernel_layout = True
        return self.weight

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.kernel_layout:   # a state dict always holds the checkpoint's bytes
            destination[prefix + "weight"] = self.checkpoint_weight()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "weight"
        if self.kernel_layout and key in state_dict:   # checkpoint bytes into a converted buffer
            state_dict = {**state_dict, key: to_kernel_layout(state_dict[key])}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if w4a16_runs(x):
            return w4a16_linear(x, self.kernel_weight(), self.weight_scale,
                                self.weight_scale_2, self.bias)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dense_weight(x.dtype), bias)

    def forward_relu2(self, x: torch.Tensor) -> torch.Tensor | None:
        """relu(forward(x))^2 with the square in the W4A16 kernel's epilogue (one launch for
        an expert's up projection), or None where that kernel does not run."""
        if self.bias is None and w4a16_runs(x):
            return w4a16_linear(x, self.kernel_weight(), self.weight_scale,
                                self.weight_scale_2, relu2=True)
        return None

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}, "
                f"bias={self.bias is not None}")


class FP8Linear(_QuantBase):
    """FP8 static per-tensor weight (``fp8``); activations stay in x's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None, prefix: str = "",
                 has_input_scale: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.prefix = prefix
        self.fmt = FP8
        self.register_buffer("weight", torch.zeros(out_features, in_features,
                                                   dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.zeros((), dtype=torch.float32))
        self._register_input_scale_and_bias(out_features, has_input_scale, bias, dtype)
        # (input_scale tensor, its version) -> static or not: set by prepare()
        self._scale_mode: tuple[torch.Tensor | None, int | None, bool] | None = None

    def _logical_shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if _scaled_mm_ok(x, self.in_features, self.out_features):
            return fp8_w8a8(x, self.weight, self.weight_scale, self.activation_scale(x), bias)
        return F.linear(x, self.dense_weight(x.dtype), bias)

    def fused_input_scale(self, x: torch.Tensor) -> torch.Tensor | None:
        """The static input scale when whoever produces ``x`` may hand it over already in
        E4M3 (``forward_quantized``): the fused path runs (Triton, ``_scaled_mm``) and the
        checkpoint's scale is static. None otherwise (then ``forward`` quantizes)."""
        if (use_triton(x) and _scaled_mm_ok(x, self.in_features, self.out_features)
                and self.static_scale()):
            return self.input_scale
        return None

    def forward_quantized(self, xq: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``forward`` of an input already quantized at ``fused_input_scale``."""
        bias = None if self.bias is None else self.bias.to(out_dtype)
        return _fp8_gemm(xq, self.weight, self.weight_scale, self.input_scale, bias, out_dtype)

    def prepare(self) -> bool:
        """Decide once whether the static ``input_scale`` applies (present and > 0, as in real
        checkpoints): one host read, made after loading (``prepare_fp8``) so no step needs it."""
        s = getattr(self, "input_scale", None)
        static = s is not None and bool(s.item() > 0)
        self._scale_mode = (s, _version(s), static)
        return static

    def static_scale(self) -> bool:
        """The decision of ``prepare``, made again (a host read) if ``input_scale`` has been
        replaced or written since, e.g. by a later checkpoint load: never a stale answer."""
        s = getattr(self, "input_scale", None)
        mode = self._scale_mode
        if mode is None or mode[0] is not s or mode[1] != _version(s):
            return self.prepare()
        return mode[2]

    def activation_scale(self, x: torch.Tensor) -> torch.Tensor:
        """The checkpoint's static input scale, or amax(|x|) / 448 when it has none or a
        non-positive one (device ops only: the choice is made by ``prepare``)."""
        if self.static_scale():
            return self.input_scale
        return _dynamic_scale(x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt=fp8"


def prepare_w4a16(model: nn.Module) -> None:
    """Put every NVFP4 Linear that the W4A16 kernel will run (on CUDA, Triton importable) in
    the kernel's layout now, after loading and before any CUDA graph is captured."""
    if not triton_available():
        return
    for m in model.modules():
        if isinstance(m, NVFP4Linear) and m.weight.is_cuda:
            m.kernel_weight()


def prepare_fp8(model: nn.Module) -> None:
    """Decide every FP8 layer's activation scale mode; call after loading the weights."""
    for m in model.modules():
        if isinstance(m, FP8Linear):
            m.prepare()


def _version(t: torch.Tensor | None) -> int | None:
    """In-place writes (``copy_`` by the loader, ``fill_``) bump a tensor's version; inference
    tensors keep none."""
    return None if t is None or t.is_inference() else t._version


def _dynamic_scale(x: torch.Tensor) -> torch.Tensor:
    return fp8_scale(x.abs().amax()).clamp_min(1e-12)


def _scaled_mm_ok(x: torch.Tensor, k: int, n: int) -> bool:
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and k % 16 == 0
            and n % 16 == 0 and torch.cuda.get_device_capability(x.device) >= (8, 9))


def fp8_w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             input_scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16) @ (weight [N, K] E4M3 x weight_scale)^T with x quantized to E4M3
    at ``input_scale`` (one Triton launch where ``use_triton`` allows, else the bit-identical
    torch reference), then one FP8 tensor-core GEMM (``torch._scaled_mm``), fp32 accumulation."""
    xq = quantize_fp8_act(x, input_scale) if use_triton(x) else _quantize_act(x, input_scale)
    return _fp8_gemm(xq, weight, weight_scale, input_scale, bias, x.dtype)


def _fp8_gemm(xq: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              input_scale: torch.Tensor, bias: torch.Tensor | None,
              out_dtype: torch.dtype) -> torch.Tensor:
    """E4M3 ``xq`` [..., K] (quantized at ``input_scale``) @ the E4M3 weight^T, one GEMM."""
    lead, k = xq.shape[:-1], xq.shape[-1]
    y = torch._scaled_mm(xq.reshape(-1, k), weight.t(), scale_a=input_scale.float().reshape(()),
                         scale_b=weight_scale.float().reshape(()), bias=bias, out_dtype=out_dtype)
    return y.reshape(*lead, weight.shape[0])


def fused_input_scale(linear: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``FP8Linear.fused_input_scale`` for any linear (None for the other formats)."""
    fn = getattr(linear, "fused_input_scale", None)
    return None if fn is None else fn(x)


def fp8_w8a8_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       input_scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: the same activation quantization, then fp32 matmul of the dequantized pair."""
    xq = _quantize_act(x, input_scale).float() * input_scale.float()
    y = xq @ (weight.float() * weight_scale.float()).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def make_quant_linear(fmt: str, in_features: int, out_features: int, bias: bool = False,
                      dtype: torch.dtype | None = None, prefix: str = "") -> nn.Module:
    """The module for one quantized Linear; ``fmt`` comes from ``QuantPlan.format_for``."""
    if fmt == W4A16_NVFP4:
        return NVFP4Linear(in_features, out_features, bias, dtype, prefix, has_input_scale=False)
    if fmt == NVFP4:
        return NVFP4Linear(in_features, out_features, bias, dtype, prefix, has_input_scale=True)
    if fmt == FP8:
        return FP8Linear(in_features, out_features, bias, dtype, prefix, has_input_scale=True)
    raise ValueError(f"{prefix}: unknown quantized format {fmt!r}; known: {', '.join(FORMATS)}")


class QuantEmbedding(_QuantBase):
    """Embedding table stored packed (NVFP4) or FP8; lookups dequantize only the rows used."""

    def __init__(self, fmt: str, num_embeddings: int, dim: int,
                 dtype: torch.dtype | None = None, prefix: str = "") -> None:
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"{prefix}: unknown quantized format {fmt!r}")
        self.fmt = fmt
        self.prefix = prefix
        self.num_embeddings = num_embeddings
        self.dim = dim
        self.out_dtype = dtype or torch.float32
        if fmt == FP8:
            self.register_buffer("weight", torch.zeros(num_embeddings, dim,
                                                       dtype=torch.float8_e4m3fn))
            self.register_buffer("weight_scale", torch.zeros((), dtype=torch.float32))
        else:
            if dim % GROUP_SIZE:
                raise ValueError(f"{prefix}: NVFP4 embedding dim must be a multiple of "
                                 f"{GROUP_SIZE}, got {dim}")
            self.register_buffer("weight", torch.zeros(num_embeddings, dim // 2,
                                                       dtype=torch.uint8))
            self.register_buffer("weight_scale", torch.zeros(
                num_embeddings, dim // GROUP_SIZE, dtype=torch.float8_e4m3fn))
            self.register_buffer("weight_scale_2", torch.zeros((), dtype=torch.float32))

    def _logical_shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.dim

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.fmt == FP8:
            return dequantize_fp8(self.weight, self.weight_scale, dtype=dtype)
        return dequantize_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.fmt == FP8:
            rows = dequantize_fp8(self.weight[flat], self.weight_scale, dtype=self.out_dtype)
        else:
            rows = dequantize_nvfp4_rows(self.weight, self.weight_scale, self.weight_scale_2,
                                         flat, dtype=self.out_dtype)
        return rows.reshape(*ids.shape, self.dim)


def make_quant_embedding(fmt: str, num_embeddings: int, dim: int,
                         dtype: torch.dtype | None = None, prefix: str = "") -> QuantEmbedding:
    """Embedding whose table is stored quantized (e.g. a draft's packed ``embed_tokens``)."""
    return QuantEmbedding(fmt, num_embeddings, dim, dtype, prefix)


def stack_nvfp4_experts(modules: list[NVFP4Linear],
                        extra: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = ()
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack loaded per-expert NVFP4 Linears into ``[E, N, K/2]``, ``[E, N, K/16]``, ``[E]``,
    the packed weights in the W4A16 kernel's layout.

    For ``grouped_w4a16``/``pair_w4a16``.  Each module's buffers are re-pointed to views of the
    stacked tensors (and marked as holding the kernel layout), so the packed experts stay in
    memory once.  Call after loading and after moving the model to its device (moving views one
    by one would copy them apart).  ``extra``: (packed in the checkpoint's layout, scales,
    global scale) of pseudo-experts appended after the modules' (the shared expert's slices,
    ``MoE.prepare_grouped``), copied in.
    """
    if not modules:
        raise ValueError("no expert modules to stack")
    parts = ([(m.checkpoint_weight(), m.weight_scale, m.weight_scale_2) for m in modules]
             + list(extra))
    shapes = {(w.shape, s.shape) for w, s, _ in parts}
    if len(shapes) != 1:
        raise ValueError(f"experts differ in shape: {sorted(shapes)}")
    weight = torch.stack([w for w, _, _ in parts])
    scale = torch.stack([s for _, s, _ in parts])
    scale2 = torch.stack([s2.reshape(()) for _, _, s2 in parts])
    to_kernel_layout_(weight)
    for e, m in enumerate(modules):
        m.weight = weight[e]
        m.kernel_layout = True
        m.weight_scale = scale[e]
        m.weight_scale_2 = scale2[e]
    return weight, scale, scale2


def stack_nvfp4_rows(modules: list[NVFP4Linear]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Sibling NVFP4 Linears of one input (q/k/v, gate/up) as one weight: ``[sum(out), K/2]``
    packed in the W4A16 kernel's layout, ``[sum(out), K/16]`` scales and one global scale per
    row (``w4a16_linear`` takes it per row, so the projections keep their own). Each module's
    buffers become views of its rows, as in ``stack_nvfp4_experts``. None when any module is
    not a bias-free NVFP4Linear or the input widths differ."""
    if not modules or not all(type(m) is NVFP4Linear and m.bias is None for m in modules):
        return None
    if len({m.in_features for m in modules}) != 1:
        return None
    weight = torch.cat([m.checkpoint_weight() for m in modules])
    scale = torch.cat([m.weight_scale for m in modules])
    scale2 = torch.cat([m.weight_scale_2.reshape(1).to(torch.float32).expand(m.out_features)
                        for m in modules])
    to_kernel_layout_(weight)
    row = 0
    for m in modules:
        n = m.out_features
        m.weight, m.weight_scale = weight[row:row + n], scale[row:row + n]
        m.kernel_layout = True
        row += n
    return weight, scale, scale2
