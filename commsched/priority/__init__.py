"""Micro-op partitioning, the all-to-all-first priority policy, its executor and a
discrete-event simulator of the policy (Lina)."""
