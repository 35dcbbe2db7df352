"""The all-to-all observers of the core: fan-out to registered observers, and the timer (pure, ms)."""

from __future__ import annotations

from commsched.observe import A2AEvents, A2ATimer


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
