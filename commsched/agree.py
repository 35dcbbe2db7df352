"""Cross-rank agreement: checks that every rank of a group was given the same thing
(a configuration, a few small values, replicated tensors), each stopping every rank with
the same ValueError that names what differs, instead of a hang or a backend abort later.

:func:`check_same_config` (a run's configuration, by digest, the user's own flags named
first), :func:`check_same_values` (ints, bools and dtypes handed to one collective),
:func:`check_replicas` (digests of replicated tensors); :func:`config_differences` and
:func:`mismatch_message` are the pure parts, tested without a process group.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .dist import all_gather_object, comm_guard, control_device


def config_digest(config: Any) -> str:
    """Stable digest of a config (dataclass, dict or any JSON-able value)."""
    blob = json.dumps(_as_dict(config), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def config_differences(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """The leaves where two configs differ, as (dotted key, value in a, value in b), in
    key order; nested dataclasses and dicts are walked (``adaqp.lam``). Pure."""
    a, b = _as_dict(a), _as_dict(b)
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[tuple[str, Any, Any]] = []
        for k in sorted(set(a) | set(b), key=str):
            key = f"{prefix}.{k}" if prefix else str(k)
            if k not in a or k not in b:
                out.append((key, a.get(k, "<missing>"), b.get(k, "<missing>")))
            else:
                out.extend(config_differences(a[k], b[k], key))
        return out
    same = json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)
    return [] if same else [(prefix or "<value>", a, b)]


def check_same_config(config: Any, group=None, what: str = "configuration", *,
                      flags: Any = None) -> None:
    """Stop every rank with one clear error when ranks were started with different configs.

    All ranks take part; those that differ from rank 0 are named, with the first differing
    keys (dotted for nested ones, e.g. ``adaqp.lam``). ``flags``: the command line the rank
    was started with (``{"--mode": "adaqp", ...}``, :func:`commsched.configurable.flag_values`);
    the flags that differ are named first, before the settings derived from them. Raises the
    same ValueError on every rank.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    digest = config_digest(config)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    with comm_guard(f"comparing the {what} across ranks", group):
        dist.all_gather_object(gathered, (digest, config if isinstance(_as_dict(config), dict) else None, flags),
                               group=group)
    ref = gathered[0][0]
    bad = [r for r, (d, _, _) in enumerate(gathered) if d != ref]
    if bad:
        b = bad[0]
        raise ValueError(mismatch_message(what, bad, gathered[0][1], gathered[b][1],
                                          gathered[0][2], gathered[b][2]))


def mismatch_message(what: str, bad: Sequence[int], config0: Any, config_b: Any,
                     flags0: Any = None, flags_b: Any = None, *, shown: int = 3) -> str:
    """The error of :func:`check_same_config` (pure): ranks ``bad`` differ from rank 0; the
    differing flags first (all of them), then at most ``shown`` differing settings."""
    b = bad[0]

    def listed(diffs: list[tuple[str, Any, Any]]) -> str:
        return ", ".join(f"{k}: rank 0 has {v0!r}, rank {b} has {vb!r}" for k, v0, vb in diffs)

    detail = ""
    if flags0 is not None and flags_b is not None:
        fd = config_differences(flags0, flags_b)
        if fd:
            detail += "; differing flags: " + listed(fd)
    if config0 is not None and config_b is not None:
        diffs = config_differences(config0, config_b)
        if diffs:
            more = f" (and {len(diffs) - shown} more)" if len(diffs) > shown else ""
            label = "differing settings" if detail else "differing"
            detail += f"; {label}: " + listed(diffs[:shown]) + more
    return (f"ranks {list(bad)} were started with a {what} different from rank 0's{detail}. "
            "Start every rank with the same arguments.")


def check_replicas(digests: dict[str, int], what: str, *, key: Any = None, group=None) -> None:
    """Stop every rank with the same ValueError when ranks that hold replicas of the same
    tensors disagree (collective): every rank gives the digests of its replicated tensors
    by name (:func:`commsched.results.tensor_digest`, an int64 each); ranks giving the same
    ``key`` (default: all) must match, the first tensor that differs is named with the two
    ranks (``WHAT: tensor NAME differs between rank 0 and rank 1``)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    got = all_gather_object((key, list(digests.items())), f"comparing the {what} across ranks", group)
    for r, (k, items) in enumerate(got):
        first = next(i for i, (k2, _) in enumerate(got) if k2 == k)
        ref = dict(got[first][1])
        bad = next((name for name, d in items if ref.get(name) != d), None)
        if bad is None and len(ref) != len(items):
            bad = next(name for name in ref if name not in dict(items))
        if bad is not None:
            raise ValueError(f"{what}: tensor {bad} differs between rank {first} and rank {r}")


# dtype codes for headers that ranks all-gather to check they agree (0: none given)
DTYPE_CODES = {
    torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4,
    torch.uint8: 5, torch.int8: 6, torch.int16: 7, torch.int32: 8, torch.int64: 9,
    torch.bool: 10,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def check_same_values(values: dict[str, Any], group=None, what: str = "arguments") -> None:
    """Stop every rank with the same ValueError when ranks pass different small values
    (ints, bools, dtypes) to a collective, before its backend sees sizes that do not match.

    One all_gather of ``len(values)`` int64 on the group's control device (a host read of
    the result); the message names each differing value with every rank's."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    P = dist.get_world_size(group)
    codes = [DTYPE_CODES.get(v, -1) if isinstance(v, torch.dtype) else int(v) for v in values.values()]
    mine = torch.tensor(codes, dtype=torch.int64, device=control_device(group))
    allv = [torch.empty_like(mine) for _ in range(P)]
    with comm_guard(f"comparing the {what} across ranks", group):
        dist.all_gather(allv, mine, group=group)
    M = torch.stack(allv).cpu().tolist()  # [P, V]
    diffs = []
    for i, (name, v) in enumerate(values.items()):
        if len({M[r][i] for r in range(P)}) > 1:
            show = (lambda c: str(CODE_DTYPES.get(c, "?"))) if isinstance(v, torch.dtype) else \
                (lambda c: str(bool(c))) if isinstance(v, bool) else str
            diffs.append(f"{name}: " + ", ".join(f"rank {r} has {show(M[r][i])}" for r in range(P)))
    if diffs:
        raise ValueError(f"{what}: the ranks disagree ({'; '.join(diffs)}); every rank must pass the same")


def _as_dict(config: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return config
