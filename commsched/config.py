"""Environment variables, read in this one place.

| variable                | meaning                                             | default |
|-------------------------|-----------------------------------------------------|---------|
| COMMSCHED_TIMEOUT_S     | timeout of every collective, seconds                | 120     |
| COMMSCHED_BACKEND       | force a torch.distributed backend (gloo, nccl)      | auto    |
| COMMSCHED_PROGRESS      | 0 disables progress bars                            | 1       |
| COMMSCHED_COMPILE       | 0: the quantization codec never calls torch.compile (its eager twin runs: same bits, slower; also `AdaQPConfig(compile=False)`, `--no-compile`) | 1 |
| COMMSCHED_CACHE_DIR     | where the native CPU codec kernel is built and kept (once per machine) | `$XDG_CACHE_HOME/commsched` or `~/.cache/commsched` |
| COMMSCHED_DATA          | the default `--data-root`: where named data sets are looked for and downloaded to | `$XDG_CACHE_HOME/commsched/data` or `~/.cache/commsched/data` |
| CC                      | the C compiler that builds the native CPU codec kernel (a name on PATH or a path) | `cc`, `gcc` or `clang`, the first found |
| GLOO_SOCKET_IFNAME      | gloo's interfaces, comma-separated (torch reads it too) | auto |
| RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK / MASTER_ADDR / MASTER_PORT | set by torchrun (GROUP_RANK: the node's index) | |
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class EnvConfig:
    timeout_s: float
    backend: str | None
    progress: bool
    rank: int | None
    world_size: int | None
    local_rank: int | None
    local_world_size: int | None = None
    gloo_ifnames: tuple[str, ...] = ()
    compile: bool = True
    group_rank: int | None = None  # torchrun's node index (GROUP_RANK)
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "commsched")
    data_root: Path = field(default_factory=lambda: Path.home() / ".cache" / "commsched" / "data")
    cc: str | None = None  # CC: the C compiler of the native CPU codec kernel (None: search)


def read_env(environ: dict[str, str] | None = None) -> EnvConfig:
    """Read every environment variable commsched uses (pass ``environ`` to test)."""
    env = os.environ if environ is None else environ

    def _int(name: str) -> int | None:
        v = env.get(name)
        if v is None or v == "":
            return None
        try:
            return int(v)
        except ValueError:
            raise ValueError(f"environment variable {name}={v!r} is not an integer") from None

    def _flag(name: str, default: bool) -> bool:
        v = env.get(name, "").strip().lower()
        if v == "":
            return default
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"environment variable {name}={env[name]!r}: expected 0 or 1")

    raw_t = env.get("COMMSCHED_TIMEOUT_S", "")
    try:
        timeout_s = float(raw_t) if raw_t else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"COMMSCHED_TIMEOUT_S={raw_t!r} is not a number of seconds") from None
    if not timeout_s > 0:
        raise ValueError(f"COMMSCHED_TIMEOUT_S must be > 0, got {timeout_s}")
    backend = env.get("COMMSCHED_BACKEND") or None
    if backend is not None and backend not in ("gloo", "nccl", "mpi"):
        raise ValueError(f"COMMSCHED_BACKEND={backend!r}: expected gloo, nccl or mpi")
    xdg = env.get("XDG_CACHE_HOME") or ""
    user_cache = Path(xdg) / "commsched" if xdg else Path.home() / ".cache" / "commsched"
    cache = env.get("COMMSCHED_CACHE_DIR") or str(user_cache)
    data_root = env.get("COMMSCHED_DATA") or str(user_cache / "data")
    return EnvConfig(
        timeout_s=timeout_s,
        backend=backend,
        progress=env.get("COMMSCHED_PROGRESS", "1") not in ("0", "false", "no"),
        rank=_int("RANK"),
        world_size=_int("WORLD_SIZE"),
        local_rank=_int("LOCAL_RANK"),
        local_world_size=_int("LOCAL_WORLD_SIZE"),
        gloo_ifnames=tuple(i for i in env.get("GLOO_SOCKET_IFNAME", "").split(",") if i),
        compile=_flag("COMMSCHED_COMPILE", True),
        group_rank=_int("GROUP_RANK"),
        cache_dir=Path(cache).expanduser(),
        data_root=Path(data_root).expanduser(),
        cc=env.get("CC") or None,
    )
