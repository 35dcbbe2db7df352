"""The halo exchanges of the training modes (``--mode``): plain, AdaQP, adaptive, 1-bit, stale
(PipeGCN), sampled (BNS-GCN), and the mode registry.
"""
