"""The hierarchical gradient reduction (commsched/priority/hier.py) against its flat twin:
the host layout (pure, here), and cases on 4 gloo ranks laid out as 2 hosts x 2 (the
layout given, no emulation), run in the 4-rank spawn of tests/moe/test_train.py
(``HIER_CASES4``): bitwise equal sums on exactly representable gradients, training equal
to flat within floating-point reordering, lina's gate on the phase across hosts, and the
flat fallback said once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from commsched.priority.hier import HostLayout, make_hier, shard_numel
from commsched.priority.policy import ScheduleConfig

GRID_2x2 = ("a", "a", "b", "b")


def test_host_layout_local_ranks_and_cross_groups():
    lay = HostLayout(("x", "y", "x", "y"))  # hosts need not hold consecutive ranks
    assert lay.hosts == ("x", "y") and lay.local_size == 2
    assert lay.intra_ranks(0) == [0, 2] and lay.intra_ranks(1) == [1, 3]
    assert lay.cross_ranks(0) == [0, 1] and lay.cross_ranks(1) == [2, 3]
    assert [lay.local_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert lay.flat_reason is None
    assert "one host" in HostLayout(("a",) * 4).flat_reason
    assert "one rank" in HostLayout(("a", "b", "c")).flat_reason
    assert [shard_numel(n, 2) for n in (1, 2, 5)] == [1, 1, 3]


def test_uneven_hosts_are_refused_with_the_counts():
    with pytest.raises(ValueError, match=r"same number of ranks on every host; this layout has a: 2, b: 1"):
        HostLayout(("a", "a", "b"))
    with pytest.raises(ValueError, match="hier_reduce must be True or False"):
        ScheduleConfig(hier_reduce="yes")
    with pytest.raises(ValueError, match="hier_min_bytes must be an integer >= 0"):
        ScheduleConfig(hier_min_bytes=-1)
    with pytest.raises(ValueError, match="hier_reduce does not combine with the 'lina-overlap' schedule"):
        ScheduleConfig(policy="lina-overlap", hier_reduce=True)


def test_cli_option_and_deepspeed_refusal(tmp_path):
    from commsched.moe.train import build_parser, config_from_args
    from commsched.moe.training import TrainConfig

    p = build_parser()
    sc = config_from_args(p.parse_args(["--hier-reduce", "--hier-min-bytes", "0", "--out", str(tmp_path)])).schedule
    assert sc.hier_reduce and sc.hier_min_bytes == 0
    assert not config_from_args(p.parse_args(["--out", str(tmp_path)])).schedule.hier_reduce
    with pytest.raises(ValueError, match="--hier-reduce is an option of --impl commsched"):
        TrainConfig(impl="deepspeed", schedule=ScheduleConfig(hier_reduce=True))


def test_bench_link_times_by_hand():
    """2 hosts x 2 ranks at 8 bit/s (1 byte/s): a NIC carries 2 ranks x 8 B x 2/4 of the
    all-to-all = 8 B; a ring allreduce of 12 B crosses it with 2 x 12 x 3/4 = 18 B, the
    hierarchical one with 2 x 12 x 1/2 = 12 B. One host: every byte passes the one limit."""
    from commsched.bench.moe_train import link_times

    assert link_times(8, 12, 4, 2, 8.0) == {"a2a": 8.0, "a2a_backward": 4.0, "allreduce_flat": 18.0,
                                           "allreduce_hier": 12.0}
    one = link_times(8, 12, 4, 1, 8.0)
    assert (one["a2a"], one["allreduce_flat"], one["allreduce_hier"]) == (24.0, 72.0, 72.0)
    four = link_times(8, 12, 4, 4, 8.0)  # one rank per host: the hierarchy is the ring
    assert four["allreduce_flat"] == four["allreduce_hier"] == 18.0 and four["a2a"] == 6.0


# --------------------------------------------------------------------------- 4 ranks
def _params(rank: int) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """Parameters of odd sizes (padding, several micro-ops) and integer gradients per rank."""
    g = torch.Generator().manual_seed(7)
    shapes = [(37,), (8, 9), (5,), (300,)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    grads = [torch.randint(-50, 50, s, generator=torch.Generator().manual_seed(rank * 10 + i)).float()
             for i, s in enumerate(shapes)]
    return ps, grads


def _reduce_once(cfg: ScheduleConfig, hier, a2a_during: bool = False) -> tuple[list[torch.Tensor], list[bool]]:
    from commsched.dist import new_group
    from commsched.priority.executor import GradScheduler

    rank = dist.get_rank()
    ps, grads = _params(rank)
    dp = new_group(list(range(dist.get_world_size())), threads=4)
    with GradScheduler([(p, dp) for p in ps], cfg, hier=hier) as s:
        s.begin_step()
        if a2a_during:  # an all-to-all of this rank in flight while the gradients arrive
            tok = s.a2a_begin(1 << 16)
        sum(((p * g).sum() for p, g in zip(ps, grads))).backward()
        if a2a_during:
            s.a2a_end(tok)
        s.finish()
        hierarchical = list(s._op_hier)  # which operations went through the hierarchy
    return [p.grad for p in ps], hierarchical


def _exact_sums_bitwise(rank: int, world: int) -> None:
    """Integer gradients: every partial sum is exact, so hierarchical == flat bit for bit,
    under lina (micro-ops of 64 B: several per tensor, shards padded, all hierarchical) and
    fifo (buckets of up to 256 B and one of 1200 B; those below hier_min_bytes stay flat,
    so one step mixes both kinds)."""
    hier = make_hier(GRID_2x2, threads=4)
    for policy, least in (("lina", 0), ("fifo", 256)):
        flat_cfg = ScheduleConfig(policy=policy, microop_bytes=64, bucket_bytes=256)
        hier_cfg = dataclasses.replace(flat_cfg, hier_reduce=True, hier_min_bytes=least)
        flat, none = _reduce_once(flat_cfg, None)
        hr, which = _reduce_once(hier_cfg, hier, a2a_during=True)
        assert not any(none) and (all(which) if least == 0 else any(which) and not all(which)), which
        want = [sum(_params(r)[1][i] for r in range(world)) / world for i in range(len(flat))]
        for a, b, w in zip(flat, hr, want):
            assert torch.equal(a, b), (policy, (a - b).abs().max())
            assert torch.equal(b, w)


def _training_matches_flat(rank: int, world: int) -> None:
    """Three training steps (lina, pipelined all-to-all, Adam at lr 1e-2): parameters equal
    flat within float32 reordering; the phase across hosts never starts while this rank's
    all-to-all is in flight. Tolerance: Adam turns a last-bit difference of a near-zero
    gradient into up to lr per step, so a few elements move (measured: 0.19% of them by more
    than 1e-6, at most 3.8e-4; flat fifo's own reordering against flat lina: 0.18%, 3.3e-4),
    the rest agree to 1e-6, and so do the losses (measured 2.4e-7)."""
    from commsched.moe.trainer import build_commsched, make_groups, train
    from commsched.observe import A2AEvents
    from commsched.priority.executor import GradScheduler
    from commsched.topology import Topology
    from tests.moe.test_train import _cfg

    topo = Topology.grid(2, 2)
    cfg = _cfg(world, "lina", chunks=2, pipeline=True, steps=3)
    # the test model's micro-ops are 1 KiB: every one hierarchical (hier_min_bytes 0)
    hcfg = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, hier_reduce=True, hier_min_bytes=0))
    mf, sf = train(cfg, None, progress=False)
    mh, sh = train(hcfg, None, progress=False, topology=topo)
    assert sf.keys() == sh.keys()
    d = torch.cat([(sf[k] - sh[k]).abs().flatten() for k in sf if sf[k].is_floating_point()])
    assert d.max() <= 1e-3 and (d > 1e-6).float().mean() <= 0.01, (d.max(), (d > 1e-6).float().mean())
    assert all(abs(a - b) <= 1e-6 for a, b in zip(mf.loss, mh.loss)), (mf.loss, mh.loss)
    # the gate: no phase across hosts starts inside one of this rank's all-to-alls
    groups = make_groups(world)
    events = A2AEvents()
    model, sched_params = build_commsched(hcfg, groups, events)
    hier = make_hier(topo.hosts_P)
    with GradScheduler(sched_params, hcfg.schedule, hier=hier) as sched, events.register(sched):
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
        sched.begin_step()
        model.loss(x, x)[0].backward()
        st = sched.finish()
        recs = sched.records
    model.close()
    a2a = [r for r in recs if r.kind == "a2a"]
    ar = [r for r in recs if r.kind == "allreduce"]
    assert a2a and ar and st["allreduce_count"] == len(ar) == sched.num_ops
    assert all(r.end_s >= r.start_s >= r.ready_s >= 0 for r in ar)
    for r in ar:
        assert not any(a.ready_s < r.start_s < a.end_s for a in a2a), (r, a2a)


def _flat_fallback_said_once(rank: int, world: int) -> None:
    said: list[str] = []
    assert make_hier(("h",) * world, say=said.append) is None
    assert make_hier(tuple(f"h{r}" for r in range(world)), say=said.append) is None
    assert len(said) == (2 if rank == 0 else 0)
    if rank == 0:
        assert "one host" in said[0] and "reducing flat" in said[0] and "one rank" in said[1]


# run in tests/moe/test_train.py's 4-rank spawn (one spawn for the suite)
HIER_CASES4 = [("hier_exact_sums_bitwise", _exact_sums_bitwise),
               ("hier_training_matches_flat", _training_matches_flat),
               ("hier_flat_fallback_said_once", _flat_fallback_said_once)]
