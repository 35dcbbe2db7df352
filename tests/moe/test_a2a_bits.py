"""The quantized expert all-to-all (``--a2a-bits``, issue 29.3): the wire format of the
shared codec's row records, the exchange with a wire (forward and backward, plain and
pipelined MoE layer) on real gloo ranks, gradients through it, what the observer sees, and
the configuration's refusals."""

from __future__ import annotations

import pytest
import torch

from commsched.comm.all2all import BF16, A2APlan, CommStats, Wire, all_to_all, all_to_all_async
from commsched.comm.observe import A2ATimer
from commsched.moe.model.dispatch import A2A_BITS, ExpertGroup, moe_wires
from commsched.moe.model.layer import DispatchConfig, MoELayer
from commsched.moe.model.router import RouterConfig
from commsched.moe.train.training import TrainConfig, a2a_payload_bytes, a2a_row_bytes
from commsched.quant import reference as ref
from commsched.quant.codec import decode_records, encode_records
from commsched.quant.rowwire import QuantRows, format_seed
from commsched.quant.wire import META_BYTES, record_bytes
from tests.mp import assert_case, run_cases


def _bound(x_RD: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """The codec's bound per row: one level step (max - min) / (2^b - 1), with float32 slack."""
    x = x_RD.float().reshape(x_RD.shape[0], -1)
    step = (x.amax(1) - x.amin(1)) / ((1 << bits) - 1)
    return step * (1 + 1e-5) + 1e-6 * x.abs().amax(1).clamp_min(1.0)


# --------------------------------------------------------------------------- wire format (one process)
@pytest.mark.parametrize("N,D", [(1, 1), (5, 7), (33, 64), (64, 257)])
def test_records_are_the_codec_bit_for_bit(N, D):
    g = torch.Generator().manual_seed(N * 1000 + D)
    x = torch.randn(N, D, generator=g) * 3 + 1
    key = 0xC0FFEE + D
    rec = encode_records(x, 8, key)
    assert rec.dtype == torch.uint8 and tuple(rec.shape) == (N, record_bytes(D, 8)) == (N, D + META_BYTES)
    payload, meta = ref.quantize_reference(x, 8, key)
    assert torch.equal(rec[:, :D], payload)  # the payload first ...
    assert torch.equal(rec[:, D:].clone(memory_format=torch.contiguous_format).view(torch.float32), meta)  # ... then scale, zero point
    y = decode_records(rec, 8, D)
    assert torch.equal(y, ref.dequantize_reference(payload, meta, 8, D))
    assert ((y - x).abs().amax(1) <= _bound(x)).all()
    for impl in ("reference", "eager"):  # every implementation writes the same records
        assert torch.equal(encode_records(x, 8, key, impl=impl), rec), impl
        assert torch.equal(decode_records(rec, 8, D, impl=impl), y), impl


def test_records_at_other_widths_and_empty_and_constant_rows():
    x = torch.randn(6, 10)
    x[2] = 4.25  # a constant row decodes exactly
    for bits in (2, 4):
        rec = encode_records(x, bits, 7)
        assert rec.shape == (6, record_bytes(10, bits))
        y = decode_records(rec, bits, 10)
        assert ((y - x).abs().amax(1) <= _bound(x, bits)).all()
        assert torch.equal(y[2], x[2])
    assert encode_records(torch.zeros(0, 5), 8, 1).shape == (0, 13)
    assert decode_records(torch.zeros(0, 13, dtype=torch.uint8), 8, 5).shape == (0, 5)


def test_quant_rows_format_bound_unbiased_and_shapes():
    q = QuantRows(8, seed=5)
    assert q.name == "q8" and q.row_bytes(12) == 20
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 4, generator=g)  # rows of a trailing shape [3, 4]
    w = q.encode(x)
    assert w.shape == (4, 20) and w.dtype == torch.uint8
    y = q.decode(w, x.shape[1:], torch.float32)
    assert y.shape == x.shape and ((y - x).reshape(4, -1).abs().amax(1) <= _bound(x)).all()
    yb = q.decode(q.encode(x.bfloat16()), x.shape[1:], torch.bfloat16)
    assert yb.dtype == torch.bfloat16
    # stochastic rounding is unbiased: the mean of many decodes approaches x far below a step
    x2 = torch.randn(8, 16, generator=g)
    mean = torch.stack([q.decode(q.encode(x2), x2.shape[1:], torch.float32) for _ in range(400)]).mean(0)
    assert ((mean - x2).abs().amax(1) < 0.15 * _bound(x2)).all()
    # the key stream is the seed's: the same seed, the same bytes; another seed, others
    assert torch.equal(QuantRows(8, seed=9).encode(x2), QuantRows(8, seed=9).encode(x2))
    assert not torch.equal(QuantRows(8, seed=9).encode(x2), QuantRows(8, seed=10).encode(x2))
    assert len({format_seed(s, r) for s in range(4) for r in range(4)}) == 16


def test_quant_rows_whose_range_overflows_float32_decode_to_nan():
    """The documented limit of the row records (no host read): a finite row whose max - min
    overflows float32 comes back NaN in every value, its neighbours untouched; the codec's
    quantize() refuses the same row by name."""
    from commsched.quant import quantize

    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    x[1, :2] = torch.tensor([3e38, -3e38])
    q = QuantRows(8, seed=3)
    y = q.decode(q.encode(x), x.shape[1:], torch.float32)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
    x[1, :2] = torch.tensor([1.7e38, -1.7e38])  # a span just inside float32: finite
    assert torch.isfinite(q.decode(q.encode(x), x.shape[1:], torch.float32)).all()
    x[1, :2] = torch.tensor([3e38, -3e38])
    with pytest.raises(ValueError, match="float32 range"):
        quantize(x, 8)


def _one_rank_plan(R: int) -> A2APlan:
    return A2APlan((R,), (R,), 0)  # a one-rank exchange: the local copy, no process group


def test_exchange_32_bits_is_bit_exact_and_gradients_flow():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 6, generator=g)
    gy = torch.randn(9, 6, generator=g)
    plan = _one_rank_plan(9)
    plain = all_to_all(x, plan)
    for wire in (None, Wire(), moe_wires(32).dispatch, moe_wires(32).combine):
        assert torch.equal(all_to_all(x, plan, wire=wire), plain)
    # 8 bits forward, bf16 backward: the result is within the bound, the gradient is bf16(g)
    xa = x.clone().requires_grad_(True)
    y = all_to_all(xa, plan, wire=Wire(QuantRows(8, seed=2), BF16))
    assert y.dtype == torch.float32 and ((y - x).abs().amax(1) <= _bound(x)).all()
    assert not torch.equal(y, x)  # it was quantized
    (y * gy).sum().backward()
    assert torch.equal(xa.grad, gy.bfloat16().float())
    # 8 bits backward: the gradient within the codec's bound of g
    xb = x.clone().requires_grad_(True)
    (all_to_all(xb, plan, wire=Wire(None, QuantRows(8, seed=3))) * gy).sum().backward()
    assert ((xb.grad - gy).abs().amax(1) <= _bound(gy)).all()
    # the async form decodes in wait() and differentiates the same way
    xc = x.clone().requires_grad_(True)
    h = all_to_all_async(xc, plan, wire=Wire(BF16, BF16))
    yc = h.wait()
    assert torch.equal(yc, x.bfloat16().float())
    (yc * gy).sum().backward()
    assert torch.equal(xc.grad, gy.bfloat16().float())


def test_moe_layer_one_process_with_every_width_trains():
    # one EP rank (no process group): the exchange is the local copy; with a wire, the layer
    # still differentiates to the router, the experts and the tokens
    for bits in A2A_BITS:
        torch.manual_seed(0)
        layer = MoELayer(8, 12, RouterConfig(2, k=2), expert_group=ExpertGroup(2, 1, 0, None),
                         dispatch=DispatchConfig(chunks=2, pipeline=True, a2a_bits=bits))
        x = torch.randn(10, 8, requires_grad=True)
        y, aux = layer(x)
        (y.square().mean() + aux).backward()
        assert x.grad is not None and x.grad.abs().sum() > 0, bits
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters()), bits
        layer.close()


# --------------------------------------------------------------------------- refusals
def test_bad_widths_are_refused_with_the_allowed_values():
    for bad in (4, 0, 64, True, "8"):
        with pytest.raises(ValueError, match="--a2a-bits must be one of 32, 16, 8, got"):
            DispatchConfig(a2a_bits=bad)
        with pytest.raises(ValueError, match="--a2a-bits"):
            moe_wires(bad)
    with pytest.raises(ValueError, match="option of --impl commsched"):
        TrainConfig(impl="deepspeed", dispatch=DispatchConfig(a2a_bits=8))
    with pytest.raises(ValueError, match="bits must be one of"):
        QuantRows(1)
    with pytest.raises(TypeError, match="RowFormat"):
        Wire(forward="q8")
    with pytest.raises(TypeError, match="Wire"):
        all_to_all(torch.zeros(2, 2), _one_rank_plan(2), wire=BF16)
    with pytest.raises(ValueError, match="floating-point"):
        QuantRows(8).encode(torch.zeros(2, 3, dtype=torch.int64))


def test_cli_has_the_flag_and_refuses_other_values(capsys):
    from commsched.moe.train.cli import build_parser, config_from_args

    p = build_parser()
    assert config_from_args(p.parse_args(["--out", "x", "--a2a-bits", "8"])).dispatch.a2a_bits == 8
    assert config_from_args(p.parse_args(["--out", "x"])).dispatch.a2a_bits == 32
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--out", "x", "--a2a-bits", "4"])
    assert e.value.code == 2 and "invalid choice: 4" in capsys.readouterr().err


def test_payload_bytes_follow_the_width():
    from commsched.moe.model.lm import ModelConfig

    m = ModelConfig(d_model=64)
    cfg = {b: TrainConfig(model=m, dispatch=DispatchConfig(a2a_bits=b)) for b in A2A_BITS}
    assert a2a_row_bytes(cfg[32]) == (256,) * 4
    assert a2a_row_bytes(cfg[16]) == (128,) * 4
    assert a2a_row_bytes(cfg[8]) == (72, 128, 72, 128)
    assert a2a_payload_bytes(cfg[8]) / a2a_payload_bytes(cfg[32]) == pytest.approx(400 / 1024)


# --------------------------------------------------------------------------- gloo ranks
D, H = 16, 24


def _rows(src: int, dst: int, n: int) -> torch.Tensor:
    """The rows rank ``src`` sends rank ``dst`` (every rank can rebuild them)."""
    g = torch.Generator().manual_seed(100 * src + dst)
    return torch.randn(n, D, generator=g) * (1 + src) + dst


def _counts(src: int, world: int) -> list[int]:
    return [(3 * src + 2 * dst) % 5 + (dst == 1) for dst in range(world)]  # uneven, some zero


class _Bytes:
    """An observer that keeps each exchange's bytes."""

    def __init__(self):
        self.sent: list[int] = []

    def a2a_begin(self, nbytes):
        self.sent.append(nbytes)
        return len(self.sent)

    def a2a_end(self, token):
        pass

    def block_begin(self):
        pass

    def block_end(self):
        pass

    def a2a_blocked(self, seconds):
        pass


def _wire_exchange(rank: int, world: int) -> None:
    send = _counts(rank, world)
    recv = [_counts(p, world)[rank] for p in range(world)]
    x = torch.cat([_rows(rank, d, send[d]) for d in range(world)])
    expect = torch.cat([_rows(p, rank, recv[p]) for p in range(world)])
    peer_rows = sum(send) - send[rank]
    for pattern in ("direct", "ring"):
        # 32 bits: bit for bit today's exchange
        obs32, st32 = _Bytes(), CommStats(world)
        y32 = all_to_all(x, send, pattern=pattern, wire=Wire(), observer=obs32, stats=st32)
        assert torch.equal(y32, expect) and torch.equal(y32, all_to_all(x, send, pattern=pattern))
        assert obs32.sent == [peer_rows * D * 4]
        # bf16: exactly the cast rows
        assert torch.equal(all_to_all(x, send, pattern=pattern, wire=Wire(BF16)), expect.bfloat16().float())
        # 8 bits: every received row within the codec's bound of the row its peer sent
        obs8, st8 = _Bytes(), CommStats(world)
        y8 = all_to_all(x, send, pattern=pattern, wire=Wire(QuantRows(8, seed=rank)), observer=obs8, stats=st8)
        assert y8.dtype == torch.float32 and y8.shape == expect.shape
        assert ((y8 - expect).abs().amax(1) <= _bound(expect)).all(), pattern
        assert obs8.sent == [peer_rows * (D + META_BYTES)]  # the observer sees the short rows
        assert st8.total_bytes_sent == peer_rows * (D + 8) and st32.total_bytes_sent == peer_rows * 4 * D
        # async (and its ring thread) gives the same bytes as the blocking form, same key stream
        a = all_to_all(x, send, pattern=pattern, wire=Wire(QuantRows(8, seed=7 + rank)))
        b = all_to_all_async(x, send, pattern=pattern, wire=Wire(QuantRows(8, seed=7 + rank))).wait()
        assert torch.equal(a, b), pattern
        # gradients: the reverse exchange in the backward format, bf16 of the peers' gradients
        xg = x.clone().requires_grad_(True)
        yg = all_to_all(xg, send, pattern=pattern, wire=Wire(QuantRows(8, seed=rank), BF16))
        gy = torch.ones_like(yg) * (rank + 1) + torch.arange(yg.shape[0]).unsqueeze(1) / 7
        (yg * gy).sum().backward()
        gback = all_to_all(gy, recv)  # where each received row's gradient goes: back to its sender
        assert torch.equal(xg.grad, gback.bfloat16().float()), pattern
    # ranks whose wires differ are told so, every one of them, by the count exchange
    wire = Wire(QuantRows(8)) if rank == 0 else None
    with pytest.raises(ValueError, match="different dtypes"):
        all_to_all(x, send, wire=wire)


def _moe_layer_widths(rank: int, world: int) -> None:
    """The EP layer at 16 and 8 bits against the local reference: outputs within the
    quantization's reach, gradients of tokens, router and experts flowing and close; the
    observer sees the short exchanges (plain and pipelined paths)."""
    E = 2 * world
    rc = RouterConfig(E, k=2)
    for chunks, pipe in ((1, False), (3, False), (2, True)):
        out = {}
        for bits in A2A_BITS:
            torch.manual_seed(11)
            timer = A2ATimer()
            layer = MoELayer(D, H, rc, expert_group=ExpertGroup(E, world, rank, None),
                             dispatch=DispatchConfig(chunks=chunks, pipeline=pipe, a2a_bits=bits), observer=timer)
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(20 + 3 * rank, D, generator=g).requires_grad_(True)
            gy = torch.randn(x.shape, generator=g)
            y, aux = layer(x)
            ((y * gy).sum() + aux).backward()
            out[bits] = (y.detach(), x.grad, layer.router.weight.grad, layer.experts.w1.grad, timer)
            layer.close()
        y32, gx32, gr32, gw32, t32 = out[32]
        for bits in (16, 8):
            y, gx, gr, gw, t = out[bits]
            what = (bits, chunks, pipe)
            tol = 0.02 if bits == 16 else 0.05  # relative to the tensor's scale
            assert (y - y32).abs().max() <= tol * y32.abs().max(), what
            for a, b in ((gx, gx32), (gr, gr32), (gw, gw32)):
                assert a is not None and torch.isfinite(a).all(), what
                assert (a - b).abs().max() <= 2 * tol * b.abs().max(), what
            assert t.calls == t32.calls == 1 + 4 * chunks, what
            counts = (world - 1) * chunks * (E // world) * 8  # the count exchange: int64, any width
            short, full = t.bytes_sent - counts, t32.bytes_sent - counts
            if bits == 16:
                assert 2 * short == full, what
            else:  # rows to the experts D + 8 bytes (2 of the 4 exchanges), back 2 D, against 4 D
                assert 2 * (D + 8) / (8 * D) * full <= short <= 2 * (2 * D) / (8 * D) * full, (what, short, full)


CASES = [("wire_exchange", _wire_exchange), ("moe_layer_widths", _moe_layer_widths)]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return run_cases(request.param, CASES, timeout_s=240)


@pytest.mark.parametrize("case", [c for c, _ in CASES])
def test_a2a_bits_mp(results, case):
    assert_case(results, case)


def _train_widths(rank: int, world: int) -> None:
    from tests.moe.test_train import _cfg, _run

    runs = {}
    for bits in A2A_BITS:
        base = _cfg(world, "lina", chunks=2, pipeline=True, steps=4)
        cfg = base.replace(dispatch=DispatchConfig(chunks=2, pipeline=True, a2a_bits=bits))
        runs[bits] = _run(cfg)
    for bits in (16, 8):
        for a, b in zip(runs[bits]["loss"], runs[32]["loss"]):
            assert abs(a - b) <= 0.01 * b, (bits, runs[bits]["loss"], runs[32]["loss"])
        assert runs[bits]["sizes"]["a2a_payload_bytes_per_step"] < runs[32]["sizes"]["a2a_payload_bytes_per_step"]
    assert runs[32]["config"]["dispatch"]["a2a_bits"] == 32


def test_training_at_every_width_mp():
    res = run_cases(2, [("train_widths", _train_widths)], timeout_s=300)
    assert_case(res, "train_widths")



# --------------------------------------------------------------------------- the bench's variants
def test_bench_adds_the_quantized_variants_and_their_rows(tmp_path):
    from commsched.bench import build_parser, load_workload
    from commsched.moe.train.cli import build_parser as train_parser
    from commsched.moe.train.cli import config_from_args

    wl = load_workload("moe-train")
    plain = [v.name for v in wl.variants(build_parser(wl).parse_args([]))]
    assert not any("-q" in n for n in plain)  # opt-in: --a2a-bits
    variants = {v.name: v for v in wl.variants(build_parser(wl).parse_args(["--a2a-bits", "8"]))}
    assert list(variants)[:len(plain)] == plain and {"lina-q8", "lina-overlap-q8"} <= set(variants)
    cfgs = {n: config_from_args(train_parser().parse_args([*v.argv, "--out", str(tmp_path)]))
            for n, v in variants.items()}
    assert cfgs["lina-q8"].dispatch.a2a_bits == cfgs["lina-overlap-q8"].dispatch.a2a_bits == 8
    assert cfgs["lina-q8"].schedule == cfgs["lina"].schedule and cfgs["lina-overlap-q8"].schedule.policy == "lina-overlap"
    assert cfgs["lina"].dispatch.a2a_bits == cfgs["fifo"].dispatch.a2a_bits == 32

    def m(step, a2a, losses):
        return {"step_time_s": step, "a2a_time_s": a2a, "allreduce_time_s": 0.5, "a2a_alone_time_s": a2a,
                "allreduce_wait_s": 0.1, "val_loss": losses[-1], "loss": losses,
                "sizes": {"non_expert_grad_bytes": 1 << 20, "a2a_payload_bytes_per_step": 2 << 20}}
    runs = {"deepspeed": [m(3.0, 1.2, [5.0, 4.0])], "fifo": [m(2.0, 0.8, [5.0, 4.0])],
            "lina": [m(1.6, 0.6, [5.0, 4.0])], "lina-q8": [m(1.0, 0.3, [5.0, 4.04])]}
    extra = wl.summarize(runs, build_parser(wl).parse_args(["--a2a-bits", "8"]), tmp_path)
    table = extra["extra_tables"]["Lina against fifo and DeepSpeed (medians of per-repeat ratios)"]
    assert "| step time: fifo / lina-q8 (goal >= 1.5) | 2x |" in table
    assert "| step time: deepspeed / lina-q8 (goal >= 2) | 3x |" in table
    assert "| best commsched configuration: lina-q8 | 1 s |" in table
    assert "| loss: lina-q8 largest per-step gap to fifo, relative (goal <= 0.01) | 0.01 |" in table


# --------------------------------------------------------------------------- no host reads, devices
def test_the_wire_reads_nothing_back_on_the_host(monkeypatch):
    # encode, exchange (with a plan) and decode, forward and backward, call no host read of a
    # tensor: on CUDA each would be a device synchronisation in the hot path
    x = torch.randn(12, 10, requires_grad=True)
    plan = _one_rank_plan(12)
    wire = Wire(QuantRows(8, seed=1), QuantRows(8, seed=2))

    def refuse(self, *a, **k):
        raise AssertionError("a host read of a tensor in the wire's hot path")
    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    y = all_to_all(x, plan, wire=wire)
    y.sum().backward()
    y2 = all_to_all(x.bfloat16(), plan, wire=Wire(BF16, BF16))
    monkeypatch.undo()
    assert x.grad is not None and y2.dtype == torch.bfloat16


@pytest.mark.cuda  # conftest skips it without a device; gpucheck runs -m cuda
def test_records_on_cuda_are_the_reference_and_never_synchronise():
    x = torch.randn(37, 129, generator=torch.Generator().manual_seed(3))
    key = 4242
    cpu = encode_records(x, 8, key, impl="reference")
    xc = x.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rec = encode_records(xc, 8, key)  # the Triton kernel
        y = decode_records(rec, 8, 129)
        w = QuantRows(8, seed=1)
        z = w.decode(w.encode(xc), xc.shape[1:], torch.float32)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(rec.cpu(), cpu)
    assert torch.equal(y.cpu(), decode_records(cpu, 8, 129, impl="reference"))
    assert ((z.cpu() - x).abs().amax(1) <= _bound(x)).all()


# --------------------------------------------------------------------------- resume
def _resume_exact(tmp: str, grad_bits: int, rank: int, world: int) -> None:
    """A run stopped after 2 steps (its checkpoint) and resumed to 4 ends bitwise equal to
    a 4-step run: each layer's 8-bit key stream continues from the checkpoint."""
    from pathlib import Path

    from commsched.moe.train.state import checkpoint_path
    from commsched.moe.train.trainer import train
    from tests.moe.test_train import _cfg, _same_state

    base = _cfg(world, "fifo", steps=4)
    cfg = base.replace(dispatch=DispatchConfig(a2a_bits=8), grad_bits=grad_bits, checkpoint_every=2)
    full_m, full_state = train(cfg.replace(checkpoint_every=0), None, progress=False)
    d = Path(tmp) / f"g{grad_bits}"
    train(cfg.replace(steps=2), d, progress=False)
    keys = torch.load(checkpoint_path(d, rank), weights_only=True)["wire_keys"]
    assert len(keys) == 1  # the model's one MoE layer
    (d / "metrics.json").unlink(missing_ok=True)
    m, state = train(cfg, d, progress=False, resume=True)
    assert m.loss == full_m.loss, (m.loss, full_m.loss)
    assert _same_state(state, full_state)


@pytest.mark.parametrize("grad_bits", [32, 8])
def test_a2a_bits_8_resumes_bitwise(tmp_path, grad_bits):
    import functools

    res = run_cases(2, [("resume", functools.partial(_resume_exact, str(tmp_path), grad_bits))],
                    timeout_s=180, env={"COMMSCHED_TIMEOUT_S": "30"})
    assert_case(res, "resume")


def test_quant_rows_key_stream_state_round_trips():
    a, b = QuantRows(8, seed=5), QuantRows(8, seed=5)
    [a.next_key() for _ in range(3)]
    b.load_state_dict(a.state_dict())
    assert [b.next_key() for _ in range(4)] == [a.next_key() for _ in range(4)]
    with pytest.raises(ValueError, match="seed"):
        QuantRows(8, seed=6).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="damaged"):
        b.load_state_dict({"seed": 5, "state": [1, 2]})
