"""``commsched.quant.allreduce.quantized_all_reduce``: the compressed sum over ranks (the
trainers' ``--grad-bits``). Pure checks in milliseconds; one multi-process run on real gloo
ranks shows the sums are the same bytes on every rank, within the codec's bound of the exact
sum, unbiased, replayable from the seed, unchanged under the NCCL semantics fake and when
summed many at once (``quantized_all_reduce_many``); another shows ``CompressedLauncher``'s
batches change no bit and never hang, with ranks that launch at different paces into
groups of all ranks and of some."""

from __future__ import annotations

import pytest
import torch

from commsched.quant.allreduce import (
    GRAD_BITS,
    ROW_VALUES,
    CompressedLauncher,
    check_grad_bits,
    quantized_all_reduce,
    quantized_all_reduce_many,
    wire_bytes,
)
from tests.mp import run_ranks


def test_bits_are_checked_with_a_message_naming_the_widths():
    for bad in (0, 1, 3, 12, 64, "8", 8.0, True):
        with pytest.raises(ValueError, match="must be one of 32, 16, 8, 4, 2"):
            check_grad_bits(bad)
    assert [check_grad_bits(b) for b in GRAD_BITS] == list(GRAD_BITS)


def test_bad_input_is_refused_before_any_collective():
    with pytest.raises(ValueError, match="1-D floating-point"):
        quantized_all_reduce(torch.zeros(4, 4), 8)
    with pytest.raises(ValueError, match="1-D floating-point"):
        quantized_all_reduce(torch.zeros(4, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="impl must be one of"):
        quantized_all_reduce(torch.zeros(4), 8, impl="cuda")
    with pytest.raises(ValueError, match="row_values must be an int >= 1"):
        quantized_all_reduce(torch.zeros(4), 8, row_values=0)
    with pytest.raises(ValueError, match="bits must be one of"):
        quantized_all_reduce(torch.zeros(4), 7)
    with pytest.raises(ValueError, match=r"seeds: one per tensor \(2\), got 1"):
        quantized_all_reduce_many([torch.zeros(4), torch.zeros(4)], 8, seeds=[1])
    with pytest.raises(ValueError, match="1-D floating-point"):
        quantized_all_reduce_many([torch.zeros(4), torch.zeros(2, 2)], 8)
    for bad in (-1, 1.5, True, "4M"):
        with pytest.raises(ValueError, match=r"batch_bytes must be an int >= 0"):
            CompressedLauncher(8, batch_bytes=bad)


def test_without_a_process_group_the_tensor_is_left_as_it_is():
    x = torch.randn(1000)
    y = x.clone()
    assert quantized_all_reduce(y, 8) is y
    assert torch.equal(x, y)
    ys = [x.clone(), x[:10].clone()]
    assert quantized_all_reduce_many(ys, 8) == ys
    assert torch.equal(ys[0], x)


def test_wire_bytes():
    n, P = 435_000, 4
    full = wire_bytes(n, P, 32)
    assert full == 2 * 3 * (n // 4) * 4  # a ring allreduce of float32: 2 (P - 1) n / P values
    rows = -(-n // ROW_VALUES)
    chunk = -(-rows // P)
    assert wire_bytes(n, P, 8) == 2 * 3 * chunk * (ROW_VALUES + 8)
    assert wire_bytes(n, P, 16) == 2 * 3 * chunk * ROW_VALUES * 2
    assert 3.8 < full / wire_bytes(n, P, 8) < 3.9  # 1024 / 264 bytes per 256 values, plus padding
    assert wire_bytes(n, 1, 8) == 0 and wire_bytes(0, P, 8) == 0


# --------------------------------------------------------------------------- on gloo ranks
N = 5 * ROW_VALUES * 3 + 77  # not a multiple of rows * ranks: the padding is exercised


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    pad = (-x.numel()) % ROW_VALUES
    return torch.cat([x, x.new_zeros(pad)]).view(-1, ROW_VALUES)


def _level_steps(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Per value, the level step of its row: (max - min) / (2^bits - 1)."""
    r = _rows_of(x)
    step = (r.max(1).values - r.min(1).values) / (2 ** bits - 1)
    return step.repeat_interleave(ROW_VALUES)[: x.numel()]


def _sums(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from tests.nccl_fake import nccl_semantics

    g = torch.Generator().manual_seed(100 + rank)
    # rows of very different scales, a constant row and a zero row: per-row scales matter
    x = torch.randn(N, generator=g) * (1 + rank)
    x[:ROW_VALUES] *= 1e-4
    x[ROW_VALUES:2 * ROW_VALUES] = 0.5
    x[2 * ROW_VALUES:3 * ROW_VALUES] = 0.0
    exact = x.double().clone()
    dist.all_reduce(exact)
    everyone = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(everyone, x)
    out: dict = {"exact": exact, "inputs": everyone}
    for bits in GRAD_BITS:
        y = x.clone()
        assert quantized_all_reduce(y, bits, seed=11) is y
        out[bits] = y
    out["replay"] = quantized_all_reduce(x.clone(), 8, seed=11)
    out["other_seed"] = quantized_all_reduce(x.clone(), 8, seed=12)
    # unbiased: the mean over many seeds closes in on the exact sum
    out["mean8"] = torch.stack([quantized_all_reduce(x.clone(), 8, seed=1000 + s)
                                for s in range(48)]).mean(0)
    out["f64"] = quantized_all_reduce(x.double(), 8, seed=11)
    with nccl_semantics() as fake:
        out["nccl"] = quantized_all_reduce(x.clone(), 8, seed=11)
        out["nccl_calls"] = dict(fake.calls)
    # many at once: each tensor the bytes it gets alone (an empty one skipped), two collectives
    parts = [x.clone(), x[:300].clone() * 3, x[:0].clone(), x[:1000].double()]
    seeds = [11, 5, 9, 7]
    for bits in (16, 8, 2):
        many = quantized_all_reduce_many([t.clone() for t in parts], bits, seeds=seeds)
        out[("many", bits)] = many
        out[("alone", bits)] = [quantized_all_reduce(t.clone(), bits, seed=s) for t, s in zip(parts, seeds)]
    with nccl_semantics() as fake:
        quantized_all_reduce_many([t.clone() for t in parts], 8, seeds=seeds)
        out["many_calls"] = dict(fake.calls)
    return out


@pytest.mark.slow
def test_compressed_sums_on_three_ranks():
    world = 3
    res = run_ranks(world, _sums, timeout_s=180)
    exact = res[0]["exact"]
    inputs = res[0]["inputs"]
    for bits in GRAD_BITS:
        for r in range(1, world):  # every replica holds the same bytes
            assert torch.equal(res[r][bits], res[0][bits]), (bits, r)
    assert torch.allclose(res[0][32].double(), exact, rtol=1e-6, atol=1e-6)
    # bf16 on the wire, float32 sums: each term within 2^-8 relative, the result once more
    err16 = (res[0][16].double() - exact).abs()
    bound16 = sum(x.double().abs() for x in inputs) * 2 ** -8 + exact.abs() * 2 ** -8 + 1e-6
    assert bool((err16 <= bound16).all())
    for bits in (8, 4, 2):
        got = res[0][bits].double()
        # the bound: the peers' level steps (each rank's own chunk stays exact; bounded by all
        # ranks' steps here) and one step of the summed row, plus float32 rounding
        bound = sum(_level_steps(x, bits) for x in inputs).double()
        bound = bound + _level_steps(exact.float(), bits).double() * 1.5 + 1e-5
        assert bool(((got - exact).abs() <= bound).all()), bits
    err8 = (res[0][8].double() - exact).abs()
    assert float(err8.max()) > 0  # it did quantize
    assert float(err8[2 * ROW_VALUES:3 * ROW_VALUES].max()) == 0  # zero rows sum to zeros
    # the constant row sums exactly (0.5 on each rank)
    assert torch.allclose(res[0][8][ROW_VALUES:2 * ROW_VALUES].double(), exact[ROW_VALUES:2 * ROW_VALUES])
    # the same seed replays the same bytes; another seed rounds otherwise
    assert torch.equal(res[0]["replay"], res[0][8])
    assert not torch.equal(res[0]["other_seed"], res[0][8])
    # unbiased: 48 seeds average the rounding away (error ~ 1/sqrt(48) of one draw's)
    mean_err = (res[0]["mean8"].double() - exact).abs().mean()
    assert float(mean_err) < 0.35 * float(err8.mean())
    # float64 input: summed in float32 on the wire, written back in float64
    assert res[0]["f64"].dtype == torch.float64
    assert torch.allclose(res[0]["f64"], res[0][8].double(), atol=1e-5)
    # NCCL's semantics (the blocking collectives go through as on a GPU): the same bytes
    assert torch.equal(res[0]["nccl"], res[0][8])
    assert res[0]["nccl_calls"].get("all_to_all_single") == 1
    # quantized_all_reduce_many: the same bytes as alone, on every rank, in one pair of collectives
    for bits in (16, 8, 2):
        for r in range(world):
            many, alone = res[r][("many", bits)], res[r][("alone", bits)]
            assert [t.dtype for t in many] == [t.dtype for t in alone]
            assert all(torch.equal(a, b) for a, b in zip(many, alone)), (bits, r)
            assert all(torch.equal(a, b) for a, b in zip(many, res[0][("many", bits)]))
    assert res[0]["many_calls"].get("all_to_all_single") == 1


# --------------------------------------------------------------------------- the launcher
# (group, numel) per launch, the same sequence on every rank: "all" is a group of every
# rank, "pair" the rank's own of two (0, 2) / (1, 3), as expert-data-parallel groups are
LAUNCHES = ([("all", 5000), ("all", 700), ("pair", 3000), ("all", 40_000), ("pair", 300),
             ("pair", 9000), ("all", 20_000), ("all", 64), ("all", 6000)] * 3
            + [("all", 1200)] * 12 + [("pair", 800)] * 6 + [("all", 90_000)])


def _launches(rank: int, world: int) -> dict:
    import random
    import time

    import torch.distributed as dist

    from tests.nccl_fake import nccl_semantics

    groups = {"all": dist.new_group(list(range(world)))}
    for pair in ([0, 2], [1, 3]):
        g = dist.new_group(pair)
        if rank in pair:
            groups["pair"] = g
    base = [torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + i))
            for i, (_, n) in enumerate(LAUNCHES)]

    def run(batch_bytes: int, pace_seed: int, fake: bool = False) -> tuple:
        pace = random.Random(pace_seed * 10 + rank)  # each rank its own pace
        with CompressedLauncher(8, seed=3, batch_bytes=batch_bytes) as launch:
            flats = [t.clone() for t in base]
            works = []
            for i, ((g, _), flat) in enumerate(zip(LAUNCHES, flats)):
                if pace.random() < 0.3:
                    time.sleep(pace.random() * 0.02)
                works.append(launch(flat, groups[g], op=i % 7))
            for w in works:
                w.wait()
            return flats, launch.batches, launch.summed

    out = {"one": run(0, 1), "batched": run(1 << 16, 2), "big": run(1 << 22, 3)}
    with nccl_semantics():
        out["nccl"] = run(1 << 22, 4)
    return out


@pytest.mark.slow
def test_launcher_batches_change_no_bit_on_four_ranks():
    world = 4
    res = run_ranks(world, _launches, timeout_s=240)
    n = len(LAUNCHES)
    for r in range(world):
        one, batches_one, summed_one = res[r]["one"]
        assert batches_one == summed_one == n  # batch_bytes=0: one sum per launch
        for name in ("batched", "big", "nccl"):
            flats, batches, summed = res[r][name]
            assert summed == n
            assert all(torch.equal(a, b) for a, b in zip(flats, one)), (name, r)
        # the ranks' different paces still left launches queued to sum together
        assert res[r]["big"][1] < n, res[r]["big"][1]
    for r in range(1, world):  # every replica of a group holds the same bytes
        for i, (g, _) in enumerate(LAUNCHES):
            peer = 0 if g == "all" else r % 2
            assert torch.equal(res[r]["one"][0][i], res[peer]["one"][0][i]), (i, r)


def _program_regime(rank: int, world: int) -> dict:
    """The program regime (what CUDA runs): the launches of one flush summed from this thread,
    the same bits as the worker's; force_wire sums over the wire on a one-rank group."""
    import torch.distributed as dist

    from tests.nccl_fake import nccl_semantics

    base = [torch.randn(n, generator=torch.Generator().manual_seed(7 * rank + i)) for i, n in
            enumerate((5000, 300, 40_000, 64))]
    out = {}
    for inline in (False, True):
        with nccl_semantics(), CompressedLauncher(8, seed=3, batch_bytes=1 << 16, inline=inline) as launch:
            flats = [t.clone() for t in base]
            works = [launch(f, None, op=i) for i, f in enumerate(flats)]
            if inline:
                assert not any(w.is_completed() for w in works)  # held until the program point ends
                launch.flush()
                assert all(w.is_completed() for w in works) and launch.batches == 3  # cut by batch_bytes
            for w in works:
                assert w.wait(timeout=30)
            out[inline] = flats
    one = dist.new_group([rank])  # every rank its own one-rank group
    x = base[0].clone()
    assert torch.equal(quantized_all_reduce(x, 8, group=one), base[0])  # the shortcut
    y = quantized_all_reduce(base[0].clone(), 8, group=one, force_wire=True)
    out["wire"] = (float((y - base[0]).abs().max()), float(_level_steps(base[0], 8).max()))
    with CompressedLauncher(32, inline=True, force_wire=True) as launch:
        z = base[1].clone()
        launch(z, one).wait()
        out["exact32"] = torch.equal(z, base[1])
    return out


def test_program_regime_and_force_wire():
    res = run_ranks(2, _program_regime, timeout_s=120)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(res[r][True], res[r][False]))
        err, step = res[r]["wire"]
        assert 0 < err <= step * 1.01  # it went through the 8-bit records
        assert res[r]["exact32"]


def _disagreeing_sums(rank: int, world: int) -> None:
    """A numel, width, dtype or layout that differs on one rank: the same ValueError naming it
    on every rank (not an abort inside gloo), and the ranks stay in step for the next sum."""
    with pytest.raises(ValueError, match="quantized_all_reduce: the ranks disagree .*numel: rank 0 has 3000, rank 1 has 3300"):
        quantized_all_reduce(torch.ones(3000 + 300 * rank), 8)
    with pytest.raises(ValueError, match="bits: rank 0 has 8, rank 1 has 4"):
        quantized_all_reduce(torch.ones(3000), 8 if rank == 0 else 4)
    with pytest.raises(ValueError, match="numel: rank 0 has 5, rank 1 has 0"):
        quantized_all_reduce(torch.ones(5 * (1 - rank)), 32)  # an empty tensor on one rank alone
    with pytest.raises(ValueError, match="dtype: rank 0 has torch.float32, rank 1 has torch.float64"):
        quantized_all_reduce(torch.ones(8, dtype=torch.float64 if rank else torch.float32), 32)
    with pytest.raises(ValueError, match="meta tensor: rank 0 has False, rank 1 has True"):
        quantized_all_reduce(torch.ones(8, device="meta" if rank else "cpu"), 8)
    with pytest.raises(ValueError, match="quantized_all_reduce_many: the ranks disagree .*numels, dtypes"):
        quantized_all_reduce_many([torch.ones(4), torch.ones(6)] if rank else [torch.ones(6), torch.ones(4)], 8)
    x = torch.ones(600)
    assert torch.equal(quantized_all_reduce(x, 32), torch.full((600,), 2.0))


def test_disagreeing_ranks_get_the_same_error():
    run_ranks(2, _disagreeing_sums, timeout_s=60, pg_timeout_s=20)
