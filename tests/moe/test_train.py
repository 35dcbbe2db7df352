"""MoE training on gloo ranks: schedules never change the maths, the executor's gradients
equal a plain allreduce, lina's launch rule holds on real process groups, and the
DeepSpeed baseline trains from the same weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from commsched.comm.observe import A2AEvents
from commsched.moe.model.experts import is_expert_param
from commsched.moe.model.layer import DispatchConfig
from commsched.moe.model.lm import ModelConfig
from commsched.moe.train.trainer import TrainConfig, build_commsched, make_groups, train
from commsched.moe.train.training import DeepSpeedConfig
from commsched.priority.policy import SCHEDULES, FifoConfig, LinaConfig
from commsched.priority.runtime.executor import GradScheduler
from tests.mp import assert_case, run_cases, run_ranks
from tests.priority import sched_of
from tests.priority.test_ddp_hook import lina_ddp_with_expert_dp_groups
from tests.priority.test_hier import HIER_CASES4
from tests.priority.test_overlap import overlap_dense_exact

CORPUS = Path(__file__).resolve().parents[3] / "shared" / "data" / "text" / "tinyshakespeare.txt"
if not CORPUS.exists():  # a checkout outside the shared workspace: any text will do
    CORPUS = Path(__file__).resolve().parents[2] / "commsched" / "moe" / "train" / "cli.py"


def _cfg(world: int, schedule: str, *, chunks: int = 1, pipeline: bool = False, ep: int | None = None,
         k: int = 2, steps: int = 3, impl: str = "commsched", device: str = "cpu", dtype: str = "float32",
         launch: str | None = None) -> TrainConfig:
    model = ModelConfig(d_model=32, n_heads=2, n_layers=2, seq_len=16, d_ff=48, expert_hidden=40,
                        num_experts=2 * (ep or world), k=k, moe_every=2)
    return TrainConfig(model=model, impl=impl,
                       schedule=sched_of(schedule, microop_bytes=1024, bucket_bytes=4096, launch=launch),
                       dispatch=DispatchConfig(chunks=chunks, pipeline=pipeline),
                       steps=steps, batch_size=2, lr=1e-2, seed=3, ep_size=ep, warmup=min(1, steps - 1), probe_steps=1,
                       eval_batches=1, corpus=str(CORPUS), max_corpus_bytes=1 << 18, device=device, dtype=dtype,
                       fallback_exchange=False)  # these runs' bits must not follow a timed decision


def _run(cfg: TrainConfig, device=None) -> dict:
    metrics, state = train(cfg, None, progress=False, device=device)
    return {**metrics.to_dict(), "state": state}


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _schedules_identical(rank: int, world: int) -> None:
    for chunks, pipe in ((1, False), (2, True)):
        runs = {s: _run(_cfg(world, s, chunks=chunks, pipeline=pipe))
                for s in ("lina", "fifo", "serial", "lina-overlap")}
        init = _run(_cfg(world, "lina", chunks=chunks, pipeline=pipe, steps=1))["state"]
        assert not _same_state(init, runs["lina"]["state"])  # steps 2 and 3 moved the weights
        # with 2 ranks a sum is order-free, so even fifo's fused buckets give the same bits
        for s in ("fifo", "serial", "lina-overlap"):
            assert _same_state(runs["lina"]["state"], runs[s]["state"]), (s, chunks, pipe)
            assert runs["lina"]["loss"] == runs[s]["loss"]
        assert all(torch.isfinite(torch.tensor(runs["lina"]["loss"])))


def _schedules_identical_ep2(rank: int, world: int) -> None:
    """4 ranks, EP groups of 2: expert gradients are averaged over the expert-data-parallel
    group. lina and serial cut gradients alike, so they are bitwise equal. (fifo's fused
    buckets sum four values in another order: its gradients equal a plain allreduce up to
    rounding, see grads_match_manual_allreduce, but Adam amplifies last-bit differences of
    near-zero gradients, so its weights are not compared bitwise here.)"""
    runs = {s: _run(_cfg(world, s, ep=2, chunks=2, pipeline=True, steps=2)) for s in ("lina", "serial", "lina-overlap")}
    for s in ("serial", "lina-overlap"):  # lina-overlap: the same micro-ops, stepped per module
        assert _same_state(runs["lina"]["state"], runs[s]["state"]), s
        assert runs["lina"]["loss"] == runs[s]["loss"], s


def _grads_match_manual_allreduce(rank: int, world: int) -> None:
    ep = 2 if world == 4 else world
    for schedule in ("lina", "fifo", "serial") if world == 2 else ("lina", "fifo"):
        cfg = _cfg(world, schedule, ep=ep, chunks=2, pipeline=True)
        groups = make_groups(ep, allreduce_threads=4)  # gloo groups with 4 worker threads
        probe = torch.arange(5, dtype=torch.float32) * (rank + 1)
        ref_sum = probe.clone()
        dist.all_reduce(ref_sum)  # the default group
        dist.all_reduce(probe, group=groups.dp_group)
        assert torch.equal(probe, ref_sum)
        events = A2AEvents()
        model, sched_params = build_commsched(cfg, groups, events)
        ref, _ = build_commsched(cfg, groups)  # same seed: the same weights
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, 256, (2, 16), generator=g)
        y = torch.randint(0, 256, (2, 16), generator=g)
        ref.loss(x, y)[0].backward()
        with torch.no_grad():  # data-parallel mean of the ranks' losses
            for p in ref.parameters():
                grp = groups.edp_group if is_expert_param(p) else groups.dp_group
                if grp is not None:
                    dist.all_reduce(p.grad, group=grp)
                p.grad /= world
        with GradScheduler(sched_params, cfg.schedule) as sched, events.register(sched):
            sched.begin_step()
            model.loss(x, y)[0].backward()
            st = sched.finish()
            assert st["allreduce_count"] == sched.num_ops > 0
            assert 0.0 <= st["allreduce_in_backward_share"] <= 1.0
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), (schedule, n)


def _threaded_gloo_group(rank: int, world: int) -> None:
    """commsched.dist.new_group(threads=N) makes a working gloo group with N worker threads,
    also on the interface GLOO_SOCKET_IFNAME names (as torchrun's emulated hosts set it)."""
    from commsched.dist import new_group

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        g = new_group(list(range(world)), threads=3)
    finally:
        del os.environ["GLOO_SOCKET_IFNAME"]
    works = [dist.all_reduce(torch.full((4,), float(rank + i)), group=g, async_op=True) for i in range(6)]
    for w in works:
        w.wait()
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=g)
    assert torch.equal(t, torch.full((4,), float(sum(range(1, world + 1)))))
    with pytest.raises(ValueError, match="threads"):
        new_group(list(range(world)), threads=0)


def _lina_rule_on_real_groups(rank: int, world: int) -> None:
    """In lina's recorded timeline no allreduce starts while an all-to-all of this rank is
    in flight, and none starts inside an expert block of the backward pass."""
    cfg = _cfg(world, "lina", chunks=2, pipeline=True, steps=2)
    groups = make_groups(world)
    events = A2AEvents()
    model, sched_params = build_commsched(cfg, groups, events)
    with GradScheduler(sched_params, cfg.schedule) as sched, events.register(sched):
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, 256, (2, 16), generator=g)
        sched.begin_step()
        model.loss(x, x)[0].backward()
        sched.finish()
        recs = sched.records
    a2a = [r for r in recs if r.kind == "a2a"]
    ar = [r for r in recs if r.kind == "allreduce"]
    assert a2a and ar and all(r.end_s >= r.start_s >= 0 for r in recs)
    for r in ar:
        assert not any(a.ready_s < r.start_s < a.end_s for a in a2a), (r, a2a)


def _deepspeed_trains_from_the_same_weights(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    ds = _run(_cfg(world, "fifo", impl="deepspeed", k=1, steps=2))
    ours = _run(_cfg(world, "fifo", k=1, steps=2))
    assert ds["impl"] == "deepspeed" and len(ds["loss"]) == 2
    # same weights, same tokens, same gating: the first losses agree (the second too, closely)
    assert abs(ds["loss"][0] - ours["loss"][0]) < 1e-4, (ds["loss"], ours["loss"])
    assert abs(ds["loss"][1] - ours["loss"][1]) < 1e-2, (ds["loss"], ours["loss"])
    assert ds["a2a_time_s"] > 0 and ds["step_time_s"] > 0
    assert "all_to_all_single" in ds["deepspeed_comm_ops"]


def _program_launch_rule_same_sums(rank: int, world: int) -> None:
    """lina under the 'program' launch rule (CUDA's default) on gloo ranks: the same
    weights as serial, bit for bit."""
    a = _run(_cfg(world, "lina", chunks=2, pipeline=True, steps=2, launch="program"))
    b = _run(_cfg(world, "serial", chunks=2, pipeline=True, steps=2))
    assert _same_state(a["state"], b["state"]) and a["loss"] == b["loss"]
    assert a["config"]["schedule"]["launch"] == "program"


def _bfloat16_trains_and_halves_the_wire(rank: int, world: int) -> None:
    f32 = _run(_cfg(world, "lina", chunks=2, pipeline=True, steps=3))
    bf = _run(_cfg(world, "lina", chunks=2, pipeline=True, steps=3, dtype="bfloat16"))
    assert all(torch.isfinite(torch.tensor(bf["loss"]))) and bf["val_loss"] is not None
    assert abs(bf["loss"][0] - f32["loss"][0]) < 0.05, (bf["loss"], f32["loss"])
    assert bf["sizes"]["a2a_payload_bytes_per_step"] * 2 == f32["sizes"]["a2a_payload_bytes_per_step"]
    assert all(v.dtype == torch.float32 for v in bf["state"].values() if v.is_floating_point())


def _overlap_checkpoint_holds_the_update(rank: int, world: int) -> None:
    """lina-overlap leaves a step's reduction running into the next forward pass; a
    checkpoint written right after step 1 still holds step 1's updated parameters (fifo's
    after one step, bit for bit), and the run ends where fifo's does."""
    import dataclasses
    import shutil
    import tempfile

    from commsched.moe.train.state import checkpoint_path

    d = Path(tempfile.gettempdir()) / f"commsched-overlap-ckpt-{os.getppid()}"  # the same on every rank
    cfg = dataclasses.replace(_cfg(world, "lina-overlap", chunks=2, pipeline=True, steps=3), checkpoint_every=1)
    one = _run(_cfg(world, "fifo", chunks=2, pipeline=True, steps=1))["state"]
    three = _run(_cfg(world, "fifo", chunks=2, pipeline=True, steps=3))
    seen = {}

    def on_step(k: int) -> None:
        if k == 1:
            seen["model"] = torch.load(checkpoint_path(d, rank), weights_only=True)["model"]
    try:
        m, state = train(cfg, d, progress=False, on_step=on_step)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
    assert _same_state(seen["model"], one)
    assert _same_state(state, three["state"]) and m.loss == three["loss"]
    assert m.timeline_step == 1  # the step before the last: its reduction reaches into the next forward


CASES2 = [("schedules_identical", _schedules_identical),
          ("overlap_checkpoint_holds_the_update", _overlap_checkpoint_holds_the_update),
          ("overlap_dense_exact", overlap_dense_exact),  # tests/priority/test_overlap.py
          ("program_launch_rule_same_sums", _program_launch_rule_same_sums),
          ("bfloat16_trains_and_halves_the_wire", _bfloat16_trains_and_halves_the_wire),
          ("grads_match_manual_allreduce", _grads_match_manual_allreduce),
          ("lina_rule_on_real_groups", _lina_rule_on_real_groups),
          ("threaded_gloo_group", _threaded_gloo_group),
          ("deepspeed_trains_from_the_same_weights", _deepspeed_trains_from_the_same_weights)]
CASES4 = [("schedules_identical_ep2", _schedules_identical_ep2),
          ("grads_match_manual_allreduce", _grads_match_manual_allreduce),
          ("lina_ddp_with_expert_dp_groups", lina_ddp_with_expert_dp_groups),  # tests/priority/test_ddp_hook.py
          ("overlap_dense_exact", overlap_dense_exact),  # tests/priority/test_overlap.py
          *HIER_CASES4]  # tests/priority/test_hier.py: hierarchical reduction against flat


@pytest.fixture(scope="module")
def results2():
    return run_cases(2, CASES2, timeout_s=300)


@pytest.fixture(scope="module")
def results4():
    return run_cases(4, CASES4, timeout_s=300)


def _one_rank_cpu_explicit(rank: int, world: int) -> None:
    """device='cpu' given explicitly, through the device-generic code; and bfloat16."""
    a = _run(_cfg(world, "lina", steps=2), device="cpu")
    b = _run(_cfg(world, "lina", steps=2, device="auto"), device=torch.device("cpu"))
    assert a["loss"] == b["loss"] and _same_state(a["state"], b["state"])
    bf = _run(_cfg(world, "lina", steps=2, dtype="bfloat16"))
    assert all(torch.isfinite(torch.tensor(bf["loss"]))) and bf["config"]["dtype"] == "bfloat16"


def _one_rank_cuda_matches_cpu(rank: int, world: int) -> None:
    cpu = _run(_cfg(world, "lina", chunks=2, pipeline=True, steps=3), device="cpu")
    gpu = _run(_cfg(world, "lina", chunks=2, pipeline=True, steps=3, device="cuda"),
               device=torch.device("cuda", 0))
    assert all(v.device.type == "cpu" for v in gpu["state"].values())
    for a, b in zip(cpu["loss"], gpu["loss"]):
        assert abs(a - b) < 5e-3 * max(1.0, abs(a)), (cpu["loss"], gpu["loss"])
    bf = _run(_cfg(world, "lina", chunks=2, pipeline=True, steps=3, device="cuda", dtype="bfloat16"),
              device=torch.device("cuda", 0))
    assert all(torch.isfinite(torch.tensor(bf["loss"])))


class _Killed(Exception):
    """Stands for a run killed between two steps (every rank at once)."""


def _die_after(k: int):
    def on_step(step: int) -> None:
        if step == k:
            raise _Killed
    return on_step


def _checkpoint_resume_exact(tmp: str, rank: int, world: int) -> None:
    """A run killed after step 3 (last checkpoint: step 2) and resumed ends bitwise equal to
    an uninterrupted one: parameters, every step's loss; the resumed run runs only steps
    3..5; a finished run resumes to the same end; the checkpoints are per rank."""
    import dataclasses
    import json

    from commsched.moe.train.state import checkpoint_path

    cfg = dataclasses.replace(_cfg(world, "lina", chunks=2, pipeline=True, steps=5), checkpoint_every=2)
    full_m, full_state = train(dataclasses.replace(cfg, checkpoint_every=0), None, progress=False)
    d = Path(tmp) / "run"
    with pytest.raises(_Killed):
        train(cfg, d, progress=False, on_step=_die_after(3))
    st = torch.load(checkpoint_path(d, rank), weights_only=True)
    assert st["step"] == 2 and st["rank"] == rank and len(st["rows"]) == 2
    assert not list(d.glob("*.tmp")) and not list(d.glob("*.prev.pt"))  # all ranks renamed
    step2 = checkpoint_path(d, rank).read_bytes()
    m, state = train(cfg, d, progress=False, resume=True)
    assert _same_state(state, full_state)
    assert m.loss == full_m.loss and len(m.loss) == 5
    assert m.to_dict()["resumed_from_step"] == 2
    # the final state was saved (5 is not a multiple of 2): resuming the finished run trains nothing
    assert torch.load(checkpoint_path(d, rank), weights_only=True)["step"] == 5
    m2, state2 = train(cfg, d, progress=False, resume=True)
    assert _same_state(state2, full_state) and m2.loss == full_m.loss
    if rank == 0:
        assert json.loads((d / "metrics.json").read_text())["loss"] == full_m.loss
    # a rank killed between its peer's rename and its own: rank 0 holds step 5 and kept step
    # 2 as its previous file, rank 1 still holds step 2; the set resumes from step 2, exactly
    from commsched.moe.train.state import previous_path

    dist.barrier()
    if rank == 0:
        previous_path(checkpoint_path(d, 0)).write_bytes(step2)
    else:
        checkpoint_path(d, 1).write_bytes(step2)
    dist.barrier()
    m4, state4 = train(cfg, d, progress=False, resume=True)
    assert m4.to_dict()["resumed_from_step"] == 2
    assert _same_state(state4, full_state) and m4.loss == full_m.loss
    assert not list(d.glob("*.prev.pt"))
    # a longer run continues from the end of the shorter one, as if it had been one run
    longer = dataclasses.replace(cfg, steps=6)
    m3, state3 = train(longer, d, progress=False, resume=True)
    ref_m, ref_state = train(dataclasses.replace(longer, checkpoint_every=0), None, progress=False)
    assert _same_state(state3, ref_state) and m3.loss == ref_m.loss
    # a changed configuration is refused, naming the key, on every rank
    with pytest.raises(ValueError, match=r"lr: 0.01 -> 0.02"):
        train(dataclasses.replace(longer, lr=2e-2), d, progress=False, resume=True)
    # one rank's damaged file: every rank stops, naming that file
    dist.barrier()
    if rank == 1:
        checkpoint_path(d, 1).write_bytes(b"not a checkpoint")
    dist.barrier()
    with pytest.raises(ValueError, match=r"checkpoint-rank1\.pt"):
        train(longer, d, progress=False, resume=True)
    with pytest.raises(ValueError, match="no checkpoint"):
        train(cfg, Path(tmp) / "empty", progress=False, resume=True)


@pytest.mark.slow
def test_moe_checkpoint_resume_is_exact(tmp_path):
    import functools

    res = run_cases(2, [("checkpoint_resume_exact", functools.partial(_checkpoint_resume_exact, str(tmp_path)))],
                    timeout_s=180, env={"COMMSCHED_TIMEOUT_S": "30"})
    assert_case(res, "checkpoint_resume_exact")


def _fallback_resume_exact(tmp: str, rank: int, world: int) -> None:
    """``--fallback-exchange`` changes the arithmetic of the steps run as the fallback, so a
    resume is exact only if every step runs in the mode the interrupted run would have: the
    checkpoint carries the probe's progress. The decision is scripted (fallback faster) so
    that the uninterrupted reference decides alike; killed before the probe ends (checkpoint
    of step 4: probe steps 2-5), just before the decision (step 6) and after it (step 8),
    each resumed run ends bitwise equal to the uninterrupted one."""
    import dataclasses

    from commsched.moe.train.state import checkpoint_path
    from commsched.priority import fallback

    calls: list[list[int]] = []
    real = fallback.FallbackProbe.decide

    def scripted(self, times_RS):
        calls.append([len(t) for t in times_RS])  # what a resumed run gathered
        n = 2 * self.probes
        return real(self, [[1.0 if self.fallback_at(self.first + s) else 2.0 for s in range(n)]
                           for _ in times_RS] if all(len(t) == n for t in times_RS) else times_RS)

    fallback.FallbackProbe.decide = scripted
    try:
        cfg = dataclasses.replace(_cfg(world, "lina", chunks=2, pipeline=True, steps=10),
                                  checkpoint_every=2, fallback_exchange=True)
        assert cfg.schedule.fallback_probes == 2
        full_m, full_state = train(dataclasses.replace(cfg, checkpoint_every=0), None, progress=False)
        assert calls == [[4] * world]
        for kill, resumed_from, decides in ((5, 4, 1), (7, 6, 1), (9, 8, 0)):
            d = Path(tmp) / f"fx{kill}"
            with pytest.raises(_Killed):
                train(cfg, d, progress=False, on_step=_die_after(kill))
            probe = torch.load(checkpoint_path(d, rank), weights_only=True)["probe"]
            assert probe["step"] == resumed_from - 1
            assert len(probe["times"]) == min(resumed_from - 2, 4)
            assert (probe["decided"] is not None) is (resumed_from > 6)
            calls.clear()
            m, state = train(cfg, d, progress=False, resume=True)
            assert m.to_dict()["resumed_from_step"] == resumed_from
            assert len(calls) == decides and all(c == [4] * world for c in calls)  # taken from 4 times
            assert _same_state(state, full_state) and m.loss == full_m.loss, kill
    finally:
        fallback.FallbackProbe.decide = real


@pytest.mark.slow
def test_fallback_exchange_resume_is_exact(tmp_path):
    import functools

    res = run_cases(2, [("fallback_resume_exact", functools.partial(_fallback_resume_exact, str(tmp_path)))],
                    timeout_s=240, env={"COMMSCHED_TIMEOUT_S": "30"})
    assert_case(res, "fallback_resume_exact")


def _grad_bits_cases(tmp: str, rank: int, world: int) -> None:
    """--grad-bits 8: every schedule trains with its reductions compressed (the losses
    within 1% of the exact run's, every replicated parameter the same bytes on every rank,
    not the exact run's bytes), and a run killed and resumed ends bitwise equal to an
    uninterrupted one (the rounding keys continue from the checkpoint)."""
    import dataclasses

    from commsched.moe.train.state import checkpoint_path

    states = {}
    for sched in ("fifo", "lina", "lina-overlap", "serial"):
        base = _cfg(world, sched, chunks=2, pipeline=sched != "fifo", steps=4)
        exact = _run(base)
        got = _run(dataclasses.replace(base, grad_bits=8))
        states[sched] = got["state"]
        np_loss = torch.tensor(got["loss"]), torch.tensor(exact["loss"])
        assert got["loss"][0] == exact["loss"][0]  # the first step's loss comes before any reduction
        assert bool(((np_loss[0] - np_loss[1]).abs() / np_loss[1] < 0.01).all()), (sched, got["loss"], exact["loss"])
        dense = {k: v for k, v in got["state"].items() if ".experts." not in k}
        gathered = [None] * world
        dist.all_gather_object(gathered, dense)
        assert all(_same_state(gathered[0], g) for g in gathered), sched  # the replicas agree
        assert not _same_state(got["state"], exact["state"]), sched  # and it did compress
    # the rounding is keyed by the operation, not the launch order: the schedules of one
    # micro-op layout (lina, lina-overlap, serial) compute the same bits, whatever they hold
    assert _same_state(states["lina"], states["lina-overlap"]) and _same_state(states["lina"], states["serial"])
    # and summing the launches together (the default) or one by one changes no bit either
    alone = _run(dataclasses.replace(_cfg(world, "lina", chunks=2, pipeline=True, steps=4), grad_bits=8,
                                     grad_batch_bytes=0))
    assert _same_state(alone["state"], states["lina"])
    cfg = dataclasses.replace(_cfg(world, "lina", chunks=2, pipeline=True, steps=5), checkpoint_every=2, grad_bits=8)
    full_m, full_state = train(dataclasses.replace(cfg, checkpoint_every=0), None, progress=False)
    d = Path(tmp) / "g8"
    with pytest.raises(_Killed):
        train(cfg, d, progress=False, on_step=_die_after(3))
    keys = torch.load(checkpoint_path(d, rank), weights_only=True)["grad_keys"]
    assert keys["op_launches"] and all(n == 2 for n in keys["op_launches"].values())  # 2 steps done
    m, state = train(cfg, d, progress=False, resume=True)
    assert _same_state(state, full_state) and m.loss == full_m.loss


@pytest.mark.slow
def test_compressed_gradient_reduction_trains_and_resumes_exactly(tmp_path):
    import functools

    res = run_cases(2, [("grad_bits", functools.partial(_grad_bits_cases, str(tmp_path)))],
                    timeout_s=300, env={"COMMSCHED_TIMEOUT_S": "30"})
    assert_case(res, "grad_bits")


def test_grad_bits_is_checked():
    with pytest.raises(ValueError, match="--grad-bits must be one of 32, 16, 8, 4, 2"):
        _cfg(1, "lina").__class__(grad_bits=3)
    with pytest.raises(ValueError, match="--grad-bits 8 is an option of --impl commsched"):
        TrainConfig(impl="deepspeed", grad_bits=8)
    from commsched.moe.train.state import config_mismatch

    # a checkpoint written before --grad-bits existed resumes as the exact reduction it was
    rec = {"lr": 0.01, "grad_bits": 32}
    assert config_mismatch(rec, {"lr": 0.01}) is None
    assert "grad_bits: 32 -> 8" in config_mismatch({**rec, "grad_bits": 8}, {"lr": 0.01})
    # how many sums share a pair of collectives changes no bit: a resumed run may change it
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="--grad-batch-bytes must be an integer >= 0"):
            TrainConfig(grad_bits=8, grad_batch_bytes=bad)
    assert config_mismatch({**rec, "grad_batch_bytes": 0}, {**rec, "grad_batch_bytes": 1 << 22}) is None


def _cuda_resume_exact(tmp: str, rank: int, world: int) -> None:
    """On CUDA: the device's optimizer state and random state go through the checkpoint too."""
    import dataclasses

    cfg = dataclasses.replace(_cfg(world, "lina", chunks=2, pipeline=True, steps=4, device="cuda"),
                              checkpoint_every=2)
    dev = torch.device("cuda", 0)
    full_m, full_state = train(dataclasses.replace(cfg, checkpoint_every=0), None, progress=False, device=dev)
    d = Path(tmp) / "cuda"
    with pytest.raises(_Killed):
        train(cfg, d, progress=False, device=dev, on_step=_die_after(3))
    m, state = train(cfg, d, progress=False, device=dev, resume=True)
    assert _same_state(state, full_state) and m.loss == full_m.loss


@pytest.mark.cuda
def test_one_rank_resume_on_cuda_is_exact(tmp_path):
    import functools

    res = run_cases(1, [("cuda_resume", functools.partial(_cuda_resume_exact, str(tmp_path)))], timeout_s=300)
    assert_case(res, "cuda_resume")


_TINY_CLI = ["--d-model", "32", "--heads", "2", "--layers", "2", "--seq-len", "16", "--d-ff", "48",
             "--expert-hidden", "40", "--experts", "2", "--batch-size", "2", "--probe-steps", "1",
             "--eval-batches", "1", "--max-corpus-bytes", str(1 << 18), "--corpus", str(CORPUS),
             "--device", "cpu", "--warmup", "1", "--steps", "24", "--checkpoint-every", "4"]


@pytest.mark.slow
def test_cli_resume_after_sigkill_is_exact(tmp_path):
    """The CLI killed with SIGKILL once its first checkpoint exists, then resumed: the loss
    curve equals an uninterrupted run's; errors of --resume are one line and exit 2."""
    import json
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "COMMSCHED_PROGRESS": "0", "COMMSCHED_TIMEOUT_S": "20", "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "commsched.moe.train", *_TINY_CLI]
    subprocess.run([*cli, "--out", str(tmp_path / "full")], env=env, check=True, timeout=120, capture_output=True)
    run = tmp_path / "run"
    p = subprocess.Popen([*cli, "--out", str(run)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoint-rank0.pt").exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(timeout=30)
    assert not (run / "metrics.json").exists()  # killed before the end
    subprocess.run([*cli, "--out", str(run), "--resume"], env=env, check=True, timeout=120, capture_output=True)
    full = json.loads((tmp_path / "full" / "metrics.json").read_text())
    got = json.loads((run / "metrics.json").read_text())
    assert 4 <= got["resumed_from_step"] < 24 and got["resumed_from_step"] % 4 == 0
    assert got["loss"] == full["loss"] and len(got["loss"]) == 24
    bad = subprocess.run([*cli, "--out", str(run), "--resume", "--lr", "0.5"], env=env, timeout=120,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "different configuration (lr: 0.001 -> 0.5)" in bad.stderr and "checkpoint-rank0.pt" in bad.stderr


def test_checkpoint_options_are_checked():
    from commsched.moe.train.cli import build_parser, config_from_args
    from commsched.moe.train.state import config_mismatch, config_record

    with pytest.raises(ValueError, match="--checkpoint-every"):
        TrainConfig(checkpoint_every=-1)
    with pytest.raises(ValueError, match="--impl commsched"):
        TrainConfig(impl="deepspeed", checkpoint_every=2)
    a = build_parser().parse_args(["--checkpoint-every", "3", "--resume", "--out", "x"])
    assert config_from_args(a).checkpoint_every == 3 and a.resume
    base = TrainConfig(steps=4)
    # the run's length and what is measured after it may change; what shapes a step may not
    assert config_mismatch(config_record(TrainConfig(steps=9, checkpoint_every=2, warmup=3)),
                           config_record(base)) is None
    diff = config_mismatch(config_record(TrainConfig(steps=4, lr=0.5, model=ModelConfig(d_model=96))),
                           config_record(base))
    assert diff == "lr: 0.001 -> 0.5, model.d_model: 64 -> 96"


def test_one_rank_training_with_device_cpu():
    res = run_cases(1, [("cpu_explicit", _one_rank_cpu_explicit)], timeout_s=240)
    assert_case(res, "cpu_explicit")


@pytest.mark.cuda
def test_one_rank_training_on_cuda_matches_cpu():
    res = run_cases(1, [("cuda_matches_cpu", _one_rank_cuda_matches_cpu)], timeout_s=300)
    assert_case(res, "cuda_matches_cpu")


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c, _ in CASES2])
def test_moe_train_world2(results2, case):
    assert_case(results2, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c, _ in CASES4])
def test_moe_train_world4(results4, case):
    assert_case(results4, case)


def test_train_config_errors_speak():
    with pytest.raises(ValueError, match="--impl"):
        TrainConfig(impl="tutel")
    with pytest.raises(ValueError, match="--schedule lifo is not known"):
        SCHEDULES["lifo"]
    with pytest.raises(ValueError, match="warmup"):
        TrainConfig(steps=2, warmup=2)
    with pytest.raises(ValueError, match="multiple of n_heads"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="--allreduce-threads"):
        TrainConfig(allreduce_threads=0)


def test_default_credit_is_several_microops():
    from commsched.priority.policy import DEFAULT_CREDIT_MICROOPS

    assert DEFAULT_CREDIT_MICROOPS > 1
    assert LinaConfig().credit == DEFAULT_CREDIT_MICROOPS * (256 << 10)
    assert LinaConfig(microop_bytes=1024).credit == DEFAULT_CREDIT_MICROOPS * 1024
    assert LinaConfig(credit_bytes=4096).credit == 4096


def test_grad_scheduler_timeout_comes_from_the_environment(monkeypatch):
    from commsched.priority.runtime.executor import LOCAL

    p = torch.nn.Parameter(torch.ones(3))
    monkeypatch.setenv("COMMSCHED_TIMEOUT_S", "7")
    with GradScheduler([(p, LOCAL)], LinaConfig()) as s:
        assert s.timeout_s == 7.0
    with GradScheduler([(p, LOCAL)], LinaConfig(), timeout_s=2.5) as s:
        assert s.timeout_s == 2.5


def test_cli_fills_the_one_schedule_config(tmp_path):
    from commsched.moe.train.cli import build_parser, config_from_args
    p = build_parser()
    (choices,) = [a.choices for a in p._actions if "--schedule" in a.option_strings]
    assert tuple(choices) == tuple(SCHEDULES)
    cfg = config_from_args(p.parse_args(["--schedule", "lina", "--microop-bytes", "2048", "--credit-bytes", "4096",
                                         "--no-hold-in-block", "--out", str(tmp_path)]))
    assert cfg.schedule == LinaConfig(microop_bytes=2048, credit_bytes=4096, hold_in_block=False)
    cfg = config_from_args(p.parse_args(["--schedule", "fifo", "--bucket-bytes", "8192", "--out", str(tmp_path)]))
    assert cfg.schedule == FifoConfig(bucket_bytes=8192) and cfg.deepspeed == DeepSpeedConfig()
    cfg = config_from_args(p.parse_args(["--impl", "deepspeed", "--bucket-bytes", "8192", "--ds-stage", "1",
                                         "--out", str(tmp_path)]))
    assert cfg.deepspeed == DeepSpeedConfig(stage=1, bucket_bytes=8192) and cfg.schedule == LinaConfig()
    assert config_from_args(p.parse_args(["--out", str(tmp_path)])).schedule == TrainConfig().schedule
    with pytest.raises(SystemExit):
        p.parse_args(["--schedule", "lifo", "--out", str(tmp_path)])
    d = config_from_args(p.parse_args(["--out", str(tmp_path)]))
    assert (d.device, d.dtype, d.schedule.launch) == ("auto", "float32", None)
    c = config_from_args(p.parse_args(["--device", "cuda", "--dtype", "bfloat16", "--launch", "program",
                                       "--out", str(tmp_path)]))
    assert (c.device, c.dtype, c.schedule.launch) == ("cuda", "bfloat16", "program")
    for bad in (["--device", "tpu"], ["--dtype", "float16"]):
        with pytest.raises(SystemExit):
            p.parse_args([*bad, "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--dtype"):
        TrainConfig(dtype="float16")
    with pytest.raises(ValueError, match="--device"):
        TrainConfig(device="gpu")


@pytest.mark.parametrize("args, owner", [
    (["--schedule", "fifo", "--credit-bytes", "1"], "--credit-bytes belongs to --schedule lina, lina-overlap, not to "
                                                    "--schedule fifo"),
    (["--schedule", "lina", "--bucket-bytes", "64"], "--bucket-bytes belongs to --schedule fifo, not to --schedule lina"),
    (["--schedule", "flat", "--microop-bytes", "64"], "--microop-bytes belongs to --schedule lina, serial, lina-overlap"),
    (["--impl", "deepspeed", "--microop-bytes", "64"], "--microop-bytes belongs to --impl commsched, not to --impl deep"),
    (["--ds-stage", "1"], "--ds-stage belongs to --impl deepspeed, not to --impl commsched"),
    (["--schedule", "lina", "--fallback-probes", "-1"], "--fallback-probes must be a whole number >= 0 (0 turns the "
                                                        "probe off), got -1")])
def test_cli_refuses_an_option_of_another_schedule_or_runtime(tmp_path, capsys, args, owner):
    """One rule for every component's option given to another: exit 2, naming the owner; a
    schedule option out of range likewise names its flag, before the run folder is made."""
    from commsched.moe.train.cli import main

    assert main([*args, "--out", str(tmp_path / "o")]) == 2
    assert owner in capsys.readouterr().err and not (tmp_path / "o").exists()


def _rank_result(r: int, deepspeed: bool = False) -> dict:
    rows = [{"step_s": 1.0 + s + r, "fwd_s": 0.2, "bwd_s": 0.5, "loss": 5.0 - s, "a2a_s": 0.1 * (s + 1),
             "a2a_inflight_s": 0.3, "allreduce_s": 0.4, "allreduce_wait_s": 0.05}
            | ({} if deepspeed else {"allreduce_in_bwd": 0.5}) for s in range(3)]
    res = {"rows": rows, "timeline": [], "a2a_alone_s": [] if deepspeed else [0.08], "val_loss": 4.0 + r,
           "sizes": {"non_expert_params": 10}, "wall_clock_s": 9.0 + r}
    return res | ({"ds_comm_ops": ["all_to_all_single"]} if deepspeed else {})


def test_metrics_record_holds_the_documented_keys(tmp_path):
    import json

    from commsched.moe.train.training import TrainMetrics, summarize

    cfg = TrainConfig(steps=3, warmup=1)
    m = summarize(cfg, [_rank_result(0), _rank_result(1)], 2, "unit")
    assert isinstance(m, TrainMetrics)
    d = json.loads(m.write(tmp_path / "metrics.json").read_text())
    documented = ("impl", "schedule", "world_size", "loss", "step_time_s", "a2a_time_s", "allreduce_time_s")
    assert set(documented) <= set(TrainMetrics.field_names()) and set(documented) <= set(d)
    assert (d["impl"], d["schedule"], d["world_size"], d["ep_size"]) == ("commsched", "lina", 2, 2)
    assert d["loss"] == [5.0, 4.0, 3.0]
    assert d["step_time_s"] == pytest.approx(3.5)       # median over steps 1, 2 of the slowest rank
    assert d["a2a_time_s"] == pytest.approx(0.25) and d["allreduce_time_s"] == pytest.approx(0.4)
    assert d["a2a_alone_time_s"] == pytest.approx(0.08) and d["allreduce_in_backward_share"] == 0.5
    assert d["val_loss"] == 4.5 and d["wall_clock_s"] == 10.0 and d["config"]["schedule"]["policy"] == "lina"
    assert "deepspeed_comm_ops" not in d
    ds = summarize(TrainConfig(impl="deepspeed", steps=3, warmup=1), [_rank_result(0, True)], 1, "unit").to_dict()
    assert ds["schedule"] == "deepspeed-zero2" and ds["deepspeed_comm_ops"] == ["all_to_all_single"]
    assert ds["allreduce_in_backward_share"] is None and ds["a2a_alone_time_s"] is None


def test_train_state_files_are_read_safely(tmp_path):
    """Every way a checkpoint file can be wrong is one ValueError naming the file; a good
    one round-trips (weights_only)."""
    from commsched.moe.train.state import (
        FORMAT,
        VERSION,
        checkpoint_path,
        make_state,
        read_state,
        write_tmp,
    )

    path = checkpoint_path(tmp_path, 3)
    assert path.name == "checkpoint-rank3.pt"
    with pytest.raises(ValueError, match="no checkpoint at .*checkpoint-rank3.pt"):
        read_state(path)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    st = make_state(cfg=TrainConfig(), step=4, rank=3, world_size=4, ep_size=4, model=model, optimizer=opt,
                    rows=[{"loss": 1.5}], device=torch.device("cpu"))
    write_tmp(path, st).replace(path)
    back = read_state(path)
    assert back["step"] == 4 and back["rows"] == [{"loss": 1.5}] and torch.equal(back["rng"]["cpu"], st["rng"]["cpu"])
    good = path.read_bytes()
    cases = {"truncated": good[:len(good) // 2], "garbage": b"\x00garbage" * 10, "empty": b""}
    for blob in cases.values():  # truncated, garbage, empty
        path.write_bytes(blob)
        with pytest.raises(ValueError, match=r"cannot read the checkpoint .*checkpoint-rank3\.pt"):
            read_state(path)
    for bad, match in (({"format": "other"}, "not a commsched MoE training checkpoint"),
                       ({"format": FORMAT, "version": 99}, "version 99"),
                       ({"format": FORMAT, "version": VERSION, "step": 1}, "incomplete .*missing or malformed: config")):
        torch.save(bad, path)
        with pytest.raises(ValueError, match=match):
            read_state(path)
    # a pickled object that weights_only refuses is refused, never loaded unsafely
    torch.save({"format": FORMAT, "obj": TrainConfig()}, path)
    with pytest.raises(ValueError, match="cannot read the checkpoint") as e:
        read_state(path)
    assert "weights_only" not in str(e.value) and "\n" not in str(e.value)


class _CudaEventLike:
    """What DeepSpeed's timers hold on CUDA: an event timer, not a float."""

    def __float__(self):
        raise TypeError("float() argument must be a string or a real number, not 'CudaEventTimer'")


def test_deepspeed_comm_times_come_from_the_logger_dictionary():
    """Audit 2, item 2: the latencies are read from ``comms_logger.comms_dict`` (floats on
    every device; each entry the op's timer total so far), never from the timers' events."""
    from commsched.moe.train.deepspeed_baseline import comm_latency_s

    d = {"all_to_all_single": {4096: [2, [1.5, 3.0], [0, 0], [0, 0]], 512: [1, [4.0], [0], [0]]},
         "all_reduce": {64: [3, [0.5, 1.0, 2.0], [], []]}, "broadcast": {8: [0, [], [], []]}}
    a2a, other = comm_latency_s(d)
    assert a2a == pytest.approx(0.004) and other == pytest.approx(0.002)
    assert comm_latency_s({}) == (0.0, 0.0)
    timer = type("Timer", (), {"event_timers": [_CudaEventLike()]})()
    with pytest.raises(TypeError):  # what summing the timers did on CUDA
        sum(float(x) for x in timer.event_timers)


def test_deepspeed_logger_is_off_for_timed_cuda_steps_and_the_summary_says_where_times_came_from():
    """Audit 2, item 2b: the comms logger synchronises after every collective; on CUDA it is on
    for the warm-up steps only, and the summary takes the communication times from them."""
    from commsched.moe.train.deepspeed_baseline import profiled_step
    from commsched.moe.train.training import summarize

    assert [profiled_step(s, 2, cuda=True) for s in range(4)] == [True, True, False, False]
    assert all(profiled_step(s, 2, cuda=False) for s in range(4))
    res = _rank_result(0, True)
    for s in (1, 2):  # timed steps of warmup=1, run without the logger
        res["rows"][s].update(a2a_s=None, a2a_inflight_s=None, allreduce_s=None)
    ds = summarize(TrainConfig(impl="deepspeed", steps=3, warmup=1), [res], 1, "unit").to_dict()
    assert ds["a2a_time_s"] == pytest.approx(0.1) and ds["allreduce_time_s"] == pytest.approx(0.4)
    assert "steps [0]" in ds["comm_times_from"] and ds["step_time_s"] == pytest.approx(2.5)


def test_cli_defaults_are_the_configs(tmp_path):
    """The flags are generated from the configs: no flag given is the default config."""
    from commsched.moe.train.cli import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(["--out", str(tmp_path)])) == TrainConfig()


def test_ranks_may_bind_the_reduction_to_their_own_host_address():
    """On emulated hosts every host binds the reduction to its own address in the link
    class's subnet (``--reduce-address {caddr1}``): the cross-rank check compares only
    whether an address is set, and every other field as before."""
    from commsched.agree import config_digest
    from commsched.moe.train.trainer import _comparable
    from commsched.priority.policy import LinaConfig

    def cfg(address, steps=10):
        return TrainConfig(steps=steps, schedule=LinaConfig(reduce_address=address))

    host0, host1 = _comparable(cfg("10.213.1.1"), False), _comparable(cfg("10.213.1.2"), False)
    assert config_digest(host0) == config_digest(host1)
    assert config_digest(host0) != config_digest(_comparable(cfg(None), False))
    assert config_digest(host0) != config_digest(_comparable(cfg("10.213.1.1", steps=11), False))
    assert config_digest(host0) != config_digest(_comparable(cfg("10.213.1.1"), True))


def test_fallback_exchange_switches_the_all_to_all_to_fifos():
    """``--fallback-exchange``: in the probe's fallback steps (and after it chose the
    fallback) every MoE layer's all-to-all runs as fifo's, one chunk, not pipelined; in the
    others as configured. On by default (``--no-fallback-exchange`` keeps a run's bits
    independent of the timed decision)."""
    from commsched.moe.model.layer import DispatchConfig, MoELayer
    from commsched.moe.model.lm import ModelConfig, MoETransformerLM
    from commsched.moe.train.cli import build_parser, config_from_args
    from commsched.moe.train.trainer import _fallback_exchange

    class Listeners:
        def __init__(self):
            self.fns = []

        def on_mode(self, fn):
            self.fns.append(fn)

    assert TrainConfig().fallback_exchange
    assert not config_from_args(build_parser().parse_args(["--no-fallback-exchange", "--out", "x"])).fallback_exchange
    lina = DispatchConfig(chunks=4, pipeline=True)
    model = MoETransformerLM(ModelConfig(d_model=16, n_heads=2, n_layers=2, seq_len=8, d_ff=16, expert_hidden=16,
                                         num_experts=2, k=1, moe_every=1), dispatch=lina)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    opt = Listeners()
    _fallback_exchange(opt, model, lina)
    (switch,) = opt.fns
    switch(True)
    assert layers and all((m.dispatch.chunks, m.dispatch.pipeline) == (1, False) for m in layers)
    switch(False)
    assert all(m.dispatch == lina for m in layers)
    merged = Listeners()  # a merged pipelined exchange falls back to one chunk too
    _fallback_exchange(merged, model, DispatchConfig(chunks=4, pipeline=True, merge=True))
    (switch,) = merged.fns
    switch(True)
    assert all((m.dispatch.chunks, m.dispatch.pipeline, m.dispatch.merge) == (1, False, False) for m in layers)
    fifo = Listeners()  # already fifo's exchange: nothing to switch
    _fallback_exchange(fifo, model, DispatchConfig())
    assert fifo.fns == []


def _diverged(rank: int, world: int, out: str) -> dict:
    """--lr 1e6: the loss is NaN from the second step on. A run shorter than the guard's
    patience ends with strict JSON (null for NaN) and one warning on rank 0; a longer one
    stops on every rank at the same step with one line."""
    import contextlib
    import dataclasses
    import io
    import json

    from commsched.results import NONFINITE_STOP_AFTER, DivergedError

    cfg = dataclasses.replace(_cfg(world, "lina", steps=4), lr=1e6)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        train(cfg, Path(out), progress=False)
    dist.barrier()
    text = (Path(out) / "metrics.json").read_text()
    loss = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.json"))["loss"]
    assert None in loss and all(x is None or x == x for x in loss)
    warned = err.getvalue()
    if rank == 0:
        assert warned.count("warning: the training loss is nan at step ") == 1, warned
    else:
        assert "warning" not in warned
    long = dataclasses.replace(cfg, steps=4 + NONFINITE_STOP_AFTER + 3)
    with pytest.raises(DivergedError) as e, contextlib.redirect_stderr(io.StringIO()):
        train(long, None, progress=False)
    return {"msg": str(e.value)}


def test_a_diverged_run_warns_stops_and_writes_strict_json(tmp_path):
    res = run_ranks(2, _diverged, str(tmp_path), timeout_s=240)
    msgs = {r["msg"] for r in res}
    assert len(msgs) == 1  # the same step on every rank
    (msg,) = msgs
    assert "the training loss was not finite for 5 steps in a row" in msg and "lower --lr (now 1e+06)" in msg


def _deepspeed_diverged(rank: int, world: int) -> dict:
    """--impl deepspeed --lr 1e6: the baseline's loop has the same guard as commsched's."""
    import contextlib
    import dataclasses
    import io

    from commsched.results import NONFINITE_STOP_AFTER, DivergedError

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    cfg = dataclasses.replace(_cfg(world, "fifo", impl="deepspeed", k=1, steps=4 + NONFINITE_STOP_AFTER + 3),
                              lr=1e6)
    err = io.StringIO()
    with pytest.raises(DivergedError) as e, contextlib.redirect_stderr(err):
        train(cfg, None, progress=True)
    return {"msg": str(e.value), "warned": err.getvalue().count("warning: the training loss is ")}


@pytest.mark.slow
def test_a_diverged_deepspeed_run_stops_on_every_rank_at_the_same_step():
    pytest.importorskip("deepspeed")
    res = run_ranks(2, _deepspeed_diverged, timeout_s=240)
    assert len({r["msg"] for r in res}) == 1, res  # the same step on every rank
    assert "the training loss was not finite for 5 steps in a row" in res[0]["msg"] and "lower --lr (now 1e+06)" in res[0]["msg"]
    assert [r["warned"] for r in res] == [1, 0]  # rank 0 warns, once
