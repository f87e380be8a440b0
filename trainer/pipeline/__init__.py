"""The threaded multi-GPU pipeline: prefetcher -> target workers -> drafter workers.

One process, one thread per device role. Every module here is usable on CPU (tests) and CUDA.
"""
