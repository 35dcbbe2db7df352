from commsched.priority.policy import SCHEDULES


def sched_of(name: str, **options):
    """The config of schedule ``name`` with those of ``options`` it has (a test's options for several schedules)."""
    cls = SCHEDULES[name]
    return cls(**{k: v for k, v in options.items() if k in cls.__dataclass_fields__})
