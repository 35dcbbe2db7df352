"""Fault suite, part A: a frozen or killed rank ends every front-end within the timeout
plus a margin, and the survivors name the rank that stopped answering; ranks started
with different configurations stop with one ValueError naming the first differing key
(through the library API), never an abort inside gloo.

Every run here is 3 gloo ranks under COMMSCHED_TIMEOUT_S=5 with tiny models, inside
the harness's own time limit.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from commsched.agree import config_differences
from commsched.dist import LIVENESS_WAIT_MAX_S
from tests.mp import assert_case, run_cases, run_ranks
from tests.priority import sched_of

TIMEOUT_S = 5.0
ENV = {"COMMSCHED_TIMEOUT_S": str(TIMEOUT_S), "COMMSCHED_PROGRESS": "0"}
VICTIM = 1
# the survivors' error comes at most one timeout after the fault, then at most one
# liveness wait; the rest is slack for a shared, slow CI machine
BOUND_S = TIMEOUT_S + min(LIVENESS_WAIT_MAX_S, TIMEOUT_S) + 20.0
CORPUS = Path(__file__).resolve().parents[2] / "commsched" / "moe" / "train" / "cli.py"


def _fault(how: str, stamp: str) -> None:
    """Stop this process the way a broken node would, after noting when."""
    Path(stamp).write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP if how == "freeze" else signal.SIGKILL)
    time.sleep(3600)  # not reached by a killed rank; a frozen one is killed by the harness


def _survive(body) -> dict:
    """Run ``body``; a survivor must end with a CommError. Returns its message and when."""
    from commsched.dist import CommError

    t0 = time.time()
    try:
        body()
    except CommError as e:
        return {"msg": str(e), "at": time.time(), "t0": t0}
    return {"msg": None, "at": time.time(), "t0": t0}


# --------------------------------------------------------------------------- the three jobs
def _gnn(rank: int, world: int, how: str, stamp: str) -> dict:
    from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
    from commsched.gnn.graph.partition import make_parts, partition_nodes
    from commsched.gnn.train.trainer import TrainConfig, run_training

    g = synthetic_graph(SyntheticSpec(num_nodes=120, num_edges=500, num_features=6, num_classes=3,
                                      communities_per_class=1, seed=3))
    part = make_parts(g, partition_nodes(g, world, "random", 0), world)[rank]
    cfg = TrainConfig(layers=2, hidden=8, epochs=1000, eval_every=1000)

    def on_epoch(tr) -> None:
        if rank == VICTIM and tr.epoch == 3:
            _fault(how, stamp)

    return _survive(lambda: run_training(cfg, part, on_epoch=on_epoch))


def _moe_cfg(world: int, steps: int, schedule: str = "lina", **kw):
    from commsched.moe.model.layer import DispatchConfig
    from commsched.moe.model.lm import ModelConfig
    from commsched.moe.train.trainer import TrainConfig

    model = ModelConfig(d_model=16, n_heads=2, n_layers=2, seq_len=8, d_ff=24, expert_hidden=20,
                        num_experts=world, k=1, moe_every=2)
    return TrainConfig(model=model, schedule=sched_of(schedule, microop_bytes=1024, bucket_bytes=4096),
                       dispatch=DispatchConfig(chunks=1, pipeline=False), steps=steps, batch_size=2, lr=1e-2, seed=3,
                       warmup=1, probe_steps=1, eval_batches=1, corpus=str(CORPUS),
                       max_corpus_bytes=1 << 16, device="cpu", **kw)


def _moe_train(rank: int, world: int, how: str, stamp: str, schedule: str = "lina") -> dict:
    import commsched.moe.train.trainer as mt

    real_load = mt.load_corpus

    class Faulty:
        def __init__(self, c):
            self._c = c

        def __getattr__(self, name):
            return getattr(self._c, name)

        def batch(self, *a, step: int, rank: int, **kw):
            if rank == VICTIM and step == 3:
                _fault(how, stamp)
            return self._c.batch(*a, step=step, rank=rank, **kw)

    mt.load_corpus = lambda *a, **kw: Faulty(real_load(*a, **kw))  # this spawned process only
    return _survive(lambda: mt.train(_moe_cfg(world, 1000, schedule), None, progress=False))


def _moe_train_overlap(rank: int, world: int, how: str, stamp: str) -> dict:
    """lina-overlap: the reduction's tail runs under the next forward pass."""
    return _moe_train(rank, world, how, stamp, schedule="lina-overlap")


def _infer_cfg(batches: int, seed: int = 1):
    from commsched.moe.infer import EmulationConfig, InferConfig, TraceDriverConfig
    from commsched.moe.record.traces import SyntheticTraceConfig

    syn = SyntheticTraceConfig(num_experts=6, num_layers=2, k=2, num_tokens=1024, seq_len=16)
    return InferConfig(placement="lina", compute="emulated", batches=batches, warmup=1,
                       emulation=EmulationConfig(us_per_row=0.0, load_ms=0.0),
                       trace=TraceDriverConfig(synthetic=syn, tokens_per_batch=48, d_model=8,
                                               expert_hidden=12), seed=seed)


def _moe_infer(rank: int, world: int, how: str, stamp: str) -> dict:
    import commsched.moe.infer.loop as mi

    class Faulty(mi.Runtime):
        def begin_batch(self, b, T):
            if rank == VICTIM and b == 3:
                _fault(how, stamp)
            return super().begin_batch(b, T)

    mi.Runtime = Faulty  # this spawned process only (the run loop's Runtime)
    return _survive(lambda: mi.run(_infer_cfg(8)))


JOBS = {"gnn": _gnn, "moe_train": _moe_train, "moe_train_overlap": _moe_train_overlap,
        "moe_infer": _moe_infer}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["freeze", "kill"])
@pytest.mark.parametrize("job", list(JOBS))
def test_a_stopped_rank_ends_the_job_and_is_named(job, how, tmp_path):
    stamp = str(tmp_path / "fault_at")
    res = run_ranks(3, JOBS[job], how, stamp, allow_missing=[VICTIM], pg_timeout_s=TIMEOUT_S,
                    timeout_s=180, env=ENV)
    fault_at = float(Path(stamp).read_text())
    for r in (0, 2):
        got = res[r]
        assert got is not None and got["msg"] is not None, (r, got)
        assert got["msg"].startswith(f"rank {r}:"), got["msg"]
        assert f"rank {VICTIM} stopped answering" in got["msg"], got["msg"]
        took = got["at"] - fault_at
        assert took < BOUND_S, f"rank {r} needed {took:.1f} s after the fault: {got['msg']}"


# --------------------------------------------------------------------------- config agreement
def test_config_differences_name_nested_keys():
    from commsched.gnn.exchange.modes import AdaQPConfig
    from commsched.gnn.train.trainer import TrainConfig

    a = TrainConfig(mode="adaqp")
    b = dataclasses.replace(a, lr=0.02, exchange=dataclasses.replace(a.exchange, lam=0.25))
    assert [k for k, _, _ in config_differences(a, b)] == ["exchange.lam", "lr"]
    assert config_differences(a, a) == []
    assert config_differences({"x": 1}, {"y": 1}) == [("x", 1, "<missing>"), ("y", "<missing>", 1)]
    assert isinstance(a.exchange, AdaQPConfig)


def _gnn_part(rank: int, world: int):
    from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
    from commsched.gnn.graph.partition import make_parts, partition_nodes

    g = synthetic_graph(SyntheticSpec(num_nodes=90, num_edges=360, num_features=5, num_classes=3,
                                      communities_per_class=1, seed=4))
    return make_parts(g, partition_nodes(g, world, "random", 0), world)[rank]


def _expect_value_error(fn, *words: str) -> None:
    try:
        fn()
    except ValueError as e:
        for w in words:
            assert w in str(e), (w, str(e))
        return
    raise AssertionError(f"no ValueError (expected one naming {words})")


def _case_gnn_lr(rank, world):
    from commsched.gnn.train.trainer import TrainConfig, run_training

    cfg = TrainConfig(layers=2, hidden=8, epochs=2, lr=0.02 if rank == 2 else 0.01)
    _expect_value_error(lambda: run_training(cfg, _gnn_part(rank, world)),
                        "ranks [2]", "lr: rank 0 has 0.01, rank 2 has 0.02")


def _case_gnn_nested(rank, world):
    from commsched.gnn.exchange.modes import AdaQPConfig
    from commsched.gnn.train.trainer import TrainConfig, run_training

    cfg = TrainConfig(mode="adaqp", layers=2, hidden=8, epochs=2,
                      exchange=AdaQPConfig(lam=0.25 if rank == 1 else 0.5))
    _expect_value_error(lambda: run_training(cfg, _gnn_part(rank, world)), "ranks [1]", "adaqp.lam")


def _case_gnn_hidden_dtype_model(rank, world):
    from commsched.gnn.train.trainer import TrainConfig, run_training

    part = _gnn_part(rank, world)
    for key, odd in (("hidden", {"hidden": 4}), ("dtype", {"dtype": "float64"}), ("model", {"model": "sage"})):
        cfg = TrainConfig(**{"layers": 2, "hidden": 8, "epochs": 2, **(odd if rank == 1 else {})})
        _expect_value_error(lambda c=cfg: run_training(c, part), "ranks [1]", f"{key}: rank 0 has")


def _case_halo_rows_validated(rank, world):
    import torch

    from commsched.gnn.exchange.halo import VanillaExchange

    ex = VanillaExchange(_gnn_part(rank, world).book)
    ex.validate(dtype=torch.float32, row_numel=5)
    _expect_value_error(lambda: ex.validate(dtype=torch.float64 if rank == 2 else torch.float32),
                        "different dtypes")
    _expect_value_error(lambda: ex.validate(row_numel=7 if rank == 0 else 5), "rows have different sizes")


def _case_moe_train_lr(rank, world):
    from commsched.moe.train.trainer import train

    cfg = _moe_cfg(world, 2)
    cfg = dataclasses.replace(cfg, lr=0.5) if rank == 2 else cfg
    _expect_value_error(lambda: train(cfg, None, progress=False), "ranks [2]", "lr: rank 0 has 0.01")


def _case_moe_train_hidden(rank, world):
    from commsched.moe.train.trainer import train

    cfg = _moe_cfg(world, 2)
    if rank == 1:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=32))
    _expect_value_error(lambda: train(cfg, None, progress=False), "ranks [1]", "model.d_model")


def _case_dispatch_rows_validated(rank, world):
    import torch

    from commsched.moe.model.dispatch import ExpertGroup

    eg = ExpertGroup(world, world, rank)
    eg.validate(16, torch.float32)
    _expect_value_error(lambda: eg.validate(16 if rank else 32, torch.float32), "rows have different sizes")
    _expect_value_error(lambda: eg.validate(16, torch.bfloat16 if rank == 2 else torch.float32),
                        "different dtypes")
    odd = ExpertGroup(2 * world if rank == 1 else world, world, rank)
    _expect_value_error(lambda: odd.validate(16, torch.float32), "num_experts")


def _case_moe_infer_seed(rank, world):
    from commsched.moe.infer import run

    _expect_value_error(lambda: run(_infer_cfg(2, seed=7 if rank == 1 else 1)), "ranks [1]", "seed: rank 0 has 1")


CASES = [(f.__name__[6:], f) for f in (_case_gnn_lr, _case_gnn_nested, _case_gnn_hidden_dtype_model,
                                       _case_halo_rows_validated, _case_moe_train_lr,
                                       _case_moe_train_hidden, _case_dispatch_rows_validated,
                                       _case_moe_infer_seed)]


@pytest.fixture(scope="module")
def mismatch_results():
    return run_cases(3, CASES, timeout_s=240, pg_timeout_s=60, env=ENV)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c, _ in CASES])
def test_per_rank_config_mismatch_is_one_clear_value_error(mismatch_results, case):
    assert_case(mismatch_results, case)


# --------------------------------------------------------------------------- group timeouts
def _group_timeouts(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from commsched.dist import new_group
    from commsched.moe.train.trainer import make_groups

    def timeout_of(g) -> float:
        return g._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    g = make_groups(1, allreduce_threads=3)
    out = {"plain": timeout_of(new_group([0])), "threaded": timeout_of(new_group([0], threads=3)),
           "given": timeout_of(new_group([0], timeout_s=2.5)),
           "moe_ep": timeout_of(g.ep_group), "moe_dp": timeout_of(g.dp_group),
           "torch_default": timeout_of(dist.new_group([0]))}
    try:
        import deepspeed
        from deepspeed.comm import comm as ds_comm

        from commsched.moe.train.deepspeed_baseline import _groups_under_timeout
    except ImportError:
        return out
    deepspeed.init_distributed(dist_backend="gloo")
    _groups_under_timeout()
    out["deepspeed"] = timeout_of(ds_comm.new_group([0]))
    return out


@pytest.mark.slow
def test_every_group_commsched_makes_has_the_configured_timeout():
    got = run_ranks(1, _group_timeouts, timeout_s=120, env={"COMMSCHED_TIMEOUT_S": "4"})[0]
    assert got["torch_default"] == 1800.0  # what a bare dist.new_group would have given
    assert got.pop("given") == 2.5
    del got["torch_default"]
    assert all(v == 4.0 for v in got.values()), got
    import importlib.util

    assert "deepspeed" in got or importlib.util.find_spec("deepspeed") is None


def test_only_a_peer_failure_asks_who_is_alive():
    from commsched.dist import CommError, comm_guard, peer_failure_hint, unresponsive_ranks

    assert "timeout" in peer_failure_hint("Timed out waiting 5000ms for recv operation")
    assert "died" in peer_failure_hint("Connection reset by peer")
    assert peer_failure_hint("split sizes do not sum to the tensor's rows") is None
    assert unresponsive_ranks() is None  # no process group: nobody to ask
    t = time.monotonic()
    with pytest.raises(CommError, match=r"^rank 0: step x failed: the collective failed: bad sizes$"):
        with comm_guard("step x"):
            raise RuntimeError("bad sizes")
    assert time.monotonic() - t < 1.0


def _slow_rank0_then_scatter(rank: int, world: int, work_s: float, wait_s: float | None) -> str:
    """Rank 0 works longer than the collective timeout, then scatters; the others wait on
    the store (long_work_done) and return what they got, or the error they raised."""
    from commsched.dist import long_work_done, scatter_object

    if rank == 0:
        time.sleep(work_s)
    try:
        long_work_done("partitioning on rank 0", wait_s=wait_s)
    except RuntimeError as e:
        return f"error: {e}"
    if wait_s is not None:
        return "waited"
    return scatter_object([f"part {r}" for r in range(world)] if rank == 0 else None, "scattering", 0)


def test_one_rank_working_past_the_timeout_does_not_time_out_the_others():
    """The collective after one rank's long one-off work (rank 0 partitioning a large graph)
    waits for it past COMMSCHED_TIMEOUT_S; a wait past its own deadline names the work."""
    got = run_ranks(2, _slow_rank0_then_scatter, 3 * TIMEOUT_S / 5 + 4.0, None, pg_timeout_s=3.0,
                    env={"COMMSCHED_TIMEOUT_S": "3"})
    assert got == ["part 0", "part 1"]
    got = run_ranks(2, _slow_rank0_then_scatter, 3.0, 0.5, pg_timeout_s=3.0, env={"COMMSCHED_TIMEOUT_S": "3"})
    assert got[0] == "waited"
    assert got[1] == "error: partitioning on rank 0: rank 0 did not finish within 0.5 s"
