"""transformers MoE models made expert-parallel in one call (``commsched.moe.hf``): on 1, 2
and 4 gloo ranks the expert-parallel model's logits, loss, router logits, aux loss and every
gradient equal the untouched model's in one process, for Mixtral, Qwen2-MoE, Qwen3-MoE and
DeepSeek-V3 (and a routing that leaves every rank but rank 0 without tokens); checkpoints
round-trip 2 -> 4 -> 1 ranks bit for bit; the expert-parallel Mixtral trained by LinaDDP under
Lina's schedule on 2 ranks has one process's losses and parameters, its replicas identical; the
refusals."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

pytest.importorskip("transformers", minversion="5.20",
                    reason="the transformers extra is not installed: pip install commsched[hf]")

import commsched.moe.hf as hf  # noqa: E402
from commsched.moe.model.experts import is_expert_param  # noqa: E402
from tests.mp import run_ranks  # noqa: E402

TOL = 1e-5  # float32: |ep - ref| <= TOL * (1 + |ref|)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v3_skewed")
# the modeling modules, imported once per pooled rank (it unpickles this module) rather than
# in every forked run
SUPPORTED = hf.supported_blocks()
ATTN = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)


def _config(family: str, num_experts: int = 8):
    import transformers as tf

    if family == "mixtral":
        cfg = tf.MixtralConfig(**ATTN, num_key_value_heads=2, intermediate_size=16, num_local_experts=num_experts,
                               num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)
        return tf.MixtralForCausalLM, cfg
    if family == "qwen2_moe":  # softmax top-k without renormalisation, a gated shared expert
        cfg = tf.Qwen2MoeConfig(**ATTN, num_key_value_heads=2, intermediate_size=24, moe_intermediate_size=16,
                                shared_expert_intermediate_size=24, num_experts=num_experts, num_experts_per_tok=2,
                                norm_topk_prob=False, decoder_sparse_step=1, output_router_logits=True,
                                router_aux_loss_coef=0.02)
        return tf.Qwen2MoeForCausalLM, cfg
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**ATTN, num_key_value_heads=2, head_dim=8, intermediate_size=24,
                                moe_intermediate_size=16, num_experts=num_experts, num_experts_per_tok=2,
                                norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.02)
        return tf.Qwen3MoeForCausalLM, cfg
    # DeepSeek-V3: sigmoid scores, group-limited top-k, the correction bias, a shared expert
    cfg = tf.DeepseekV3Config(**ATTN, num_key_value_heads=4, intermediate_size=24, moe_intermediate_size=16,
                              n_shared_experts=1, n_routed_experts=num_experts, n_group=2, topk_group=1,
                              num_experts_per_tok=2, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, output_router_logits=True)
    return tf.DeepseekV3ForCausalLM, cfg


def _build(family: str, seed: int, num_experts: int = 8):
    """A tiny float32 model with random weights (seeded), no download."""
    cls, cfg = _config(family.replace("_skewed", ""), num_experts)
    torch.manual_seed(seed)
    model = cls(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
                if family.endswith("_skewed"):  # every token to experts 0 and 1: rank 0's on any group
                    b[:2] += 10.0
    return model


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(100 + rank))


def _excess(a, b) -> float:
    """How far ``a`` is beyond the tolerance around ``b`` (<= 0: within)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a, b = torch.as_tensor(a).detach().float(), torch.as_tensor(b).detach().float()
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float(((a - b).abs() - TOL * (1 + b.abs())).max())


def _exactness(rank: int, world: int, family: str, **options) -> dict[str, float]:
    import torch.distributed as dist

    ref = _build(family, seed=1)
    ep = hf.expert_parallel(copy.deepcopy(ref), **options)
    assert sum(isinstance(m, hf.ExpertParallelExperts) for m in ep.modules()) == 2
    chosen: list[torch.Tensor] = []
    for m in ep.modules():
        if type(m) in SUPPORTED:
            m.gate.register_forward_hook(lambda mod, inp, out: chosen.append(out[2]))
    ids = _batch(rank)
    out_ref = ref(input_ids=ids, labels=ids, output_router_logits=True)
    out_ref.loss.backward()
    out = ep(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    if family.endswith("_skewed"):
        assert all(int(c.max()) < 2 for c in chosen)  # every rank but rank 0 receives no token
    d = {"logits": _excess(out.logits, out_ref.logits), "loss": _excess(out.loss, out_ref.loss),
         "aux_loss": _excess(out.aux_loss, out_ref.aux_loss)}
    assert len(out.router_logits) == len(out_ref.router_logits) == 2
    d["router_logits"] = max(_excess(a, b) for a, b in zip(out.router_logits, out_ref.router_logits))
    # gradients: one process holding every expert, over every rank's batch
    ref_params = dict(ref.named_parameters())
    worst, names = -1.0, []
    for name, p in ep.named_parameters():
        names.append(name)
        g_ref = ref_params[name].grad.clone()
        dist.all_reduce(g_ref)
        g = p.grad.detach().contiguous()
        if is_expert_param(p):
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g)
            g = torch.cat(parts)
        else:
            g = g.clone()
            dist.all_reduce(g)
        worst = max(worst, _excess(g, g_ref))
    assert sorted(names) == sorted(ref_params)
    d["grads"] = worst
    for m in ep.modules():
        if isinstance(m, hf.ExpertParallelExperts):
            m.close()
    return d


def _round_trip(rank: int, world: int, family: str, sd_in) -> dict | None:
    """Load ``sd_in`` (None: the seed-1 model's own) into an expert-parallel model built from
    other weights and gather it back."""
    ep = hf.expert_parallel(_build(family, seed=7))
    if sd_in is None:
        sd_in = _build(family, seed=1).state_dict()
    hf.load_state_dict(ep, sd_in)
    return hf.gather_state_dict(ep)


def _refusals(rank: int, world: int) -> list[str]:
    msgs = []
    with pytest.raises(ValueError) as e:  # experts that do not split over the group
        hf.expert_parallel(_build("qwen3_moe", seed=1, num_experts=world + 1))
    msgs.append(str(e.value))
    with pytest.raises(ValueError) as e:  # ranks with different models: an error on every rank, no hang
        hf.expert_parallel(_build("mixtral", seed=1, num_experts=4 * (1 + rank)))
    msgs.append(str(e.value))
    return msgs


def _wires(rank: int, world: int) -> dict[int, tuple[int, int, float]]:
    """Per ``a2a_bits``: the observer's exchanges and bytes sent in one step, and the loss."""
    from commsched.comm.observe import A2ATimer

    ids, out = _batch(rank), {}
    for bits in (32, 8):
        timer = A2ATimer()
        ep = hf.expert_parallel(_build("mixtral", seed=1), a2a_bits=bits, observer=timer)
        res = ep(input_ids=ids, labels=ids)
        res.loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in ep.parameters())
        out[bits] = (timer.calls, timer.bytes_sent, float(res.loss))
    return out


def _launch(rank: int, world: int, sd_in: dict) -> dict:
    res: dict = {"exact": {f: _exactness(rank, world, f) for f in FAMILIES}}
    if world > 1:  # the pipelined exchange, chunk by chunk
        res["exact"]["qwen2_moe pipelined"] = _exactness(rank, world, "qwen2_moe", chunks=2, pipeline=True)
    res["sd"] = {f: _round_trip(rank, world, f, sd_in.get(f)) for f in FAMILIES[:4]}
    res["refusals"] = _refusals(rank, world) if world > 1 else []
    res["wires"] = _wires(rank, world) if world > 1 else {}
    return res


def _equal_dicts(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_expert_parallel_equals_one_process_and_checkpoints_round_trip():
    sd_in: dict = {}
    seen = {}
    for world in (2, 4, 1):  # the round trip: 2 -> 4 -> 1 ranks
        results = run_ranks(world, _launch, sd_in, timeout_s=240)
        for rank, res in enumerate(results):
            for family, d in res["exact"].items():
                bad = {k: v for k, v in d.items() if not v <= 0.0}
                assert not bad, f"{family} on {world} ranks, rank {rank}: beyond {TOL}: {bad}"
            if world > 1:
                split, differ = res["refusals"]
                assert f"{world + 1} experts" in split and f"{world} ranks" in split
                assert "different from rank 0" in differ
                w = res["wires"]  # the observer sees the exchanges; 8-bit rows are shorter, the loss close
                assert w[32][0] == w[8][0] > 0 and 0 < w[8][1] < w[32][1]
                assert abs(w[8][2] - w[32][2]) < 0.05
        assert all(results[r]["sd"][f] is None for r in range(1, world) for f in FAMILIES[:4])
        seen[world] = results[0]["sd"]
        sd_in = seen[world]
    for f in FAMILIES[:4]:
        original = _build(f, seed=1).state_dict()
        for world in (2, 4, 1):
            assert _equal_dicts(seen[world][f], original), f"{f}: the checkpoint gathered on {world} ranks differs"


def test_unsupported_block_is_named():
    import transformers as tf

    cfg = tf.OlmoeConfig(**ATTN, num_key_value_heads=4, intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    model = tf.OlmoeForCausalLM(cfg)
    with pytest.raises(ValueError, match="OlmoeSparseMoeBlock") as e:
        hf.expert_parallel(model)
    assert "MixtralSparseMoeBlock" in str(e.value)  # and what is supported
    with pytest.raises(ValueError, match="no sparse MoE block"):
        hf.expert_parallel(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="a2a-bits"):
        hf.expert_parallel(_build("mixtral", seed=1), a2a_bits=4)
    with pytest.raises(ValueError, match="chunks"):
        hf.expert_parallel(_build("mixtral", seed=1), chunks=0)


def test_without_transformers_the_import_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "commsched.moe.hf")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ImportError, match=r"pip install commsched\[hf\]"):
        import commsched.moe.hf  # noqa: F401


def test_misuse_in_one_process_is_one_clear_error():
    model = hf.expert_parallel(_build("mixtral", seed=1))
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp is already expert-parallel; "
                                         r"model\.layers\.1\.mlp is already expert-parallel$"):
        hf.expert_parallel(model)  # twice on one model
    for call in (lambda: hf.expert_parallel(_build("mixtral", seed=1), group=object()),
                 lambda: hf.gather_state_dict(model, group=object())):
        with pytest.raises(ValueError, match="a process group was given but torch.distributed is not initialised"):
            call()
    sd = _build("mixtral", seed=1).state_dict()
    key = "model.layers.0.mlp.experts.gate_up_proj"
    with pytest.raises(ValueError, match=rf"^{key} in the state dict has shape \(7, 32, 32\), the model's "
                                         r"experts need \(8, 32, 32\)"):
        hf.load_state_dict(model, {**sd, key: sd[key][:-1]})  # one expert short
    with pytest.raises(TypeError, match="expert_parallel takes a transformers model .*got str"):
        hf.expert_parallel("mixtral")
    with pytest.raises(ValueError, match="chunks must be a positive integer, got -1"):
        hf.expert_parallel(_build("mixtral", seed=1), chunks=-1)


def _foreign_group(rank: int, world: int) -> str:
    """Experts split over a one-rank group, gathered over the world: refused on every rank
    before any collective (no hang)."""
    import torch.distributed as dist

    mine = [dist.new_group([r]) for r in range(world)][rank]
    model = hf.expert_parallel(_build("mixtral", seed=1), group=mine)
    with pytest.raises(ValueError) as e:
        hf.gather_state_dict(model)
    return str(e.value)


@pytest.mark.slow
def test_gathering_over_a_group_that_is_not_the_models_is_refused_on_every_rank():
    for msg in run_ranks(2, _foreign_group, timeout_s=120):
        assert msg == "model.layers.0.mlp.experts is expert-parallel over 1 ranks, the group given has 2", msg


# ---------------------------------------------------------------- training under LinaDDP
STEPS, LR = 3, 0.1  # plain SGD: a gradient of the wrong scale or sum changes the next loss and every parameter


def _train_reference(world: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """One process, every expert: each step the ranks' batches in turn (each loss / world),
    then one SGD step. The per-step per-rank losses and the trained parameters."""
    model = _build("mixtral", seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        per_rank = []
        for r in range(world):
            ids = _batch(r)  # each rank its own batch, the same every step
            loss = model(input_ids=ids, labels=ids).loss
            (loss / world).backward()
            per_rank.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(per_rank)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_lina_ddp(rank: int, world: int) -> dict:
    """The same training, expert-parallel over the world and wrapped in LinaDDP under Lina's
    schedule (small buckets and micro-ops: several of each per step). Per step this rank's
    loss; after the steps the non-expert parameters (this rank's replica) and every expert
    (gathered)."""
    import torch.distributed as dist

    from commsched.comm.observe import A2AEvents
    from commsched.priority import LinaConfig, LinaDDP

    events = A2AEvents()
    model = hf.expert_parallel(_build("mixtral", seed=3), observer=events)
    ddp = LinaDDP(model, schedule=LinaConfig(fallback_probes=0, microop_bytes=4096), events=events,
                  bucket_cap_mb=0.02)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    losses = []
    try:
        for _ in range(STEPS):
            ids = _batch(rank)
            loss = ddp(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
    finally:
        ddp.close()
    replica = {n: p.detach().clone() for n, p in model.named_parameters() if not is_expert_param(p)}
    experts = hf.gather_state_dict(model)
    if experts is not None:
        experts = {k: v for k, v in experts.items() if k.endswith(hf.EXPERT_PARAMS)}
    flat = torch.cat([p.flatten() for p in replica.values()])
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat)
    return {"losses": losses, "replica": replica, "experts": experts,
            "replicas_identical": all(torch.equal(parts[0], x) for x in parts[1:])}


@pytest.mark.slow
def test_lina_ddp_trains_the_expert_parallel_mixtral_as_one_process():
    world = 2
    ref_losses, ref_params = _train_reference(world)
    assert sum(ref_losses[-1]) < sum(ref_losses[0])  # it trains
    results = run_ranks(world, _train_lina_ddp, timeout_s=180)
    init = _build("mixtral", seed=3).state_dict()
    for rank, res in enumerate(results):
        assert res["replicas_identical"], rank
        for step, (loss, ref) in enumerate(zip(res["losses"], ref_losses)):
            assert _excess(loss, ref[rank]) <= 0.0, (rank, step, loss, ref[rank])
        assert res["replica"].keys() == {n for n in ref_params if not n.endswith(hf.EXPERT_PARAMS)}
        for n, p in res["replica"].items():
            assert _excess(p, ref_params[n]) <= 0.0, (rank, n, float((p - ref_params[n]).abs().max()))
            assert not torch.equal(p, init[n]), n  # every parameter was trained
    experts = results[0]["experts"]
    assert len(experts) == 4  # 2 layers x (gate_up_proj, down_proj)
    for n, p in experts.items():
        assert _excess(p, ref_params[n]) <= 0.0, (n, float((p - ref_params[n]).abs().max()))
