"""ModelOpt quantized checkpoints: config parsing, NVFP4/FP8 formats, modules, quantizer.

Importing this package never imports Triton: the W4A16 kernel (``blockspec.kernels.w4a16``)
loads it when it first launches.
"""
from blockspec.quant.config import QuantConfigError, QuantPlan, load_quant_plan
from blockspec.quant.linear import (FP8Linear, NVFP4Linear, QuantEmbedding, make_quant_embedding,
                                    make_quant_linear)
from blockspec.quant.quantize import dequantize_checkpoint, quantize_checkpoint

__all__ = [
    "FP8Linear", "NVFP4Linear", "QuantConfigError", "QuantEmbedding", "QuantPlan",
    "dequantize_checkpoint", "load_quant_plan", "make_quant_embedding", "make_quant_linear",
    "quantize_checkpoint",
]
