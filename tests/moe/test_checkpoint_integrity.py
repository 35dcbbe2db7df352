"""MoE training checkpoints on gloo ranks: a damaged file is refused naming the file and the
tensor, ranks whose replicated state disagrees are stopped, and the files a kill between
the two renames of a commit leaves still resume exactly."""

from __future__ import annotations

import dataclasses
import functools
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from commsched.results import with_digests
from tests.moe import test_train as base
from tests.mp import assert_case, run_cases


def _cfg(world: int, steps: int):
    return dataclasses.replace(base._cfg(world, "fifo", steps=steps), checkpoint_every=2)


def _replicated_key(st: dict) -> str:
    """A data-parallel (non-expert) weight of the model, as the checkpoint names it."""
    return next(k for k, v in st["model"].items() if "expert" not in k and v.dtype == torch.float32
                and v.numel() >= 16 and "norm" not in k)


def _flip_a_bit(path: Path, key: str) -> None:
    """One exponent bit of the middle float32 of ``key``, in the file's bytes (as a disk or a
    copy would damage it: torch's reader checks no checksum of tensor bytes)."""
    t = torch.load(path, weights_only=True)["model"][key]
    data = bytearray(path.read_bytes())
    pos = bytes(data).find(t.contiguous().numpy().tobytes()) + 4 * (t.numel() // 2) + 3
    data[pos] ^= 0x20
    path.write_bytes(bytes(data))


def _damage_and_replicas(tmp: str, rank: int, world: int) -> None:
    from commsched.moe.train.state import checkpoint_path
    from commsched.moe.train.trainer import train

    d = Path(tmp) / "run"
    cfg = _cfg(world, 2)
    train(cfg, d, progress=False)
    mine = checkpoint_path(d, rank)
    good = mine.read_bytes()
    key = _replicated_key(torch.load(mine, weights_only=True))
    longer = dataclasses.replace(cfg, steps=4)
    # one flipped bit in rank 1's file: refused on every rank, naming the file and the tensor
    if rank == 1:
        _flip_a_bit(mine, key)
    dist.barrier()
    with pytest.raises(ValueError, match=rf"checkpoint-rank1\.pt is damaged: tensor model\.{key} does not match"):
        train(longer, d, progress=False, resume=True)
    # a whole file (its digests recomputed) whose replicated weight differs from its peer's
    if rank == 1:
        st = torch.load(mine, weights_only=True)
        st["model"][key] = st["model"][key].clone()
        st["model"][key].view(-1)[0] += 1.0
        del st["digests"]
        torch.save(with_digests(st), mine)
    dist.barrier()
    with pytest.raises(ValueError, match=rf"do not hold one run's replicas: tensor {key} differs "
                                         "between rank 0 and rank 1"):
        train(longer, d, progress=False, resume=True)
    mine.write_bytes(good)
    dist.barrier()
    m, _ = train(longer, d, progress=False, resume=True)  # restored: resumes
    assert m.to_dict()["resumed_from_step"] == 2
    # expert-parallel size 1: each rank holds every expert, so the experts are replicas too
    d1 = Path(tmp) / "ep1"
    ep1 = dataclasses.replace(base._cfg(world, "fifo", steps=2, ep=1), checkpoint_every=2)
    train(ep1, d1, progress=False)
    mine = checkpoint_path(d1, rank)
    good = mine.read_bytes()
    st = torch.load(mine, weights_only=True)
    ekey = next(k for k in st["model"] if "expert" in k)
    if rank == 1:
        st["model"][ekey] = st["model"][ekey].clone()
        st["model"][ekey].view(-1)[0] += 1.0
        del st["digests"]
        torch.save(with_digests(st), mine)
    dist.barrier()
    with pytest.raises(ValueError, match=rf"tensor {ekey} differs between rank 0 and rank 1"):
        train(dataclasses.replace(ep1, steps=4), d1, progress=False, resume=True)
    mine.write_bytes(good)
    dist.barrier()
    assert train(dataclasses.replace(ep1, steps=4), d1, progress=False, resume=True)[0].to_dict()["resumed_from_step"] == 2


def test_damaged_checkpoint_and_disagreeing_replicas_are_refused(tmp_path):
    res = run_cases(2, [("damage", functools.partial(_damage_and_replicas, str(tmp_path)))], timeout_s=150)
    assert_case(res, "damage")


def _crash_states(tmp: str, rank: int, world: int) -> None:
    """The files a kill can leave between the two renames of a commit (rank 1 killed):
    ``.prev.pt`` + ``.pt.tmp`` and no ``.pt``; only ``.pt.tmp`` from the first checkpoint;
    ``.pt`` one step behind with the matching step in ``.pt.tmp``. Each resumes from the
    newest step both ranks hold and ends bitwise equal to an uninterrupted run."""
    from commsched.moe.train.state import checkpoint_path, previous_path
    from commsched.moe.train.trainer import train

    def temp_path(path: Path) -> Path:  # where a commit's first file is written
        return path.with_name(path.name + ".tmp")

    root = Path(tmp)
    full_m, full_state = train(dataclasses.replace(_cfg(world, 6), checkpoint_every=0), None, progress=False)
    d = root / "src"
    train(_cfg(world, 2), d, progress=False)
    s2 = checkpoint_path(d, rank).read_bytes()
    train(_cfg(world, 4), d, progress=False, resume=True)
    s4 = checkpoint_path(d, rank).read_bytes()
    # (rank 0's files, rank 1's files, the step resumed from); files as {kind: bytes}
    cases = {"prev_and_tmp": ({"pt": s4}, {"prev": s2, "tmp": s4}, 4),
             "first_tmp_only": ({"pt": s2}, {"tmp": s2}, 2),
             "tmp_one_step_ahead": ({"pt": s4}, {"pt": s2, "tmp": s4}, 4)}
    for name, (files0, files1, step) in cases.items():
        run = root / name
        run.mkdir(exist_ok=True)
        path = checkpoint_path(run, rank)
        where = {"pt": path, "prev": previous_path(path), "tmp": temp_path(path)}
        for kind, data in (files0 if rank == 0 else files1).items():
            where[kind].write_bytes(data)
        dist.barrier()
        m, state = train(_cfg(world, 6), run, progress=False, resume=True)
        assert m.to_dict()["resumed_from_step"] == step, name
        assert m.loss == full_m.loss, name
        assert all(torch.equal(state[k], full_state[k]) for k in full_state), name
    # nothing usable in common: what each rank holds is said
    run = root / "apart"
    run.mkdir(exist_ok=True)
    shutil.copy(checkpoint_path(d, rank), checkpoint_path(run, rank))
    if rank == 1:
        checkpoint_path(run, rank).write_bytes(s2)
        temp_path(checkpoint_path(run, rank)).write_bytes(b"half a file")
    dist.barrier()
    with pytest.raises(ValueError, match=r"hold no step in common \(rank 0: checkpoint-rank0\.pt \(step 4\); "
                                         r"rank 1: checkpoint-rank1\.pt \(step 2\), checkpoint-rank1\.pt\.tmp "
                                         r"\(not usable\)\)"):
        train(_cfg(world, 6), run, progress=False, resume=True)


def test_resume_takes_the_files_a_kill_between_renames_leaves(tmp_path):
    res = run_cases(2, [("crash_states", functools.partial(_crash_states, str(tmp_path)))], timeout_s=200)
    assert_case(res, "crash_states")
