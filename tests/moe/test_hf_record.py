"""Routing traces recorded from transformers MoE models (``commsched.moe.record.recorder``:
``record_hf_trace``, ``--hf-tiny-mixtral``): the trace's shapes, dtypes and ranges, its ids
equal to what each block's own router returns for the same tokens (Mixtral, Qwen2-MoE,
Qwen3-MoE, DeepSeek-V3), the command line's trace and refusals, and the inference driver
serving the recorded trace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.20",
                    reason="the transformers extra is not installed: pip install commsched[hf]")

import commsched.moe.hf as hf  # noqa: E402
from commsched.moe.model.data import Corpus  # noqa: E402
from commsched.moe.record.recorder import record_hf_trace  # noqa: E402
from commsched.moe.record.traces import load_trace, save_trace  # noqa: E402

from .test_hf import _build  # noqa: E402

SMALL = dict(hidden=32, intermediate=16, layers=3, heads=4, kv_heads=2, seq_len=16)


def _corpus(n: int = 2000, vocab: int = 256) -> Corpus:
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, vocab, (n,), generator=g, dtype=torch.uint8)
    return Corpus(train=data[: n // 2], val=data[n // 2:], source="random bytes")


def _router_ids(model, windows: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sparse MoE block, in model order: (ids [T, k], weights [T, k]) of the block's router
    called directly on the hidden states that reach the block when the model runs ``windows``."""
    blocks = [m for m in model.modules() if type(m) in hf.supported_blocks()]
    seen: list[torch.Tensor] = []
    hs = [b.register_forward_pre_hook(lambda _m, inp: seen.append(inp[0].detach().clone())) for b in blocks]
    try:
        with torch.no_grad():
            model.eval()(input_ids=windows)
    finally:
        for h in hs:
            h.remove()
    out = []
    for b, x in zip(blocks, seen):
        with torch.no_grad():
            _, w, ids = b.gate(x.reshape(-1, x.shape[-1]))
        out.append((ids.numpy(), w.float().numpy()))
    return out


def test_tiny_mixtral_trace_is_the_routers_top_k():
    model = hf.tiny_mixtral(1, **SMALL)
    corpus = _corpus()
    tr = record_hf_trace(model, corpus, 70, seq_len=16, batch_size=2, source="unit")  # 70 -> 5 windows of 16
    assert (tr.num_tokens, tr.num_layers, tr.k, tr.num_experts) == (80, 3, 2, 8)
    assert tr.experts.dtype == np.int64 and tr.experts.min() >= 0 and tr.experts.max() < 8
    assert (tr.experts[:, :, 0] != tr.experts[:, :, 1]).all()
    assert tr.seq_ids.tolist() == [i // 16 for i in range(80)]
    assert tr.source == "model:unit,corpus:random bytes,split:val"
    ref = _router_ids(model, corpus.val[:80].long().view(5, 16))
    assert len(ref) == 3
    for l, (ids, w) in enumerate(ref):  # Mixtral's top-k comes highest weight first
        assert (np.diff(w, axis=1) <= 0).all()
        assert np.array_equal(tr.experts[:, l], ids), l
    assert len(set(map(tuple, tr.experts[:, 0].tolist()))) > 4  # not one constant choice


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_other_families_trace_is_the_routers_top_k(family):
    model = _build(family, 2)  # vocabulary 64
    corpus = _corpus(vocab=64)
    tr = record_hf_trace(model, corpus, 48, seq_len=16, batch_size=3)
    ref = _router_ids(model, corpus.val[:48].long().view(3, 16))
    assert tr.num_layers == len(ref) == 2 and tr.num_experts == 8 and tr.k == 2
    for l, (ids, w) in enumerate(ref):
        assert np.array_equal(np.sort(tr.experts[:, l], axis=1), np.sort(ids, axis=1)), (family, l)
        top1 = ids[np.arange(len(ids)), w.argmax(axis=1)]  # the highest gate comes first
        assert np.array_equal(tr.experts[:, l, 0], top1), (family, l)


def test_record_hf_refuses_a_model_without_moe_blocks():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16)
    with pytest.raises(ValueError, match="no sparse MoE block to record.*MixtralSparseMoeBlock"):
        record_hf_trace(tf.LlamaForCausalLM(cfg), _corpus(), 16, seq_len=16)
    with pytest.raises(ValueError, match="beyond the model's vocabulary of 64"):
        record_hf_trace(_build("mixtral", 0), _corpus(), 16, seq_len=16)
    with pytest.raises(ValueError, match="fewer than the"):
        record_hf_trace(hf.tiny_mixtral(0, **SMALL), _corpus(), 5000, seq_len=16)


def test_cli_records_the_tiny_mixtral_and_refuses_bad_flags(tmp_path, capsys):
    from commsched.moe.record.cli import main

    text = tmp_path / "c.txt"
    text.write_bytes(bytes(np.random.default_rng(0).integers(32, 127, 40000, dtype=np.uint8)))
    out = tmp_path / "t.npz"
    assert main(["--hf-tiny-mixtral", "--train-steps", "2", "--batch-size", "2", "--tokens", "128",
                 "--corpus", str(text), "--device", "cpu", "--out", str(out)]) == 0
    tr = load_trace(out)
    assert (tr.num_tokens, tr.num_layers, tr.num_experts, tr.k) == (128, 4, 8, 2)
    assert tr.source.startswith("model:hf-tiny-mixtral (MixtralForCausalLM trained 2 steps from seed 0)")
    assert '"val_loss"' in capsys.readouterr().out
    for flags, msg in [([], "needs --train-steps N"),
                       (["--train-steps", "1", "--layers", "3"], "size the project's language model"),
                       (["--checkpoint", "m.pt"], "--checkpoint and --save-checkpoint")]:
        assert main(["--hf-tiny-mixtral", *flags, "--out", str(tmp_path / "u.npz")]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, flags


def test_inference_driver_serves_the_recorded_trace(tmp_path):
    from commsched.moe.infer import TraceDriverConfig
    from commsched.moe.infer.drivers import TraceDriver

    tr = record_hf_trace(hf.tiny_mixtral(0, **SMALL), _corpus(4000), 400, seq_len=16, batch_size=8)
    save_trace(tmp_path / "hf.npz", tr)
    drv = TraceDriver(TraceDriverConfig(path=str(tmp_path / "hf.npz"), tokens_per_batch=64, d_model=8), 3, 0, 2)
    assert (drv.E, drv.L, drv.k) == (8, 3, 2) and drv.profile.num_tokens == 192  # 12 of 25 windows
    x, ex, gate = drv.inputs(0, 0, 8)  # rank 0's share of the first held-out batch: whole windows
    assert x.shape == (ex.shape[0], 8) and ex.shape[0] % 16 == 0 and gate.shape == (ex.shape[0], 2)
    assert torch.equal(ex, torch.from_numpy(tr.experts[192:192 + ex.shape[0]]))
