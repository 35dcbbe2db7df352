"""Micro-benchmarks and checks of the core: all-to-all throughput, the codec, the bit-width
solver, the emulated links, the hierarchical reduction, lina-overlap's CPU cost.
"""
