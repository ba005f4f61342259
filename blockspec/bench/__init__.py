"""Benchmarks (not timed tests): warm-up, median of repeats, CUDA events."""
