"""Lina as a DDP communication hook, on real gloo ranks and a real DistributedDataParallel.

- LinaDDP on an expert-parallel MoE model equals the single-process model (all experts
  local) over 1, 2 and 4 micro-batches accumulated with ``no_sync()``, experts kept per
  rank, allreduce never launched while an all-to-all of the rank is in flight; on 4 ranks
  with expert-data-parallel groups too (that case runs in tests/moe/test_train.py's
  4-rank spawn);
- a plain DDP around expert-parallel MoE layers raises instead of silently replacing
  rank 1's experts and averaging their gradients;
- on a dense model the hook, and a bare GradScheduler with its own ``no_sync()``, give
  plain DDP's gradients over 1, 2 and 4 micro-batches, float32 and bfloat16;
- a rank that registered its parameters in another order, or other ones, is one clear
  ValueError on every rank; unused parameters keep ``grad`` None like DDP's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from commsched.comm.observe import A2AEvents
from commsched.dist import new_group
from commsched.moe.model.dispatch import ExpertGroup
from commsched.moe.model.lm import ModelConfig, MoETransformerLM
from commsched.priority import (
    FifoConfig,
    GradScheduler,
    LinaConfig,
    LinaDDP,
    LinaState,
    ScheduleConfig,
    SerialConfig,
    ignore_grouped_params,
    lina_hook,
    set_grad_group,
)
from commsched.priority.policy import FlatConfig
from tests.mp import assert_case, run_cases

MCFG = ModelConfig(d_model=16, n_heads=2, n_layers=2, seq_len=8, d_ff=24, expert_hidden=20, num_experts=4, k=2)
LINA = LinaConfig(microop_bytes=512)


def _tokens(rank: int, m: int, B: int = 2):
    g = torch.Generator().manual_seed(100 * rank + m)
    return torch.randint(0, 256, (B, MCFG.seq_len), generator=g), torch.randint(0, 256, (B, MCFG.seq_len), generator=g)


def _ep_model(rank: int, world: int, events=None):
    torch.manual_seed(7)
    return MoETransformerLM(MCFG, expert_group=ExpertGroup(MCFG.num_experts, world, rank, None), observer=events)


def _reference_grads(world: int, micro: int) -> dict[str, torch.Tensor]:
    """Single process, every expert local: the gradient of (1 / world) * sum over ranks and
    micro-batches of each micro-batch's loss -- what data parallelism with accumulation computes."""
    torch.manual_seed(7)
    ref = MoETransformerLM(MCFG)
    for r in range(world):
        for m in range(micro):
            ref.loss(*_tokens(r, m))[0].backward()
    return {n: p.grad / world for n, p in ref.named_parameters()}


def _loss(net, x, y):
    """The model's loss through ``net``'s forward (a DDP decides there whether to synchronise)."""
    logits, aux = net(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) + MCFG.aux_weight * aux


def _accumulate(ddp, rank: int, micro: int, tokens=None) -> None:
    """``micro`` micro-batches, all but the last inside ``ddp.no_sync()``."""
    tokens = tokens or _tokens
    for m in range(micro):
        x, y = tokens(rank, m)
        with ddp.no_sync() if m < micro - 1 else contextlib.nullcontext():
            _loss(ddp, x, y).backward()


def _lina_ddp_matches_the_single_process_model(rank: int, world: int) -> None:
    """Under the completion launch rule (gloo's default) over 1, 2, 4 and again 1 micro-batches,
    the last after DDP rebuilt its buckets; under the program rule (CUDA's default) over 2."""
    want = {}
    for cfg, micros in ((LINA, (1, 2, 4, 1)), (LinaConfig(microop_bytes=512, launch="program"), (2,))):
        _lina_ddp_case(rank, world, cfg, micros, want)


def _fifo_ddp_matches_the_single_process_model(rank: int, world: int) -> None:
    """fifo, the baseline, in the same wrapper: two experts per rank, top-2, its buckets
    (smaller than DDP's, so that they span DDP's buckets and parameters) launched as soon as
    ready, the same gradients as the single-process model over 1 and 2 micro-batches."""
    fifo = FifoConfig(bucket_bytes=4096)
    _lina_ddp_case(rank, world, fifo, (1, 2, 1), {}, a2a_first=False)
    events = A2AEvents()
    model = _ep_model(rank, world, events)
    ddp = LinaDDP(model, schedule=fifo, events=events, bucket_cap_mb=0.01)
    lina = LinaDDP(_ep_model(rank, world), schedule=LINA, bucket_cap_mb=0.01)
    try:
        assert 0 < ddp.lina.scheduler.num_ops < lina.lina.scheduler.num_ops  # fused buckets, not micro-ops
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref = _ep_model(rank, world)  # trains identically to plain averaging by hand
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            _loss(ddp, *_tokens(rank, step)).backward()
            _loss(ref, *_tokens(rank, step)).backward()
            for n, p in ref.named_parameters():
                if "experts" not in n:
                    dist.all_reduce(p.grad)
                p.grad /= world  # the experts: this rank's share of the global mean
            opt.step()
            ref_opt.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), n
    finally:
        for d, m in ((ddp, model), (lina, lina.module)):
            d.close()
            m.close()


def _lina_ddp_case(rank: int, world: int, cfg: ScheduleConfig, micros, want: dict, a2a_first: bool = True) -> None:
    events = A2AEvents()
    model = _ep_model(rank, world, events)
    ddp = LinaDDP(model, schedule=cfg, events=events, bucket_cap_mb=0.01)
    try:
        assert ddp.lina.scheduler.launch_rule == cfg.launch_rule("cpu")
        L = MCFG.num_experts // world
        experts = model.moe_layers()[0].experts
        torch.manual_seed(7)
        ref0 = MoETransformerLM(MCFG)
        # DDP left the experts alone: this rank still holds its own block, not rank 0's
        assert torch.equal(experts.w1, ref0.moe_layers()[0].experts.w1[rank * L:(rank + 1) * L])
        for micro in micros:
            if micro not in want:
                want[micro] = _reference_grads(world, micro)
            model.zero_grad(set_to_none=True)
            _accumulate(ddp, rank, micro)
            for n, p in model.named_parameters():
                w = want[micro][n]
                if "experts" in n:
                    w = w[rank * L:(rank + 1) * L]
                err = (p.grad - w).abs().max().item()
                assert err <= 1e-7 + 1e-6 * w.abs().max().item(), (micro, n, err)  # seen: 1.5e-8
            st = ddp.lina.last_stats
            assert st["allreduce_count"] == ddp.lina.scheduler.num_ops > 0 and st["a2a_count"] > 0
            recs = ddp.lina.scheduler.records
            a2a = [r for r in recs if r.kind == "a2a"]
            for r in (r for r in recs if r.kind == "allreduce" and a2a_first):  # all-to-all first
                assert not any(a.ready_s < r.start_s < a.end_s for a in a2a), (r, a2a)
    finally:
        ddp.close()
        model.close()


def _plain_ddp_around_experts_raises(rank: int, world: int) -> None:
    """The issue's silent wrong answer: a plain DDP replaced rank 1's experts with rank 0's at
    construction; the first forward pass now says so instead of training on."""
    model = _ep_model(rank, world)
    own = model.moe_layers()[0].experts.w1.detach().clone()
    ddp = DDP(model)
    overwritten = model.moe_layers()[0].experts.w1.detach()
    assert torch.equal(overwritten, own) == (rank == 0)  # what DDP did, and why it must be refused
    x, _ = _tokens(rank, 0)
    with pytest.raises(ValueError, match="replaced every rank's experts with rank 0's.*LinaDDP"):
        ddp(x)
    with pytest.raises(ValueError, match="expert .grouped. parameters.*ignore_grouped_params"):
        LinaState(ddp)
    # experts ignored, but nobody scales and reduces their gradients: also refused
    model = _ep_model(rank, world)
    names = ignore_grouped_params(model)
    assert names and all("experts" in n for n in names)
    ddp = DDP(model)
    assert torch.equal(model.moe_layers()[0].experts.w1.detach(), own)
    with pytest.raises(ValueError, match="no commsched LinaState"):
        ddp(x)
    # the hook registered by hand on that DDP: works like LinaDDP
    events = A2AEvents()
    for layer in model.moe_layers():
        layer.observer = events
    state = LinaState(ddp, LINA, events=events)
    ddp.register_comm_hook(state, lina_hook)
    with pytest.raises(ValueError, match="'flat' cannot run in a DDP communication hook.*'fifo'"):
        LinaState(DDP(nn.Linear(2, 2)), FlatConfig())
    want = _reference_grads(world, 1)
    _loss(ddp, *_tokens(rank, 0)).backward()
    g = model.blocks[0].attn.qkv.weight.grad
    assert torch.allclose(g, want["blocks.0.attn.qkv.weight"], rtol=1e-5, atol=1e-6)
    state.close()
    model.close()
    # experts laid out for another world (expert_dp_group forgotten when the EP group is smaller)
    model = _ep_model(rank, world)
    set_grad_group(model.moe_layers()[0].experts.parameters(), None, 2 * world)
    with pytest.raises(ValueError, match=f"laid out for {2 * world} data-parallel ranks.*expert_dp_group"):
        LinaDDP(model)


class Dense(nn.Module):
    """Two layers and two parameters that the ranks use differently: ``some`` only on rank 0,
    ``never`` on none."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 40)
        self.b = nn.Linear(40, 6)
        self.some = nn.Parameter(torch.ones(6))
        self.never = nn.Parameter(torch.ones(3))

    def forward(self, x):
        y = self.b(torch.tanh(self.a(x)))
        return y * self.some if dist.get_rank() == 0 else y


def _dense_tokens(rank: int, m: int, dtype):
    g = torch.Generator().manual_seed(10 * rank + m)
    return torch.randn(5, 12, generator=g).to(dtype), torch.randn(5, 6, generator=g).to(dtype)


def _dense_accumulation_equals_plain_ddp(rank: int, world: int) -> None:
    """Plain DDP, LinaDDP (lina and serial) and a bare GradScheduler with its own no_sync(): the same gradients
    after 1, 2 and 4 micro-batches, float32 and bfloat16 parameters (world 2: a sum of two
    values is order-free and the 1/2 scale exact, so they agree bit for bit); unused
    parameters as DDP leaves them (None when no rank used one). In the hook's model three
    parameters are marked as reduced over a group of their own (as experts over their
    expert-data-parallel group): the state, not DDP, reduces those."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        nets = [Dense().to(dtype) for _ in range(4)]
        for n in nets[1:]:
            n.load_state_dict(nets[0].state_dict())
        plain = DDP(nets[0], find_unused_parameters=True)
        set_grad_group([nets[1].b.bias, nets[1].some, nets[1].never], new_group([0, 1]), world)
        lina = LinaDDP(nets[1], schedule=LinaConfig(microop_bytes=64), find_unused_parameters=True,
                       bucket_cap_mb=0.001)
        serial = LinaDDP(nets[3], schedule=SerialConfig(microop_bytes=64), find_unused_parameters=True,
                         gradient_as_bucket_view=True)  # the gradients are the bucket's views
        bare = nets[2]
        named = list(bare.named_parameters())
        sched = GradScheduler([(p, None) for _, p in named], LinaConfig(microop_bytes=64),
                              names=[n for n, _ in named])
        try:
            for micro in (1, 2, 4):
                for net in nets:
                    net.zero_grad(set_to_none=True)
                for ddp in (plain, lina, serial):
                    for m in range(micro):
                        x, y = _dense_tokens(rank, m, dtype)
                        with ddp.no_sync() if m < micro - 1 else contextlib.nullcontext():
                            F.mse_loss(ddp(x), y).backward()
                sched.begin_step()
                for m in range(micro):
                    x, y = _dense_tokens(rank, m, dtype)
                    with sched.no_sync() if m < micro - 1 else contextlib.nullcontext():
                        F.mse_loss(bare(x), y).backward()
                sched.finish()
                for (n, p), q, r, t in zip(nets[0].named_parameters(), *(net.parameters() for net in nets[1:])):
                    if n == "never":
                        assert p.grad is None and q.grad is None and r.grad is None and t.grad is None, (dtype, micro)
                        continue
                    assert p.grad.dtype == dtype
                    assert torch.equal(p.grad, q.grad), (dtype, micro, n, "hook")
                    assert torch.equal(p.grad, r.grad), (dtype, micro, n, "GradScheduler")
                    assert torch.equal(p.grad, t.grad), (dtype, micro, n, "hook, serial")
            assert "b.bias" in lina.parameters_to_ignore and "a.bias" not in lina.parameters_to_ignore
            # the natural wrong pattern: two backwards in one step without no_sync
            sched.begin_step()
            F.mse_loss(bare(_dense_tokens(rank, 0, dtype)[0]), _dense_tokens(rank, 0, dtype)[1]).backward()
            with pytest.raises(RuntimeError, match="second gradient.*no_sync"):
                F.mse_loss(bare(_dense_tokens(rank, 1, dtype)[0]), _dense_tokens(rank, 1, dtype)[1]).backward()
            sched.finish()
        finally:
            sched.close()
            lina.close()
            serial.close()


def _registration_mismatch_is_one_clear_error(rank: int, world: int) -> None:
    """Two same-sized parameters swapped on rank 1, then one missing: the same ValueError on
    every rank naming rank 1, the index and both names -- not a gloo abort or a silent swap."""
    a, b, c = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2, 3))
    order = [("a", a), ("b", b), ("c", c)] if rank == 0 else [("b", b), ("a", a), ("c", c)]
    with pytest.raises(ValueError, match=r"rank 1 registered parameter 0 as 'b' \[4\] float32 .*rank 0 as 'a'"):
        GradScheduler([(p, None) for _, p in order], LINA, names=[n for n, _ in order])
    ps = [a, b, c] if rank == 0 else [a, b]
    with pytest.raises(ValueError, match=r"rank 1 registered 2 parameters, rank 0 3"):
        GradScheduler([(p, None) for p in ps], LINA)
    with GradScheduler([(p, None) for p in (a, b, c)], LINA, timeout_s=5.0) as s:  # agreeing ranks: fine
        assert s.timeout_s == 5.0


def lina_ddp_with_expert_dp_groups(rank: int, world: int) -> None:
    """4 ranks, expert-parallel groups {0, 1} and {2, 3}, expert-data-parallel groups {0, 2}
    and {1, 3}: DDP averages the dense parameters over all four, the state sums each expert's
    gradient over the two ranks holding it (scaled by 1/4); equal to the single-process model
    over 2 accumulated micro-batches and 1. Runs in tests/moe/test_train.py's 4-rank spawn."""
    ep = 2
    eps = [new_group([0, 1]), new_group([2, 3])]
    edps = [new_group([0, 2]), new_group([1, 3])]
    events = A2AEvents()
    torch.manual_seed(7)
    model = MoETransformerLM(MCFG, expert_group=ExpertGroup(MCFG.num_experts, ep, rank % ep, eps[rank // ep]),
                             observer=events, expert_dp_group=edps[rank % ep])
    ddp = LinaDDP(model, schedule=LINA, events=events, bucket_cap_mb=0.01)
    L = MCFG.num_experts // ep
    try:
        for micro in (2, 1):
            want = _reference_grads(world, micro)
            model.zero_grad(set_to_none=True)
            _accumulate(ddp, rank, micro)
            for n, p in model.named_parameters():
                w = want[n]
                if "experts" in n:
                    w = w[(rank % ep) * L:(rank % ep + 1) * L]
                err = (p.grad - w).abs().max().item()
                assert err <= 1e-7 + 1e-6 * w.abs().max().item(), (micro, n, err)
        # two synchronising backward passes in one optimizer step, no no_sync, no zero_grad
        # between: exact as DDP is (the expert sums were rescaled and re-reduced before: ~40% off)
        want = _reference_grads(world, 2)
        model.zero_grad(set_to_none=True)
        for m in range(2):
            _loss(ddp, *_tokens(rank, m)).backward()
        for n, p in model.named_parameters():
            w = want[n]
            if "experts" in n:
                w = w[(rank % ep) * L:(rank % ep + 1) * L]
            err = (p.grad - w).abs().max().item()
            assert err <= 1e-7 + 1e-6 * w.abs().max().item(), ("two syncs", n, err)
        # local accumulation on top of a reduced sum cannot be split: one clear error
        with ddp.no_sync():
            _loss(ddp, *_tokens(rank, 2)).backward()
        with pytest.raises(RuntimeError, match="holds the last step's reduced sum with local gradients"):
            _loss(ddp, *_tokens(rank, 3))
    finally:
        ddp.close()
        model.close()


CASES2 = [("lina_ddp_matches_the_single_process_model", _lina_ddp_matches_the_single_process_model),
          ("fifo_ddp_matches_the_single_process_model", _fifo_ddp_matches_the_single_process_model),
          ("plain_ddp_around_experts_raises", _plain_ddp_around_experts_raises),
          ("dense_accumulation_equals_plain_ddp", _dense_accumulation_equals_plain_ddp),
          ("registration_mismatch_is_one_clear_error", _registration_mismatch_is_one_clear_error)]


@pytest.fixture(scope="module")
def results2():
    return run_cases(2, CASES2, timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, _ in CASES2])
def test_two_ranks(results2, name):
    assert_case(results2, name)


def test_the_stash_check_reads_the_device_once_per_step_not_per_expert_parameter(monkeypatch):
    """audit 3, item 11: zero_grad(set_to_none=False) moves every expert gradient's version
    each step; the check that none holds local additions reads the device once for all of
    them, and still names the parameter when one does."""
    import weakref

    from commsched.priority.ddp import LinaState

    params = [nn.Parameter(torch.zeros(5)) for _ in range(6)]
    for p in params:
        p.grad = torch.randn(5)

    def state_after_a_step():
        st = LinaState.__new__(LinaState)  # only the stash's state: no DDP, no process group
        st._grouped = [(f"experts.{i}", p, None) for i, p in enumerate(params)]
        st._reduced = {id(p): (weakref.ref(p.grad), p.grad._version) for p in params}
        st._stash = []
        return st

    reads = []
    real_bool = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or real_bool(t))
    # zeroed in place (the optimizer's zero_grad(set_to_none=False)): one read, nothing stashed
    st = state_after_a_step()
    for p in params:
        p.grad.zero_()
    st._stash_reduced()
    assert len(reads) == 1 and st._stash == [] and st._reduced == {}
    assert all(p.grad is not None for p in params)
    # untouched: set aside without reading anything
    reads.clear()
    st = state_after_a_step()
    st._stash_reduced()
    assert reads == [] and len(st._stash) == 6 and all(p.grad is None for p in params)
    for p, g in st._stash:
        p.grad = g
    # local gradients added to one reduced sum: the same error as before, naming it
    st = state_after_a_step()
    for p in params:
        p.grad.zero_()
    params[4].grad.add_(1.0)
    with pytest.raises(RuntimeError, match=r"'experts.4' holds the last step's reduced sum with local gradients"):
        st._stash_reduced()
