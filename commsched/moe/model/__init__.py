"""The MoE model: router, expert FFNs, token dispatch, the MoE layer, the byte-level language
model, its text data and checkpoints.
"""
