"""What every run writes and shows: one median, one JSON writer, one progress bar, and the
base of the typed metrics records.

Front-ends describe their ``metrics.json`` as a frozen dataclass deriving from
:class:`Record`; ``Record.write`` puts it on disk with :func:`write_json`. No
``torch.distributed`` here: these are plain helpers, importable without torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping


def median(xs: Iterable[float | int | None]) -> float | None:
    """The median of the finite numbers in ``xs`` (``None`` and NaN skipped); None when empty."""
    vals = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(statistics.median(vals)) if vals else None


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically (a temporary file renamed into place), so
    a killed run never leaves half a file; parent folders are made. Dataclasses are written
    as their fields; other unknown values as ``str``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(_plain(obj), indent=indent, default=str))
    os.replace(tmp, path)
    return path


def _plain(obj: Any) -> Any:
    if isinstance(obj, Record):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


@dataclasses.dataclass(frozen=True)
class Record:
    """Base of a run's metrics record: the documented ``metrics.json`` fields as typed
    attributes, plus ``extra`` for the workload-specific rest (merged into the file's top
    level). ``to_dict()`` is what ``metrics.json`` holds."""

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        extra = d.pop("extra", None) or {}
        clash = sorted(set(extra) & set(d))
        if clash:
            raise ValueError(f"{type(self).__name__}: extra fields {clash} shadow documented fields")
        return {**json.loads(json.dumps(d, default=str)), **extra}

    def write(self, path: str | os.PathLike, *, indent: int | None = 2) -> Path:
        return write_json(path, self.to_dict(), indent=indent)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "extra")


class Progress:
    """A tqdm bar on stderr, or nothing when ``enabled`` is false (COMMSCHED_PROGRESS=0, a
    rank other than 0). ``update``, ``postfix``, ``write`` and ``close`` are safe either way;
    ``write`` still reaches the user when the bar is off (through ``say``, default a line on
    stderr). Use as a context manager to close it."""

    def __init__(self, total: int, desc: str, unit: str, *, enabled: bool = True,
                 initial: int = 0, say: Callable[[str], None] | None = None):
        self.bar = None
        self.say = say or (lambda s: print(s, file=sys.stderr, flush=True))
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr,
                            dynamic_ncols=True, leave=True)

    @property
    def active(self) -> bool:
        """Whether a bar is shown."""
        return self.bar is not None

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def postfix(self, text: str | None = None, **values: Any) -> None:
        if self.bar is None:
            return
        if text is not None:
            self.bar.set_postfix_str(text)
        else:
            self.bar.set_postfix(**values)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            self.say(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pick(d: Mapping[str, Any], dotted: str) -> Any:
    """``d["a"]["b"]`` for ``"a.b"``; None when a key is missing."""
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


__all__ = ["Progress", "Record", "median", "pick", "write_json"]
