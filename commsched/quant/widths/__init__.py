"""Adaptive bit-width assignment: the problem and its checker, the CP-SAT models, the greedy
baseline, the joint assignment over techniques, and the solve entry point.
"""
