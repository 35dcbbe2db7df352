"""Link cost model: the pure fit recovers known parameters; the probe runs on real ranks."""

import math

import pytest
import torch

from commsched import LinkCost, fit_link_cost, probe_link_costs
from tests.mp import run_ranks


@pytest.mark.parametrize("gamma,theta", [(50e-6, 1 / 125e6), (0.0, 1 / 1e9), (2e-3, 1 / 12.5e6)])
def test_fit_recovers_known_parameters(gamma, theta):
    g = torch.Generator().manual_seed(0)
    sizes = [2 ** k for k in range(8, 24) for _ in range(3)]
    noise = 1 + 0.02 * torch.randn(len(sizes), generator=g, dtype=torch.float64)
    times = [(gamma + theta * s) * float(n) for s, n in zip(sizes, noise)]
    fit = fit_link_cost(sizes, times)
    assert fit.theta == pytest.approx(theta, rel=0.05)
    assert fit.gamma == pytest.approx(gamma, abs=0.05 * gamma + 1e-6)
    assert fit.time_s(1e6) == pytest.approx(gamma + theta * 1e6, rel=0.05)


def test_fit_keeps_terms_nonnegative():
    # times shrink with size (noise): no bandwidth term is measurable -> all latency
    fit = fit_link_cost([1, 2, 3], [3e-3, 2e-3, 1e-3])
    assert fit.theta == 0.0 and fit.gamma == pytest.approx(2e-3)
    assert math.isinf(fit.bandwidth_Bps)
    # a line through negative intercept is refit through the origin
    fit = fit_link_cost([100, 200], [1e-6, 3e-6])
    assert fit.gamma == 0.0 and fit.theta > 0


@pytest.mark.parametrize("sizes,times,msg", [
    ([1], [1.0], "two or more"), ([1, 1], [1.0, 2.0], "two or more"),
    ([1, 2], [1.0], "sizes but"), ([1, 2], [1.0, float("nan")], "non-finite"),
    ([1, 2], [1.0, -2.0], "negative"),
])
def test_fit_rejects_bad_input(sizes, times, msg):
    with pytest.raises(ValueError, match=msg):
        fit_link_cost(sizes, times)


def _probe(rank, world):
    costs = probe_link_costs(sizes=(1 << 10, 1 << 16, 1 << 20), repeats=2)
    assert sorted(costs) == [p for p in range(world) if p != rank]
    for c in costs.values():
        assert isinstance(c, LinkCost) and c.gamma >= 0 and c.theta >= 0
        assert math.isfinite(c.gamma) and math.isfinite(c.theta)
    return {p: (c.gamma, c.theta) for p, c in costs.items()}


@pytest.mark.slow
def test_probe_fits_one_model_per_peer():
    res = run_ranks(3, _probe, timeout_s=120)
    # loopback moves a MiB well within a second: theta is far below 1 s/MiB
    for per_peer in res:
        for _gamma, theta in per_peer.values():
            assert theta * (1 << 20) < 1.0
