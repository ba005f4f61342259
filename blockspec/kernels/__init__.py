"""Triton kernels of the GPU fast paths. Each kernel file sits beside a launcher that also holds
(or names) the pure-torch reference it is tested against; ``triton_loader`` loads the jitted
kernels once per mode (compiled on a GPU, or the interpreter on CPU for tests)."""
