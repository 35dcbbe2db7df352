"""``lina-overlap`` on real parameters: per-module optimizer steps and forward pre-hooks
equal one optimizer stepping after the whole reduction (in one process here; on 2 and 4
gloo ranks through the cases below, which tests/moe/test_train.py runs in its spawns)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from commsched.priority.executor import LOCAL, GradScheduler
from commsched.priority.overlap import FORWARD, OverlapOptimizer, OverlapScheduler
from commsched.priority.policy import ScheduleConfig


class _Net(nn.Module):
    """A small dense model with a branch used on odd steps only and one used on rank 0 only."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.l1 = nn.Linear(8, 8)
        self.side = nn.Linear(8, 8)
        self.only0 = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 4)

    def forward(self, x, step: int, rank: int):
        h = torch.tanh(self.l1(self.emb(x).mean(1)))
        if step % 2:
            h = h + self.side(h)
        if rank == 0:
            h = h + self.only0(h)
        return self.out(self.norm(h))


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
}


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 16, (6, 5), generator=g), torch.randint(0, 4, (6,), generator=g)


def _train_net(schedule: str, opt: str, *, steps: int = 4, clip: float | None = None, local: bool = False,
               rank: int = 0, launch: str | None = None) -> tuple[dict, list[float]]:
    """``steps`` steps of _Net under ``schedule``; (final state, losses). ``local``: every
    parameter scale-only (one process); else reduced over the default group."""
    torch.manual_seed(0)
    net = _Net()
    entries = [(p, LOCAL if local else None) for p in reversed(list(net.parameters()))]
    cfg = ScheduleConfig(policy=schedule, microop_bytes=64, bucket_bytes=256, credit_bytes=128, launch=launch)
    losses = []
    if not cfg.overlapped:
        optim = OPTIMIZERS[opt](list(net.parameters()))
        with GradScheduler(entries, cfg) as sched:
            for step in range(steps):
                x, y = _batch(step, rank)
                sched.begin_step()
                loss = nn.functional.cross_entropy(net(x, step, rank), y)
                loss.backward()
                sched.finish()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_([p for p in net.parameters() if p.grad is not None], clip)
                optim.step()
                optim.zero_grad(set_to_none=True)
                losses.append(loss.item())
        return {k: v.clone() for k, v in net.state_dict().items()}, losses
    stepper = OverlapOptimizer(net, OPTIMIZERS[opt], clip_grad_norm=clip)
    with OverlapScheduler(entries, cfg) as sched, stepper.bind(sched):
        for step in range(steps):
            x, y = _batch(step, rank)
            loss = nn.functional.cross_entropy(net(x, step, rank), y)
            stepper.begin_backward()
            loss.backward()
            stepper.end_backward()
            losses.append(loss.item())
            if step == 1:
                # a checkpoint right after a step: synchronize() makes it hold the updated parameters
                stepper.synchronize()
                assert all(not sched.active for _ in [0]) and not stepper._pending
    stepper.close()
    return {k: v.clone() for k, v in net.state_dict().items()}, losses


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_one_process_overlap_equals_one_optimizer_after_the_reduction(opt):
    """Per-module steps at the forward pre-hooks give the same bits as one optimizer over
    every parameter, with branches unused in some steps (their grad stays None: no step)."""
    ref, ref_loss = _train_net("lina", opt, local=True)
    got, got_loss = _train_net("lina-overlap", opt, local=True)
    assert _same(ref, got) and ref_loss == got_loss
    first, _ = _train_net("lina", opt, steps=1, local=True)
    assert not _same(first, got)  # the steps did move the weights


def test_clipping_turns_the_overlap_off_once_and_stays_exact():
    with pytest.warns(RuntimeWarning, match="clipping by global norm") as rec:
        got, got_loss = _train_net("lina-overlap", "adam", local=True, clip=0.05)
    assert len([w for w in rec if "clipping" in str(w.message)]) == 1
    ref, ref_loss = _train_net("lina", "adam", local=True, clip=0.05)
    assert _same(ref, got) and ref_loss == got_loss


def test_overlap_records_the_next_forward_pass_and_keeps_the_optimizer_state():
    torch.manual_seed(0)
    net = _Net()
    entries = [(p, LOCAL) for p in net.parameters()]
    stepper = OverlapOptimizer(net, OPTIMIZERS["adam"])
    with OverlapScheduler(entries, ScheduleConfig(policy="lina-overlap")) as sched, stepper.bind(sched):
        for step in range(2):
            x, y = _batch(step, 0)
            loss = nn.functional.cross_entropy(net(x, step, 0), y)
            st = stepper.begin_backward()
            assert (st is None) == (step == 0)
            loss.backward()
            stepper.end_backward()
        assert any(r.kind == FORWARD for r in stepper.last_records)  # step 0's records reach into step 1's forward
        assert stepper.synchronize()["allreduce_count"] == 0
    sd = stepper.state_dict()
    assert len(sd["optimizers"]) == len(stepper.optimizers) == 6  # one per module holding parameters
    other = OverlapOptimizer(_Net(), OPTIMIZERS["adam"])
    other.load_state_dict(sd)
    with pytest.raises(ValueError, match="one optimizer state per module"):
        other.load_state_dict({"optimizers": sd["optimizers"][:2]})


def test_overlap_errors_speak():
    net = _Net()
    entries = [(p, LOCAL) for p in net.parameters()]
    with pytest.raises(ValueError, match="'lina-overlap' schedule"):
        OverlapScheduler(entries, ScheduleConfig(policy="lina"))
    with pytest.raises(ValueError, match="OverlapScheduler and OverlapOptimizer"):
        GradScheduler(entries, ScheduleConfig(policy="lina-overlap"))  # its finish() would never see the agreement
    stepper = OverlapOptimizer(net, OPTIMIZERS["sgd"])
    with pytest.raises(RuntimeError, match="not bound"):
        stepper.end_backward()
    with GradScheduler(entries, ScheduleConfig(policy="lina")) as plain, pytest.raises(TypeError, match="OverlapScheduler"):
        stepper.bind(plain)
    with OverlapScheduler(entries[:2], ScheduleConfig(policy="lina-overlap")) as part, \
            pytest.raises(ValueError, match="does not hold"):
        stepper.bind(part)
    with pytest.raises(ValueError, match="clip_grad_norm"):
        OverlapOptimizer(net, OPTIMIZERS["sgd"], clip_grad_norm=0.0)
    with pytest.raises(TypeError, match="make_optimizer"):
        OverlapOptimizer(net, None)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no clipping: no warning
        OverlapOptimizer(net, OPTIMIZERS["sgd"]).close()


# --------------------------------------------------------------------------- cases for the spawns of test_moe_train
def overlap_dense_exact(rank: int, world: int) -> None:
    """On gloo ranks, a dense model with a branch unused on even steps and one used on
    rank 0 only: lina-overlap equals lina bit for bit (the same micro-ops: the same sums),
    under both launch rules,
    and fifo bit for bit on 2 ranks (a sum of two is order-free); on 4 ranks fifo's fused
    buckets sum in another order, so its weights agree to 1e-5 (SGD: no amplification)."""
    for opt in ("adam", "sgd"):
        got, got_loss = _train_net("lina-overlap", opt, rank=rank)
        lina, lina_loss = _train_net("lina", opt, rank=rank)
        assert _same(got, lina) and got_loss == lina_loss, opt
        prog, prog_loss = _train_net("lina-overlap", opt, rank=rank, launch="program")  # CUDA's launch rule
        assert _same(prog, lina) and prog_loss == lina_loss, opt
        fifo, fifo_loss = _train_net("fifo", opt, rank=rank)
        if world == 2:
            assert _same(got, fifo) and got_loss == fifo_loss, opt
        elif opt == "sgd":
            for k in got:
                assert torch.allclose(got[k], fifo[k], rtol=0, atol=1e-5), (opt, k)
    # the rank-0-only branch got the sum of rank 0's gradient: it moved everywhere alike
    gathered = [torch.empty_like(got["only0.weight"]) for _ in range(world)]
    dist.all_gather(gathered, got["only0.weight"])
    assert all(torch.equal(gathered[0], g) for g in gathered)
