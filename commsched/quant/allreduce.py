"""A compressed sum over ranks: reduce-scatter and all-gather of the shared codec's row records.

Legend: n values in the flat tensor, P ranks, F values per row, R rows after padding
(a multiple of P), C = R / P rows per owner chunk, W bytes of one row record.

``quantized_all_reduce(flat, bits)`` sums a flat floating-point tensor over the ranks of
a group, as ``dist.all_reduce`` does, in fewer bytes:

1. *Reduce-scatter.* The tensor, zero-padded to R rows of F values, is cut into P chunks
   of C rows; chunk p is owned by rank p. Each rank encodes its rows as row records
   (:func:`commsched.quant.codec.encode_records`: per row a ``bits``-bit stochastic
   payload and a float32 scale and zero point) and sends chunk p to rank p in one
   ``all_to_all_single``. The owner decodes what its peers sent and adds it, in float32,
   to its own chunk, which never left the rank and stays exact.
2. *All-gather.* The owner encodes its summed chunk once and every rank receives those
   same bytes (``all_gather``) and decodes them, the owner included, so every replica
   holds bit-identical sums: data-parallel parameters stay in step.

Each rank sends ``2 (P - 1) C W`` bytes, the byte count of a ring allreduce's two phases
at ``W / (4 F)`` of float32's width (264 / 1024 at 8 bits with F = 256). The result is
unbiased (both quantizations are stochastic with independent keys; E[sum'] = sum) and
each summed value is off by at most the level steps of the P - 1 peers' rows it came in
plus one level step of the summed row (a level step: (max - min) / (2^bits - 1) of its
row). ``bits=16`` sends the
rows as bfloat16 (round to nearest even, relative error <= 2^-8) and sums in float32;
``bits=32`` is ``dist.all_reduce`` itself, exact.

Keys: the caller's ``seed`` (an int, for example from the training seed and the step) is
hashed with the rank and the phase into the codec's 32-bit message keys, so no two ranks
or steps share random bits and the same seed replays the same bytes. The keys are host
ints: encoding never reads the device.

The same code runs on gloo (CPU tensors) and NCCL (CUDA tensors): both take uint8
``all_to_all_single`` and the list form of ``all_gather``.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from .codec import IMPLS, decode_records, encode_records
from .rowwire import format_seed
from .wire import BITS, record_bytes

GRAD_BITS = (32, 16, 8, 4, 2)  # the widths quantized_all_reduce takes (32: exact)
ROW_VALUES = 256  # F: values per row record (one scale and zero point per 256 values)
_PHASE_SCATTER, _PHASE_GATHER = 1, 2


def check_grad_bits(bits, what: str = "bits") -> int:
    """``bits`` as an int if it is one of :data:`GRAD_BITS`, else a ValueError naming them."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in GRAD_BITS:
        raise ValueError(f"{what} must be one of {', '.join(map(str, GRAD_BITS))} (32: exact "
                         f"float32 allreduce, 16: bfloat16 wire, 8/4/2: the codec's stochastic "
                         f"row records), got {bits!r}")
    return int(bits)


def wire_bytes(numel: int, world: int, bits: int, row_values: int = ROW_VALUES) -> int:
    """Bytes one rank sends for a sum of ``numel`` values over ``world`` ranks at ``bits``
    (both phases; at 32 bits those of a ring allreduce of float32). Pure."""
    bits = check_grad_bits(bits)
    if world <= 1 or numel <= 0:
        return 0
    if bits == 32:
        return 2 * (world - 1) * -(-numel // world) * 4
    rows = -(-numel // row_values)
    chunk = -(-rows // world)
    per_row = row_values * 2 if bits == 16 else record_bytes(row_values, bits)
    return 2 * (world - 1) * chunk * per_row


def _encode(x_RF: torch.Tensor, bits: int, key: int, impl: str) -> torch.Tensor:
    """uint8 [R, W] of float rows at ``bits`` (16: bfloat16 bytes)."""
    if bits == 16:
        return x_RF.to(torch.bfloat16).contiguous().view(torch.uint8)
    return encode_records(x_RF, bits, key, impl=impl)


def _decode(w_RW: torch.Tensor, bits: int, F: int, impl: str) -> torch.Tensor:
    """float32 [R, F] from the bytes of :func:`_encode`."""
    if bits == 16:
        return w_RW.contiguous().view(torch.bfloat16).float()
    return decode_records(w_RW, bits, F, impl=impl)


def quantized_all_reduce(flat: torch.Tensor, bits: int = 8, *, group=None, seed: int = 0,
                         row_values: int = ROW_VALUES, impl: str = "auto") -> torch.Tensor:
    """Sum the 1-D floating-point tensor ``flat`` over the ranks of ``group`` in place, its
    messages at ``bits`` (one of :data:`GRAD_BITS`; module docstring), and return it.

    Collective: every rank calls it with a tensor of the same numel, dtype and ``bits``.
    ``seed`` keys the stochastic rounding (vary it per call, e.g. with the step).
    ``row_values``: values per row record (one scale per row; smaller rows follow the
    values more closely and cost 8 bytes each). On one rank (or without a process group)
    the tensor is returned as it is. Raises ValueError for a bad ``bits``, ``impl``,
    ``row_values`` or a tensor that is not 1-D floating point."""
    bits = check_grad_bits(bits)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if isinstance(row_values, bool) or not isinstance(row_values, int) or row_values < 1:
        raise ValueError(f"row_values must be an int >= 1, got {row_values!r}")
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.dtype.is_floating_point:
        raise ValueError(f"flat must be a 1-D floating-point tensor, got "
                         f"{getattr(flat, 'dtype', type(flat).__name__)} {tuple(getattr(flat, 'shape', ()))}")
    if not (dist.is_available() and dist.is_initialized()):
        return flat
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    n = flat.numel()
    if P == 1 or n == 0:
        return flat
    if bits == 32:
        dist.all_reduce(flat, group=group)
        return flat
    assert bits == 16 or bits in BITS
    F = int(row_values)
    rows = -(-n // F)
    C = -(-rows // P)  # rows per owner chunk
    R = C * P
    x = torch.zeros(R * F, dtype=torch.float32, device=flat.device)
    x[:n] = flat
    x_RF = x.view(R, F)
    # 1. reduce-scatter: chunk p of every rank's rows goes to rank p as row records
    send = _encode(x_RF, bits, format_seed(seed, rank, _PHASE_SCATTER), impl)
    Wb = send.shape[1]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.view(-1), send.view(-1), group=group)
    got = _decode(recv, bits, F, impl).view(P, C, F)
    mine = x_RF[rank * C:(rank + 1) * C]
    # the own chunk stays exact; the peers' decoded chunks are added in rank order
    total = mine.clone()
    for p in range(P):
        if p != rank:
            total += got[p]
    # 2. all-gather: the owner's summed chunk, encoded once; every rank decodes those bytes
    sent = _encode(total, bits, format_seed(seed, rank, _PHASE_GATHER), impl)
    parts = [torch.empty((C, Wb), dtype=torch.uint8, device=flat.device) for _ in range(P)]
    dist.all_gather(parts, sent.contiguous(), group=group)
    out = _decode(torch.cat(parts), bits, F, impl).view(-1)
    flat.copy_(out[:n])
    return flat


class _CompressedWork:
    """The Work of one :class:`CompressedLauncher` launch: ``wait()`` (raises the sum's
    error; on CUDA the caller's stream then waits for the worker's), ``is_completed()``,
    ``get_future()`` (completes, with the flat tensor, when the sum is done)."""

    def __init__(self, fut: torch.futures.Future, event=None):
        self._fut, self.event = fut, event

    def wait(self, timeout=None) -> bool:
        self._fut.wait()  # raises the worker's error
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def get_future(self) -> torch.futures.Future:
        return self._fut


class CompressedLauncher:
    """A launcher for :class:`commsched.priority.executor.GradScheduler` (``launch=``) that
    sums each launched operation with :func:`quantized_all_reduce` at ``bits``.

    The two phases of a compressed sum need the decoded bytes of the first before the second
    can start, so a launch cannot be one backend call: each launch is queued to one worker
    thread that runs the sums one after another, in launch order. The scheduler launches in
    its policy's order, the same on every rank, so every group sees its collectives in the
    same order everywhere (the worker must be the only user of the scheduler's groups while
    a step reduces, as the scheduler's own groups are). On CUDA the worker waits for an event
    recorded on the launching stream, runs on a stream of its own and records an event that
    the Work's ``wait()`` makes the caller's stream wait for. ``seed`` keys the rounding: a
    launch of the scheduler's operation ``op`` (the scheduler passes it: ``takes_op``) takes
    the key of (``seed``, ``op``, how many times ``op`` was launched before), so the bits of a
    run do not depend on the order the operations happen to be launched in (a schedule's
    mode may change it); a launch without ``op`` takes the next key of its own count.
    :meth:`state_dict` / :meth:`load_state_dict` carry those counts through a checkpoint.
    ``close()`` stops the worker (also at exit: a daemon)."""

    takes_op = True

    def __init__(self, bits: int = 8, *, seed: int = 0, impl: str = "auto",
                 row_values: int = ROW_VALUES):
        self.bits = check_grad_bits(bits)
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
        self.impl, self.row_values, self.seed = impl, int(row_values), int(seed)
        self.launches = 0  # launches without an operation number
        self.op_launches: dict[int, int] = {}  # per operation number: launches so far
        self._q: queue.Queue = queue.Queue()
        self._stream = None
        self._thread = threading.Thread(target=self._run, name="commsched-compressed-allreduce", daemon=True)
        self._thread.start()

    def __call__(self, flat: torch.Tensor, group, op: int | None = None) -> _CompressedWork:
        if self._thread is None:
            raise RuntimeError("CompressedLauncher is closed")
        fut: torch.futures.Future = torch.futures.Future()
        ready = done = None
        if flat.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()  # the launching stream: the flat gradient is written there
            done = torch.cuda.Event()
        if op is None:
            key = format_seed(self.seed, self.launches)
            self.launches += 1
        else:
            n = self.op_launches.get(int(op), 0)
            key = format_seed(self.seed, 1 << 20, int(op), n)
            self.op_launches[int(op)] = n + 1
        self._q.put((flat, group, key, ready, done, fut))
        return _CompressedWork(fut, done)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            flat, group, key, ready, done, fut = job
            try:
                if ready is not None:
                    if self._stream is None:
                        torch.cuda.set_device(flat.device)
                        self._stream = torch.cuda.Stream(flat.device)
                    with torch.cuda.stream(self._stream):
                        self._stream.wait_event(ready)
                        flat.record_stream(self._stream)  # the allocator keeps it until the sum ran
                        quantized_all_reduce(flat, self.bits, group=group, seed=key,
                                             row_values=self.row_values, impl=self.impl)
                        done.record(self._stream)
                else:
                    quantized_all_reduce(flat, self.bits, group=group, seed=key,
                                         row_values=self.row_values, impl=self.impl)
            except BaseException as e:  # the scheduler sees it at the Work
                fut.set_exception(e)
            else:
                fut.set_result(flat)

    def state_dict(self) -> dict:
        """The key counters (JSON-able): what a checkpoint needs for a resumed run to round
        as the uninterrupted one."""
        return {"launches": int(self.launches),
                "op_launches": {str(k): int(v) for k, v in self.op_launches.items()}}

    def load_state_dict(self, st: dict) -> None:
        """Continue the key counters of :meth:`state_dict` (ValueError for a damaged state)."""
        try:
            launches = int(st["launches"])
            ops = {int(k): int(v) for k, v in dict(st["op_launches"]).items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"the compressed reduction's key state is damaged ({type(e).__name__}: {e}); "
                             "expected {'launches': int, 'op_launches': {op: int}}") from None
        self.launches, self.op_launches = launches, ops

    def close(self) -> None:
        """Stop the worker once the queued sums are done."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "CompressedLauncher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["GRAD_BITS", "ROW_VALUES", "CompressedLauncher", "check_grad_bits", "quantized_all_reduce",
           "wire_bytes"]
