"""Lanes on CPU: background progress, order, results and errors."""

import threading
import time

import pytest
import torch

from commsched import Lanes


def test_comm_lane_runs_while_caller_computes():
    release = threading.Event()
    started = threading.Event()

    def comm_work():
        started.set()
        assert release.wait(10), "caller never released the lane"
        return "sent"

    with Lanes("cpu") as lanes:
        ev = lanes.submit("comm", comm_work)
        assert started.wait(10)
        # the caller's thread is free: compute happens while the comm lane is blocked
        y = torch.ones(4).sum().item()
        assert not ev.done()
        release.set()
        assert ev.wait() == "sent" and y == 4.0
        assert ev.done()


def test_lane_keeps_submission_order_and_compute_is_inline():
    order = []
    with Lanes("cpu") as lanes:
        evs = [lanes.submit("comm", lambda i=i: (time.sleep(0.001 * (3 - i)), order.append(i))[1])
               for i in range(3)]
        for e in evs:
            e.wait()
        assert order == [0, 1, 2]
        assert lanes.submit("compute", lambda: threading.current_thread()).wait() is threading.current_thread()
        marker = lanes.record("comm")
        marker.wait()
        assert marker.done()


def test_lane_errors_reach_the_waiter_and_bad_names_are_refused():
    with Lanes("cpu") as lanes:
        ev = lanes.submit("comm", lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            ev.wait()
        assert lanes.submit("comm", lambda: 5).wait() == 5  # the lane survives an error
        with pytest.raises(ValueError, match="unknown lane"):
            lanes.submit("gpu-magic", lambda: None)
    with pytest.raises(ValueError, match="compute"):
        Lanes("cpu", names=("comm",))


def test_compute_lane_errors_also_reach_the_waiter_not_the_submitter():
    with Lanes("cpu") as lanes:
        ev = lanes.submit("compute", lambda: 1 / 0)  # inline, but the error waits for wait()
        assert ev.done()
        with pytest.raises(ZeroDivisionError):
            ev.wait()


def test_tensors_in_finds_nested_tensors():
    from commsched.comm.lanes import tensors_in

    a, b, c = torch.ones(1), torch.zeros(2), torch.ones(3)
    found = tensors_in(((a, [b, 7]), {"k": c, "s": "x"}))
    assert [t.shape for t in found] == [a.shape, b.shape, c.shape]
    assert tensors_in(None) == [] and tensors_in(a) == [a]


@pytest.mark.cuda
def test_cuda_lane_orders_work_and_keeps_memory_alive():
    dev = torch.device("cuda")
    with Lanes(dev) as lanes:
        x = torch.randn(1 << 20, device=dev)
        ev = lanes.submit("comm", lambda t: t * 2, x)
        del x  # the caller drops its reference: the lane's stream still owns the memory
        y = ev.wait()  # the current stream waits for the lane; y is recorded on it
        torch.cuda.synchronize()
        assert torch.isfinite(y).all()
        bad = lanes.submit("comm", lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            bad.wait()
