"""MoE experiments: training schedules side by side (``commsched bench moe-train``), inference
placement (``commsched bench moe-infer``), the placement report, all-to-all loss parity, and
the demo's MoE part.
"""
