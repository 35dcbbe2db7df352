"""The exchange machinery: the uneven all-to-all (plans, direct and ring patterns, autograd,
async handles), how its messages travel, its observers, and the execution lanes.
"""
