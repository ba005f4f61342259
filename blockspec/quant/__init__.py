"""ModelOpt quantized checkpoints: config parsing (``config``), the NVFP4 and FP8 formats
(``nvfp4``, ``fp8``, ``w4a16_layout``), the quantized modules (``linear``) and the offline
quantizer (``quantize``, ``recipes``).

The package itself imports nothing, so ``kernels/`` can use the format modules (``nvfp4``,
``w4a16_layout``) while ``linear`` uses the kernels, without a circle through this file.
Importing any of it never imports Triton: the W4A16 kernel (``blockspec.kernels.w4a16``)
loads it when it first launches.
"""
