"""The cluster: which host each rank is on and the links between ranks (topology), the
alpha-beta link cost model, and the bandwidth emulator that shapes links in network namespaces.
"""
