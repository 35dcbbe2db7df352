"""Byte-level text for the MoE language model.

Legend: B batch, S sequence length, N corpus bytes.

The default corpus is the Python standard library's own ``.py`` source files (found with
``sysconfig``, so it is present on every machine that runs this code); ``path`` reads any
text file instead. The last ``val_fraction`` of the bytes is held out. Batches are random
windows drawn from a generator seeded by (seed, step, rank), so a run is reproducible and
two runs with the same seed see the same tokens whatever their schedule.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from ...results import read_error

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "idlelib", "lib2to3"}


def stdlib_dir() -> Path:
    d = sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__)
    return Path(d)


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted (installed packages excluded)."""
    root = root or stdlib_dir()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return out


@dataclass(frozen=True)
class Corpus:
    """Training and held-out bytes (uint8 tensors) and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    source: str

    def batch(self, batch_size: int, seq_len: int, *, seed: int, step: int, rank: int,
              split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [B, S] each: random windows and the same shifted by one."""
        data = self.train if split == "train" else self.val
        if data.numel() < seq_len + 2:
            raise ValueError(f"the {split} split has {data.numel()} bytes, too few for windows of {seq_len + 1}")
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1009 + rank + (0 if split == "train" else 7))
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=g)
        idx = starts.unsqueeze(1) + torch.arange(seq_len + 1)
        w = data[idx].long()
        return w[:, :-1], w[:, 1:]


def load_corpus(path: str | Path | None = None, *, max_bytes: int | None = 8 << 20,
                val_fraction: float = 0.05) -> Corpus:
    """Read ``path`` (any text file), or the standard library's sources when None."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--corpus {p}: " + ("a folder, not a text file" if p.is_dir() else "no such file"))
        try:
            with open(p, "rb") as f:
                blob = f.read(max_bytes) if max_bytes else f.read()
        except OSError as e:
            raise ValueError(f"--corpus {p}: cannot be read ({read_error(e)})") from None
        source = str(p)
    else:
        files = stdlib_sources()
        if not files:
            raise ValueError(f"found no .py files under {stdlib_dir()}; pass --corpus FILE")
        parts, total = [], 0
        for f in files:
            try:
                b = f.read_bytes()
            except OSError:
                continue
            parts.append(b)
            total += len(b)
            if max_bytes and total >= max_bytes:
                break
        blob = b"".join(parts)[:max_bytes] if max_bytes else b"".join(parts)
        source = f"python stdlib sources under {stdlib_dir()} ({len(parts)} files)"
    if len(blob) < 1024:
        raise ValueError(f"corpus {source} has only {len(blob)} bytes; need at least 1024")
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    cut = int(len(data) * (1 - val_fraction))
    return Corpus(train=data[:cut], val=data[cut:], source=source)


__all__ = ["Corpus", "load_corpus", "stdlib_dir", "stdlib_sources"]
