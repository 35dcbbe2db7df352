"""Distributed GNN layers: commsched's fast-path layers, PyG layers through the halo exchange,
and the layer registry (``--model``).
"""
