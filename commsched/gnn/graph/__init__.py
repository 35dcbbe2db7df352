"""Graphs: loading, named data sets, the synthetic generator, partitioning, the partition book,
and the graph flags of the command lines.
"""
