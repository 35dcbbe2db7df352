"""The GPU check's two sections at world size 1, each in a child process on a one-rank group
(NCCL with ``device_id`` on CUDA, gloo on the CPU), past commsched's one-rank shortcuts:
``nccl`` calls the backend itself (:func:`check_nccl`), ``paths`` runs the new paths
(:data:`PATH_CHECKS`, :func:`check_paths`). :mod:`commsched.bench.gpucheck` runs them.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from typing import Any

import torch


def _child(work, init_file: str, device_name: str, args: tuple, q) -> None:
    """In the child: a one-rank default group on ``device_name`` (NCCL bound to the device,
    an eager communicator: a bad device fails here, not later, on CUDA; gloo on the CPU),
    then ``work(dev, *args)``; puts ("ok", its result) or ("err", the traceback)."""
    try:
        import torch.distributed as dist

        from ..dist import prepare_process_group_import

        prepare_process_group_import()
        dev = torch.device(device_name)
        kw: dict[str, Any] = {}
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            kw["device_id"] = dev
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"file://{init_file}",
                                rank=0, world_size=1, timeout=datetime.timedelta(seconds=60), **kw)
        res = work(dev, *args)
        dist.destroy_process_group()
        q.put(("ok", res))
    except BaseException:
        q.put(("err", traceback.format_exc()))


def _in_child(work, device: torch.device, timeout_s: float, *args) -> tuple[Any, dict | None]:
    """``work(dev, *args)`` in a spawned child (:func:`_child`): (its result, None), or (None,
    the section's failed result) when it raised or ran past ``timeout_s`` (then it is killed)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        p = ctx.Process(target=_child, args=(work, os.path.join(d, "rdzv"), str(device), args, q))
        p.start()
        try:
            status, res = q.get(timeout=timeout_s)
        except Exception:
            status, res = "hang", None
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    if status == "hang":
        return None, {"status": "failed", "error": f"ran past its budget of {timeout_s:.0f} s (a hang?)"}
    if status == "err":
        return None, {"status": "failed", "error": res.strip().splitlines()[-1], "traceback": res}
    return res, None


# --------------------------------------------------------------------------- NCCL at world size 1
def _nccl_checks(dev: torch.device) -> tuple[dict[str, bool], dict[str, str]]:
    """torch.distributed's own calls on the one-rank group (NCCL on CUDA, gloo on the CPU),
    bypassing commsched's one-rank shortcuts: ({check: bool}, {check skipped: reason})."""
    import torch.distributed as dist

    from ..clock import Clock

    backend = "nccl" if dev.type == "cuda" else "gloo"
    res: dict[str, bool] = {}
    skipped: dict[str, str] = {}
    clock = Clock(dev)
    # all_reduce, asynchronous: Work.wait(), then is_completed() once the device is idle
    t = torch.arange(1000, dtype=torch.float32, device=dev)
    a = clock.mark()
    w = dist.all_reduce(t, async_op=True)
    w.wait()  # NCCL: the current stream waits for it
    b = clock.mark()
    res["all_reduce"] = bool(torch.equal(t.cpu(), torch.arange(1000, dtype=torch.float32)))
    clock.sync()
    res["work_is_completed"] = bool(w.is_completed())
    res["event_timing"] = clock.seconds(a, b) >= 0.0
    # all_to_all_single with explicit split sizes (one rank: one split of 7 rows)
    x = torch.arange(21, dtype=torch.float32, device=dev).reshape(7, 3)
    y = torch.empty_like(x)
    w = dist.all_to_all_single(y, x, [7], [7], async_op=True)
    w.wait()
    res["all_to_all_single_splits"] = bool(torch.equal(y.cpu(), x.cpu()))
    # batch_isend_irecv to itself (the ring pattern's call)
    sb, rb = torch.full((5,), 3.0, device=dev), torch.zeros(5, device=dev)
    try:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sb, 0), dist.P2POp(dist.irecv, rb, 0)])
        for w in works:
            w.wait()
        res["batch_isend_irecv"] = bool(torch.equal(rb.cpu(), sb.cpu()))
    except RuntimeError as e:
        if backend != "gloo":
            raise
        skipped["batch_isend_irecv"] = f"gloo cannot send to its own rank ({str(e).splitlines()[0][:80]})"
    # a reduce-scatter and an all-gather into tensors (the hierarchical reduction's phases)
    src = torch.arange(6, dtype=torch.float32, device=dev)
    out = torch.empty(6, device=dev)
    try:
        dist.reduce_scatter_tensor(out, src, async_op=True).wait()
        res["reduce_scatter_tensor"] = bool(torch.equal(out.cpu(), src.cpu()))
    except (RuntimeError, ValueError) as e:
        if backend != "gloo":
            raise
        skipped["reduce_scatter_tensor"] = f"not on gloo ({str(e).splitlines()[0][:80]})"
    g = torch.empty(6, device=dev)
    dist.all_gather_into_tensor(g, src, async_op=True).wait()
    res["all_gather_into_tensor"] = bool(torch.equal(g.cpu(), src.cpu()))
    return res, skipped


def check_nccl(device: torch.device, timeout_s: float = 60) -> dict:
    """At world size 1 commsched's exchanges short-circuit, so this section calls the backend
    directly in a child process (NCCL on CUDA; gloo on the CPU, where the calls gloo lacks are
    skipped, each named): all_reduce, all_to_all_single with split sizes, batch_isend_irecv,
    reduce_scatter / all_gather into tensors, Work.wait / is_completed, event timing. A hang
    ends at ``timeout_s`` with the child killed."""
    got, failed = _in_child(_nccl_checks, device, timeout_s)
    if failed:
        return failed
    res, skipped = got
    out: dict[str, Any] = {"backend": "nccl" if device.type == "cuda" else "gloo", "checks": res}
    if skipped:
        out["skipped"] = skipped
    out["status"] = "ok" if all(res.values()) else "failed"
    return out


# --------------------------------------------------------------------------- new paths at world size 1
RECORD_WIDTHS = (1, 7, 33, 127, 300)  # irregular row widths of the row-record check
PATH_CHECKS = ("records", "allreduce_wire", "launcher", "a2a_q8", "ddp")


def _fast_impl(dev: torch.device) -> str:
    """The codec implementation a job runs on ``dev``: Triton on CUDA, ``auto`` on the CPU."""
    return "triton" if dev.type == "cuda" else "auto"


def _path_records(dev: torch.device, ref_pg, quick: bool) -> dict:
    """Row records (``encode_records`` / ``decode_records``: payload row stride W = B + 8, the
    metadata inside the record) on the device against the torch reference on the CPU, bit
    for bit given the same keys, at irregular widths and every width of bits."""
    from ..quant.codec import decode_records, encode_records
    from ..quant.wire import BITS

    g = torch.Generator().manual_seed(5)
    impl, bad, n = _fast_impl(dev), [], 0
    for D in RECORD_WIDTHS[:3] if quick else RECORD_WIDTHS:
        x = torch.randn(37, D, generator=g) * 2 + 0.5
        for b in BITS:
            key = 1000 + 7 * D + b
            ref = encode_records(x, b, key, impl="reference")
            got = encode_records(x.to(dev), b, key, impl=impl)
            same_r = bool(torch.equal(got.cpu(), ref))
            same_d = bool(torch.equal(decode_records(got, b, D, impl=impl).cpu(),
                                      decode_records(ref, b, D, impl="reference")))
            n += 1
            if not (same_r and same_d):
                bad.append({"D": D, "bits": b, "records": same_r, "decoded": same_d})
    return {"ok": not bad, "impl": impl, "cases": n, "mismatches": bad}


def _path_allreduce_wire(dev: torch.device, ref_pg, quick: bool) -> dict:
    """``quantized_all_reduce`` on the one-rank group past its one-rank shortcut
    (``force_wire``): both phases' records, all_to_all_single and all_gather on the backend;
    bit for bit the torch reference's result (the same call on the CPU over gloo)."""
    from ..quant.allreduce import quantized_all_reduce

    x = torch.randn(5003, generator=torch.Generator().manual_seed(6))
    got = x.to(dev, copy=True)
    quantized_all_reduce(got, bits=8, group=None, seed=3, impl=_fast_impl(dev), force_wire=True)
    want = x.clone()
    quantized_all_reduce(want, bits=8, group=ref_pg, seed=3, impl="reference", force_wire=True)
    got = got.cpu()
    err = float((got - x).abs().max())
    bound = float(x.max() - x.min()) / 255 * 1.001  # one level step of the widest row
    return {"ok": bool(torch.equal(got, want)) and err <= bound and not torch.equal(got, x),
            "reference_equal": bool(torch.equal(got, want)), "max_error": err, "error_bound": bound}


class _TwoRanks:
    """A stand-in group of two ranks: the GradScheduler launches its operations (a one-rank
    group would make them local); :class:`_OnGroup` sends them to the real one-rank group."""

    def size(self) -> int:
        return 2


class _OnGroup:
    """A launcher that hands each launch to ``launcher`` on ``group`` instead of the stand-in."""

    takes_op = True

    def __init__(self, launcher, group):
        self.launcher, self.group = launcher, group

    def __call__(self, flat, group, op=None):
        return self.launcher(flat, self.group, op=op)


def _launcher_grads(dev: torch.device, group, impl: str) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    from ..priority.policy import LinaConfig
    from ..priority.runtime.executor import GradScheduler
    from ..quant.allreduce import CompressedLauncher

    params = [torch.nn.Parameter(torch.zeros(n, device=dev)) for n in (3000, 5, 700)]
    ws = [torch.randn(p.numel(), generator=torch.Generator().manual_seed(i)) for i, p in enumerate(params)]
    launcher = CompressedLauncher(8, seed=1, impl=impl, force_wire=True)
    try:
        with GradScheduler([(p, _TwoRanks(), 1.0) for p in params], LinaConfig(microop_bytes=4096),
                           device=dev, launch=_OnGroup(launcher, group)) as s:
            for _step in range(2):
                for p in params:
                    p.grad = None
                s.begin_step()
                sum((p * w.to(dev)).sum() for p, w in zip(params, ws)).backward()
                s.finish()
        return [p.grad.detach().cpu() for p in params], ws, launcher.summed
    finally:
        launcher.close()


def _path_launcher(dev: torch.device, ref_pg, quick: bool) -> dict:
    """``CompressedLauncher(force_wire=True)`` under the real GradScheduler and its executor
    (event completion, the side stream, ``record_stream`` on CUDA), two steps: the gradients
    are the reference's (the same launches on the CPU over gloo), bit for bit."""
    got, ws, summed = _launcher_grads(dev, None, _fast_impl(dev))
    want, _, _ = _launcher_grads(torch.device("cpu"), ref_pg, "reference")
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    close = all(float((a - w).abs().max()) <= float(w.max() - w.min()) / 255 * 1.001 for a, w in zip(got, ws))
    return {"ok": same and close and summed > 0, "reference_equal": same, "within_a_level": close,
            "launches_summed": summed}


def _path_a2a_q8(dev: torch.device, ref_pg, quick: bool) -> dict:
    """The 8-bit expert all-to-all as ``--a2a-bits 8`` builds it (``moe_wires``: 8-bit rows
    towards the experts, bfloat16 back; the backward pass the other way round), forward and
    backward on the one-rank group (it encodes and decodes before the one-rank copy): equal
    to the torch reference's encode / decode with the same keys."""
    from ..comm.all2all import all_to_all
    from ..moe.model.dispatch import moe_wires
    from ..quant.rowwire import QuantRows

    g = torch.Generator().manual_seed(9)
    x, gz = torch.randn(29, 3, 43, generator=g), torch.randn(29, 3, 43, generator=g)
    w = moe_wires(8, 77, impl=_fast_impl(dev))
    xd = x.to(dev, copy=True).requires_grad_()
    y = all_to_all(xd, [29], wire=w.dispatch)  # rows to the experts: 8 bits
    z = all_to_all(y, [29], wire=w.combine)  # back: bfloat16; its backward: 8 bits
    z.backward(gz.to(dev))
    ref = QuantRows(8, seed=77, impl="reference")  # its keys in the same order: forward, then backward
    want_y = ref.decode(ref.encode(x), x.shape[1:], torch.float32)
    want_z = want_y.bfloat16().float()
    want_gx = ref.decode(ref.encode(gz), gz.shape[1:], torch.float32).bfloat16().float()
    fwd = bool(torch.equal(z.detach().cpu(), want_z))
    bwd = bool(torch.equal(xd.grad.cpu(), want_gx))
    return {"ok": fwd and bwd, "forward_equal": fwd, "backward_equal": bwd}


def _path_ddp(dev: torch.device, ref_pg, quick: bool) -> dict:
    """A one-rank ``LinaDDP`` (``DistributedDataParallel`` with ``lina_hook``; DDP has no
    one-rank shortcut, so its reducer calls the hook, and on CUDA the hook's futures carry
    the device): two steps, the gradients equal the plain module's."""
    import copy

    from ..priority.ddp import LinaDDP
    from ..priority.policy import LinaConfig

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(dev)
    twin = copy.deepcopy(net)
    kw: dict[str, Any] = {"device_ids": [dev]} if dev.type == "cuda" else {}
    ddp = LinaDDP(net, schedule=LinaConfig(microop_bytes=256), bucket_cap_mb=0.001, **kw)
    err = 0.0
    try:
        for step in range(2):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(dev)
            net.zero_grad(set_to_none=True)
            twin.zero_grad(set_to_none=True)
            ddp(x).square().sum().backward()
            twin(x).square().sum().backward()
            err = max(err, max(float((a.grad - b.grad).abs().max()) for a, b in zip(net.parameters(),
                                                                                  twin.parameters())))
        stats = ddp.lina.last_stats is not None
    finally:
        ddp.close()
    return {"ok": err <= 1e-6 and stats, "max_error": err}


def _path_checks(dev: torch.device, quick: bool) -> dict:
    """The checks of :data:`PATH_CHECKS` on the one-rank group plus a gloo group of the same
    rank for the CPU reference; each reports on its own (one failing does not hide the others)."""
    import torch.distributed as dist

    ref_pg = dist.new_group([0], backend="gloo")  # the reference's CPU tensors
    fns = {"records": _path_records, "allreduce_wire": _path_allreduce_wire, "launcher": _path_launcher,
           "a2a_q8": _path_a2a_q8, "ddp": _path_ddp}
    res: dict[str, Any] = {}
    for name in PATH_CHECKS:
        t = time.perf_counter()
        try:
            r = fns[name](dev, ref_pg, quick)
            r["status"] = "ok" if r.pop("ok") else "failed"
        except Exception as e:  # this check fails; the next one runs
            r = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        r["seconds"] = time.perf_counter() - t
        res[name] = r
    return res


def check_paths(device: torch.device, quick: bool, timeout_s: float = 60) -> dict:
    """The new paths at world size 1, past commsched's one-rank shortcuts, in a child process
    (:data:`PATH_CHECKS`; :func:`_path_checks`): row records, the compressed allreduce and
    its launcher under the executor, the 8-bit all-to-all, LinaDDP. The same code runs on the
    CPU (``auto`` against ``reference``). A hang ends at ``timeout_s`` with the child killed."""
    res, failed_run = _in_child(_path_checks, device, timeout_s, quick)
    if failed_run:
        return failed_run
    failed = [k for k, v in res.items() if v["status"] != "ok"]
    out: dict[str, Any] = dict(res)
    if device.type != "cuda":
        out["skipped"] = {"cuda": "the same checks ran with the CPU's codec (auto) against the reference "
                          "over gloo; Triton, NCCL and the launcher's CUDA streams and events need a CUDA device"}
    out["status"] = "failed" if failed else "ok"
    if failed:
        out["error"] = "failed: " + ", ".join(f"{k} ({res[k].get('error', 'mismatch')})" for k in failed)
    return out
