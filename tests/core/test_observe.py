"""The all-to-all observers of the core: fan-out to registered observers, and the timer (pure, ms)."""

from __future__ import annotations

from commsched.comm.observe import A2AEvents, A2ATimer


class _Log:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def a2a_begin(self, nbytes: int) -> object:
        self.log.append((self.name, "begin", nbytes))
        return (self.name, nbytes)

    def a2a_end(self, token: object) -> None:
        self.log.append((self.name, "end", token))

    def block_begin(self) -> None:
        self.log.append((self.name, "block_begin"))

    def block_end(self) -> None:
        self.log.append((self.name, "block_end"))


def test_events_reach_the_observers_registered_now():
    log: list = []
    ev = A2AEvents()
    ev.block_begin()
    ev.a2a_end(ev.a2a_begin(3))  # nobody registered: nothing happens
    a = _Log("a", log)
    with ev.register(a):
        tok = ev.a2a_begin(10)
        b = _Log("b", log)
        hb = ev.register(b)
        assert ev.observers == (a, b)
        ev.block_begin()
        ev.a2a_end(tok)  # ended on the observers that saw it begin: a only
        ev.a2a_blocked(0.5)  # _Log has no a2a_blocked: skipped
        hb.remove()
        ev.block_end()
    assert ev.observers == ()
    ev.block_end()
    assert log == [("a", "begin", 10), ("a", "block_begin"), ("b", "block_begin"), ("a", "end", ("a", 10)),
                   ("a", "block_end")]


def test_events_pass_blocked_time_to_a_timer():
    ev, t = A2AEvents(), A2ATimer()
    with ev.register(t):
        tok = ev.a2a_begin(100)
        ev.a2a_blocked(0.25)
        ev.a2a_end(tok)
    assert (t.calls, t.bytes_sent, t.blocked_s) == (1, 100, 0.25) and t.time_s >= 0.0


class _Event:
    """A CUDA-event stand-in: counts waits, knows its time in ms."""

    waits = 0

    def __init__(self, ms: float):
        self.ms = ms

    def synchronize(self) -> None:
        _Event.waits += 1

    def elapsed_time(self, other: "_Event") -> float:
        return other.ms - self.ms


class _EventClock:
    """A ``Clock`` on a fake CUDA device: each mark 30 ms after the last."""

    def __init__(self, device):
        self.t = 0.0

    def mark(self, stream=None):
        self.t += 30.0
        return _Event(self.t)

    def seconds(self, a, b):  # what the old A2AReport called: a sync per exchange
        b.synchronize()
        return a.elapsed_time(b) / 1e3


def test_an_observed_exchange_never_waits_for_its_events(monkeypatch):
    """Audit 2, item 5: A2AReport hands the blocked interval over as events; the observer
    resolves them when it reports (one wait each at settle), none at the exchange."""
    import commsched.comm.observe as obs

    monkeypatch.setattr(obs, "Clock", _EventClock)
    _Event.waits = 0
    ev, t = A2AEvents(), A2ATimer()
    with ev.register(t):
        for _ in range(3):
            obs.A2AReport(ev, 8, "cpu").finish(lambda: None)
    assert _Event.waits == 0 and t.calls == 3 and t.blocked_s == 0.0
    assert abs(t.settle().blocked_s - 0.09) < 1e-9 and _Event.waits == 3
    # an observer that only takes seconds still gets them (waiting, as before)
    got: list = []

    class Seconds(_Log):
        def a2a_blocked(self, s: float) -> None:
            got.append(s)

    obs.A2AReport(Seconds("s", []), 8, "cpu").finish(lambda: None)
    assert got == [0.03]


def test_host_intervals_are_added_at_once():
    t = A2ATimer()
    t.a2a_blocked_interval(1.0, 1.5)
    assert t.blocked_s == 0.5
