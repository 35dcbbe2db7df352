"""The gradient scheduler on real process groups (:class:`~commsched.priority.runtime.executor.GradScheduler`):
its bucket layout, completion tracking, timeline records, and the lina-overlap variant.
"""
