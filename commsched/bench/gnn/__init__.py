"""GNN experiments: modes side by side (``commsched bench gnn``), time to accuracy, the accuracy
grid, the rate sweep, Kipf & Welling's reference run, and the demo's GNN part.
"""
