"""Checkpoints of MoE training (``--impl commsched``): one file per rank, exact resume.

Each rank writes ``OUT/checkpoint-rank{r}.pt`` (its experts are its own, so its model
and optimizer state are too): the step reached, the model's and Adam's state, this
rank's per-step rows (losses and timings of the steps done so far), torch's CPU random
state (and the device's on CUDA), and the configuration that wrote it. The data position
is the step counter itself: batch ``step`` of rank ``r`` is drawn from a generator seeded
by (seed, step, rank) (:meth:`commsched.moe.model.data.Corpus.batch`), so continuing at step k
reads exactly the batches an uninterrupted run reads. The optimizer state is the step
interface's (:meth:`commsched.priority.step.GradStep.state_dict`: the optimizer's own, so
the format is what it was before that interface); the gradient scheduler
(:class:`commsched.priority.runtime.executor.GradScheduler`) keeps no state from one step to the
next (its policy starts afresh at every ``begin_step``), so there is none to save.

Files are written atomically: every rank writes ``checkpoint-rank{r}.pt.tmp``, the ranks
meet at a barrier, then each renames its file over the old one, so a rank killed while
writing leaves the previous checkpoint whole. Every file carries the digest of each tensor
it holds (:func:`commsched.results.with_digests`), checked when it is read: torch's reader
checks no checksum of tensor bytes, so a damaged file would otherwise load. They are read
with ``torch.load(weights_only=True)`` only; any failure to read one, and a tensor whose
digest does not match, is a ``ValueError`` naming the file (and the tensor). A file
written before digests existed is read unchecked, said on stderr; a temporary file counts
only when its digests verify.

Nothing here touches a process group: :mod:`commsched.moe.train.trainer` does the collective
parts (the barrier, the agreement of every rank on the step to resume from).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from ...results import DIGESTS, check_digests, save_torch, with_digests

FORMAT = "commsched-moe-train-state"
VERSION = 1
# configuration fields a resumed run may change: the length of the run and what is
# measured after it, never what shapes a step's arithmetic (grad_batch_bytes: how many sums share
# a pair of collectives, never their bits)
RESUMABLE = ("steps", "checkpoint_every", "warmup", "probe_steps", "eval_batches", "timeline_step",
             "device", "grad_batch_bytes")


_KEYS = ("config", "step", "rank", "world_size", "ep_size", "model", "optimizer", "rows", "rng")


# configuration keys added after checkpoints were first written, with the value a checkpoint
# without them was trained with: such a file still resumes under that value
ADDED_KEYS = {"grad_bits": 32, "compute": "real", "device_model": "a100", "dilation": 1.0}


def checkpoint_path(out: str | os.PathLike, rank: int) -> Path:
    """``out/checkpoint-rank{rank}.pt``."""
    return Path(out) / f"checkpoint-rank{rank}.pt"


def config_record(cfg: Any) -> dict:
    """A training configuration as plain JSON values (what a checkpoint stores)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def config_mismatch(mine: dict, theirs: dict) -> str | None:
    """None when two configuration records agree outside :data:`RESUMABLE`, else the
    differing keys as ``key: checkpoint's -> this run's`` (nested keys dotted)."""
    def flat(d: dict, pre: str = "") -> dict:
        out = {}
        for k, v in d.items():
            if not pre and k in RESUMABLE:
                continue
            if isinstance(v, dict):
                out.update(flat(v, f"{pre}{k}."))
            else:
                out[f"{pre}{k}"] = v
        return out

    added = {k: v for k, v in ADDED_KEYS.items() if k in mine}  # keys this run's record has
    a, b = flat(mine), flat({**added, **theirs})
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if not diff:
        return None
    return ", ".join(f"{k}: {b.get(k)!r} -> {a.get(k)!r}" for k in diff)


def make_state(*, cfg: Any, step: int, rank: int, world_size: int, ep_size: int,
               model: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: list[dict],
               device: torch.device, grad_keys: dict | None = None,
               wire_keys: dict | None = None) -> dict[str, Any]:
    """What one rank's checkpoint holds after ``step`` completed steps (``grad_keys``: the
    compressed reduction's key counters, ``CompressedLauncher.state_dict``; ``wire_keys``:
    the 8-bit all-to-all's key streams, ``MoETransformerLM.wire_key_state``; both continued
    on resume)."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return {"format": FORMAT, "version": VERSION, "config": config_record(cfg), "step": int(step),
            "rank": int(rank), "world_size": int(world_size), "ep_size": int(ep_size),
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "rows": [dict(r) for r in rows], "rng": rng,
            # the gradient schedule's fallback probe (GradStep.probe_state): a resumed run
            # runs every step in the mode the interrupted one would have
            **({"probe": optimizer.probe_state()} if hasattr(optimizer, "probe_state") else {}),
            **({"grad_keys": grad_keys} if grad_keys is not None else {}),
            **({"wire_keys": wire_keys} if wire_keys else {})}


def write_tmp(path: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` beside ``path`` (``path.tmp``, flushed to the disk); :func:`commit`
    renames it. A full disk is one :class:`~commsched.results.OutputError` line naming the
    file, with nothing half-written left behind."""
    tmp = temp_path(path)
    save_torch(with_digests(state), tmp, what="checkpoint")
    return tmp


def temp_path(path: Path) -> Path:
    """Where :func:`write_tmp` writes ``path``'s next state (``checkpoint-rank{r}.pt.tmp``)."""
    return path.with_name(path.name + ".tmp")


def previous_path(path: Path) -> Path:
    """Where :func:`commit` keeps the last step's file until every rank has the new one."""
    return path.with_name(path.stem + ".prev" + path.suffix)


def commit(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` into place, keeping the file it replaces as :func:`previous_path`: a
    rank killed between its peers' renames and its own leaves a set that still resumes (the
    ranks ahead step back to their previous file, :func:`drop_previous` once all have
    renamed)."""
    if path.exists():
        os.replace(path, previous_path(path))
    os.replace(tmp, path)


def drop_previous(path: Path) -> None:
    """Every rank has renamed its new file: the previous step's goes."""
    try:
        previous_path(path).unlink()
    except FileNotFoundError:
        pass


def _load_failure(e: Exception) -> str:
    """What went wrong in ``torch.load``, in a few words. torch's advice to retry with
    ``weights_only=False`` is not passed on: that would run whatever the file holds."""
    text = str(e)
    if "Weights only load failed" in text:
        return ("not a torch file of tensors and plain values: damaged, or holding objects, "
                "which commsched never unpickles")
    first = text.splitlines()[0].strip() if text.strip() else ""
    return f"{type(e).__name__}: {first}" if first else f"{type(e).__name__}: truncated or damaged"


def read_state(path: Path, device: torch.device | str = "cpu", *, complete: bool = False) -> dict[str, Any]:
    """One rank's checkpoint; ValueError naming the file when it is missing, unreadable
    (truncated, garbage), not a commsched MoE training state, or damaged (a tensor whose
    digest does not match: the tensor is named). A file without digests (written by an
    earlier commsched) is returned unchecked (``DIGESTS`` absent), or, with ``complete``
    (a temporary file, which counts only when whole), refused."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--resume: no checkpoint at {p} (run with --checkpoint-every K first, "
                         "with the same --out and number of ranks)")
    try:
        st = torch.load(p, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a damaged file
        raise ValueError(f"--resume: cannot read the checkpoint {p} ({_load_failure(e)}); "
                         "delete the run folder's checkpoints and start again") from None
    if not isinstance(st, dict) or st.get("format") != FORMAT:
        raise ValueError(f"--resume: {p} is not a commsched MoE training checkpoint")
    if st.get("version") != VERSION:
        raise ValueError(f"--resume: {p} has version {st.get('version')!r}; this code reads {VERSION}")
    missing = [k for k in _KEYS if k not in st]
    if missing or not isinstance(st["step"], int) or not isinstance(st["config"], dict) \
            or not isinstance(st["rows"], list) or not isinstance(st["rng"], dict) or "cpu" not in st["rng"]:
        raise ValueError(f"--resume: {p} is an incomplete commsched MoE training checkpoint "
                         f"(missing or malformed: {', '.join(missing) or 'step, config, rows or rng'})")
    if not check_digests(st, p, "--resume: the checkpoint") and complete:
        raise ValueError(f"--resume: {p} carries no tensor digests, so it cannot be known to be whole")
    return st


def check_state(st: dict[str, Any], path: Path, *, cfg: Any, rank: int, world_size: int,
                ep_size: int) -> None:
    """ValueError when the checkpoint ``st`` (read from ``path``) cannot continue this run."""
    if st["world_size"] != world_size or st["rank"] != rank or st["ep_size"] != ep_size:
        raise ValueError(f"--resume: {path} was written by rank {st['rank']} of {st['world_size']} "
                         f"(expert-parallel size {st['ep_size']}); this is rank {rank} of {world_size} "
                         f"(expert-parallel size {ep_size}): resume with the same ranks")
    diff = config_mismatch(config_record(cfg), st["config"])
    if diff:
        raise ValueError(f"--resume: {path} was written by a run with a different configuration ({diff})")
    if st["step"] > cfg.steps:
        raise ValueError(f"--resume: {path} is at step {st['step']}, past --steps {cfg.steps}")


def restore_rng(st: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(st["rng"]["cpu"].cpu())
    if device.type == "cuda" and "cuda" in st["rng"]:
        torch.cuda.set_rng_state(st["rng"]["cuda"].cpu(), device)


__all__ = ["DIGESTS", "FORMAT", "RESUMABLE", "VERSION", "check_state", "checkpoint_path", "commit",
           "config_mismatch", "config_record", "drop_previous", "make_state", "previous_path", "read_state",
           "restore_rng", "temp_path", "write_tmp"]
