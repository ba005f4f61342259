"""Execution layer: batch metadata in static device buffers, the model runner, CUDA graphs and
the sync-free sampler."""
