"""Router unit tests, and the expert-parallel MoE layer against the local reference
(forward and gradients) on 2 and 4 gloo ranks, plain and pipelined."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from commsched.comm.observe import A2ATimer
from commsched.moe.model.dispatch import ExpertGroup, sort_assignments
from commsched.moe.model.layer import DispatchConfig, MoELayer
from commsched.moe.model.router import RouterConfig, capacity_keep, load_balancing_loss, route_top_k
from tests.mp import assert_case, run_cases


# --------------------------------------------------------------------------- router (pure)
def test_top1_picks_argmax_and_gate_is_probability():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    r = route_top_k(logits, RouterConfig(3, k=1))
    assert r.expert_TK.tolist() == [[1], [0]]
    p = torch.softmax(logits, -1)
    assert torch.allclose(r.gate_TK[:, 0], p[[0, 1], [1, 0]])
    assert r.keep_TK.all() and r.num_dropped == 0


def test_top2_gates_renormalised_and_ordered():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    r = route_top_k(logits, RouterConfig(4, k=2))
    assert r.expert_TK.tolist() == [[1, 2]]
    p = torch.softmax(logits, -1)[0]
    assert torch.allclose(r.gate_TK[0], torch.stack([p[1], p[2]]) / (p[1] + p[2]))
    assert torch.allclose(r.gate_TK.sum(), torch.tensor(1.0))


def test_capacity_seats_first_choices_first_then_token_order():
    # 4 tokens, 2 experts, k=2: every token's first choice is expert 0, second expert 1
    e = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 1]])
    keep = capacity_keep(e, 2, capacity=2)
    # expert 0 first choices: tokens 0, 1, 3 -> seats for tokens 0, 1; token 3 dropped.
    # expert 1 first choices: token 2 (seat 0); second choices in token order: token 0 gets seat 1.
    assert keep.tolist() == [[True, True], [True, False], [True, False], [False, False]]
    assert capacity_keep(e, 2, None).all()


def test_capacity_from_factor_and_dropped_gate_is_zero():
    cfg = RouterConfig(4, k=1, capacity_factor=1.0, min_capacity=1)
    assert cfg.capacity(10) == 3 and RouterConfig(4, k=2, capacity_factor=1.5).capacity(10) == 8
    assert RouterConfig(4).capacity(10) is None
    logits = torch.zeros(6, 4)
    logits[:, 2] = 5.0  # everyone wants expert 2; capacity ceil(6/4)=2
    r = route_top_k(logits, cfg)
    assert r.keep_TK[:, 0].tolist() == [True, True, False, False, False, False]
    assert (r.gate_TK[2:] == 0).all() and (r.gate_TK[:2] > 0).all()
    assert r.num_dropped == 4 and r.expert_load(4).tolist() == [0, 0, 2, 0]


def test_load_balancing_loss_values_and_gradient():
    E = 4
    uniform = torch.full((8, E), 1.0 / E)
    e = torch.arange(8).remainder(E).unsqueeze(1)
    assert torch.allclose(load_balancing_loss(uniform, e), torch.tensor(1.0))
    skew = torch.zeros(8, E)
    skew[:, 0] = 1.0
    assert torch.allclose(load_balancing_loss(skew, torch.zeros(8, 1, dtype=torch.long)), torch.tensor(float(E)))
    logits = torch.randn(16, E, requires_grad=True)
    r = route_top_k(logits, RouterConfig(E, k=2))
    r.aux_loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_router_config_errors_speak():
    with pytest.raises(ValueError, match="k must be 1 or 2"):
        RouterConfig(4, k=3)
    with pytest.raises(ValueError, match="capacity_factor"):
        RouterConfig(4, capacity_factor=0.0)
    with pytest.raises(ValueError, match="router logits"):
        route_top_k(torch.zeros(3, 5), RouterConfig(4))
    with pytest.raises(ValueError, match="cannot be split evenly"):
        ExpertGroup(6, 4, 0)


def test_sort_assignments_orders_by_chunk_then_expert():
    logits = torch.tensor([[0.0, 9.0], [9.0, 0.0], [0.0, 9.0], [9.0, 0.0]])
    r = route_top_k(logits, RouterConfig(2, k=1))
    a = sort_assignments(r, 2, chunks=2)
    assert a.token_A.tolist() == [1, 0, 3, 2] and a.expert_A.tolist() == [0, 1, 0, 1]
    assert a.counts_CE.tolist() == [[1, 1], [1, 1]]


def test_a_routing_of_ones_own_top_k_is_two_tensors():
    from commsched.moe.model.router import Routing

    expert_TK = torch.tensor([[2, 0], [1, 2], [0, 3]])
    gate_TK = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.9, 0.1]])
    r = Routing(expert_TK, gate_TK)  # every choice kept, no auxiliary loss
    assert r.keep_TK.all() and r.aux_loss is None and r.expert_load(4).tolist() == [2, 1, 2, 1]
    asg = sort_assignments(r, 4)
    assert asg.expert_A.tolist() == [0, 0, 1, 2, 2, 3] and asg.token_A.tolist() == [0, 2, 1, 0, 1, 2]
    with pytest.raises(ValueError, match="one shape"):
        Routing(expert_TK, gate_TK[:, :1])
    with pytest.raises(ValueError, match="int64 expert ids"):
        Routing(expert_TK.float(), gate_TK)


def test_local_layer_matches_dense_loop():
    torch.manual_seed(0)
    layer = MoELayer(6, 10, RouterConfig(3, k=2))
    x = torch.randn(2, 5, 6)
    y, aux = layer(x)
    r = layer.last_routing
    ex = layer.experts
    ref = torch.zeros(10, 6)
    for t in range(10):
        for k in range(2):
            e = int(r.expert_TK[t, k])
            h = torch.nn.functional.gelu(x.reshape(10, 6)[t] @ ex.w1[e] + ex.b1[e])
            ref[t] += r.gate_TK[t, k] * (h @ ex.w2[e] + ex.b2[e])
    assert torch.allclose(y.reshape(10, 6), ref, atol=1e-5)
    assert aux.dim() == 0


# --------------------------------------------------------------------------- EP == local (multi-process)
D, H = 8, 12
SETTINGS = [  # (experts per rank, k, capacity_factor, chunks, pipeline)
    (1, 1, None, 1, False), (2, 2, None, 1, False), (1, 2, 1.0, 1, False),
    (1, 1, None, 3, False), (2, 2, None, 3, True), (1, 1, 1.0, 2, True), (2, 1, None, 1, True),
]


def _tokens(rank: int, world: int, seed: int) -> int:
    return 0 if (seed == 3 and rank == world - 1) else 5 + 3 * rank + seed  # one rank with no tokens


def _ep_equals_local(rank: int, world: int) -> None:
    for seed, (per_rank, k, cf, chunks, pipe) in enumerate(SETTINGS):
        E = per_rank * world
        rc = RouterConfig(E, k=k, capacity_factor=cf, min_capacity=1)
        torch.manual_seed(100 + seed)
        ref = MoELayer(D, H, rc)
        torch.manual_seed(100 + seed)
        eg = ExpertGroup(E, world, rank, None)
        timer = A2ATimer()
        ep = MoELayer(D, H, rc, expert_group=eg, dispatch=DispatchConfig(chunks=chunks, pipeline=pipe), observer=timer)
        assert torch.equal(ref.router.weight, ep.router.weight)
        assert torch.equal(ref.experts.w1[eg.first:eg.first + eg.num_local], ep.experts.w1)
        g = torch.Generator().manual_seed(1000 * seed + rank)
        T = _tokens(rank, world, seed)
        x = torch.randn(T, D, generator=g)
        gy = torch.randn(T, D, generator=g)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, auxa = ref(xa)
        yb, auxb = ep(xb)
        what = dict(seed=seed, per_rank=per_rank, k=k, cf=cf, chunks=chunks, pipe=pipe)
        assert torch.allclose(ya, yb, rtol=1e-5, atol=1e-6), what
        if T:
            assert torch.equal(auxa, auxb), what
        ((ya * gy).sum() + auxa).backward()
        ((yb * gy).sum() + auxb).backward()
        assert torch.allclose(xa.grad, xb.grad, rtol=1e-5, atol=1e-6), what
        assert torch.allclose(ref.router.weight.grad, ep.router.weight.grad, rtol=1e-5, atol=1e-6), what
        for name in ("w1", "b1", "w2", "b2"):
            full = getattr(ref.experts, name).grad.clone()
            dist.all_reduce(full)  # the local reference sees only this rank's tokens
            mine = full[eg.first:eg.first + eg.num_local]
            got = getattr(ep.experts, name).grad
            assert torch.allclose(mine, got, rtol=1e-4, atol=1e-5), (name, what)
        # forward: counts + C dispatch + C combine; backward: C + C more
        assert timer.calls == 1 + 4 * chunks, (timer.calls, what)
        assert timer.time_s > 0


def _merged_equals_pipelined(rank: int, world: int) -> None:
    """``merge``: the pipelined path's chunks in one exchange each way give the same bits
    (outputs and every gradient), plain and with the 8-bit wire, in 2 + 2 exchanges."""
    for seed, (per_rank, k, chunks, bits) in enumerate([(1, 1, 3, 32), (2, 2, 2, 32), (1, 2, 3, 8), (2, 1, 4, 8)]):
        E = per_rank * world
        rc = RouterConfig(E, k=k, min_capacity=1)
        eg = ExpertGroup(E, world, rank, None)
        layers, timers = [], []
        for merge in (False, True):
            torch.manual_seed(200 + seed)
            timers.append(A2ATimer())
            layers.append(MoELayer(D, H, rc, expert_group=eg, observer=timers[-1], wire_seed=seed,
                                   dispatch=DispatchConfig(chunks=chunks, pipeline=True, a2a_bits=bits, merge=merge)))
        g = torch.Generator().manual_seed(300 * seed + rank)
        T = _tokens(rank, world, seed)
        x, gy = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
        got = []
        for layer in layers:
            xi = x.clone().requires_grad_(True)
            y, aux = layer(xi)
            ((y * gy).sum() + aux).backward()
            got.append([y.detach(), xi.grad, layer.router.weight.grad,
                        *(getattr(layer.experts, n).grad for n in ("w1", "b1", "w2", "b2"))])
            layer.close()
        what = dict(seed=seed, per_rank=per_rank, k=k, chunks=chunks, bits=bits)
        for a, b in zip(*got):
            assert torch.equal(a, b), what
        assert timers[0].calls == 1 + 4 * chunks and timers[1].calls == 1 + 4, (timers[0].calls, timers[1].calls)


def _ep_rejects_wrong_block(rank: int, world: int) -> None:
    rc = RouterConfig(world, k=1)
    layer = MoELayer(D, H, rc, expert_group=ExpertGroup(world, world, rank, None))
    from commsched.moe.model.dispatch import ep_moe
    wrong = ExpertGroup(world, world, (rank + 1) % world, None)
    with pytest.raises(ValueError, match="holds experts"):
        ep_moe(torch.zeros(2, D), layer.router(torch.zeros(2, D)), layer.experts, wrong)


CASES = [("ep_equals_local", _ep_equals_local), ("merged_equals_pipelined", _merged_equals_pipelined),
         ("ep_rejects_wrong_block", _ep_rejects_wrong_block)]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request):
    return run_cases(request.param, CASES, timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c, _ in CASES])
def test_moe_layer_mp(results, case):
    assert_case(results, case)


def test_capacity_matches_formula():
    cfg = RouterConfig(8, k=2, capacity_factor=1.25, min_capacity=4)
    assert cfg.capacity(100) == max(4, math.ceil(1.25 * 100 * 2 / 8))


# --------------------------------------------------------------------------- devices and dtypes
def _recording_exchange(monkeypatch) -> list:
    """Log what every exchange sends (forward and backward, one rank: the real exchange is
    a local copy), at the one place every pattern and direction starts an exchange."""
    import commsched.comm.all2all as a2a

    sent: list = []
    start = a2a._start

    def logged(x, plan, *args, **kw):
        sent.append((x.dtype, x.numel() * x.element_size(), x.device))
        return start(x, plan, *args, **kw)
    monkeypatch.setattr(a2a, "_start", logged)
    return sent


@pytest.mark.parametrize("pipeline", [False, True])
def test_bfloat16_autocast_halves_the_exchanged_bytes(monkeypatch, pipeline):
    """Under autocast to bfloat16 the token rows travel (both directions, forward and
    backward) in bfloat16: exactly half the bytes of float32, the counts still int64."""
    sent = _recording_exchange(monkeypatch)
    rc = RouterConfig(4, k=2)
    rows_bytes = {}
    for dt in ("float32", "bfloat16"):
        sent.clear()
        torch.manual_seed(0)
        layer = MoELayer(D, H, rc, expert_group=ExpertGroup(4, 1, 0, None), dispatch=DispatchConfig(chunks=2, pipeline=pipeline))
        x = torch.randn(3, 7, D, requires_grad=True)
        if dt == "float32":
            y, aux = layer(x)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y, aux = layer(x)
            assert y.dtype == torch.bfloat16
        (y.float().sum() + aux).backward()
        layer.close()
        assert torch.isfinite(x.grad).all() and x.grad.dtype == torch.float32
        rows = [(d, n) for d, n, _ in sent if d.is_floating_point]
        assert {d for d, _ in rows} == {getattr(torch, dt)} and len(rows) == 4 * 2
        assert all(d == torch.int64 for d, _, _ in sent if not d.is_floating_point)
        rows_bytes[dt] = sum(n for _, n in rows)
    assert rows_bytes["bfloat16"] * 2 == rows_bytes["float32"] > 0


def test_dispatch_indices_live_on_the_routing_device(monkeypatch):
    """device='cpu' through the same device-generic code: every index the dispatcher builds
    and every tensor it exchanges is on the input's device."""
    from commsched.moe.model.dispatch import build_chunk_plans

    sent = _recording_exchange(monkeypatch)
    dev = torch.device("cpu")
    torch.manual_seed(1)
    layer = MoELayer(D, H, RouterConfig(4, k=2), expert_group=ExpertGroup(4, 1, 0, None),
                     dispatch=DispatchConfig(chunks=2, pipeline=True)).to(dev)
    x = torch.randn(9, D, device=dev)
    routing = layer.router(x)
    asg = sort_assignments(routing, 4, 2)
    assert asg.token_A.device == dev and asg.counts_CE.device == dev
    for cp in build_chunk_plans(asg, layer.expert_group):
        assert cp.perm_R.device == dev and cp.inv_R.device == dev
    layer(x)
    assert layer._lanes is not None and layer._lanes.device == dev
    layer.close()
    assert sent and all(d == dev for _, _, d in sent)


@pytest.mark.cuda
def test_moe_layer_on_cuda_equals_cpu():
    torch.manual_seed(2)
    rc = RouterConfig(4, k=2)
    cpu = MoELayer(D, H, rc)
    gpu = MoELayer(D, H, rc)
    gpu.load_state_dict(cpu.state_dict())
    gpu.to("cuda")
    x = torch.randn(5, 6, D)
    yc, _ = cpu(x)
    yg, _ = gpu(x.cuda())
    assert yg.device.type == "cuda"
    assert torch.allclose(yc, yg.cpu(), rtol=1e-4, atol=1e-5)
