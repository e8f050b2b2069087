"""`quantkit eval --moe` and its parts: capacity rule, bias balancing, drift, the routing profile."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.eval.moe import (BiasState, apply_capacity, bias_balancing, capacity, topk_overlap)
from quantkit.models.moe import RouterSpec
from quantkit.models.routing_profile import PROFILE, RoutingProfile, read_profile
from quantkit.runtime.moe import combine_weights, route

runner = CliRunner()


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("policy", ["drop", "reroute"])
def test_capacity_rule_never_lets_an_expert_exceed_c(policy):
    """Property test over random routings, skewed so that overflow really happens."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        t = int(torch.randint(1, 200, (1,), generator=gen))
        e = int(torch.randint(2, 17, (1,), generator=gen))
        k = int(torch.randint(1, e + 1, (1,), generator=gen))
        skew = torch.linspace(0, 3 * float(torch.rand(1, generator=gen)), e)
        choice = torch.randn(t, e, generator=gen) + skew
        selected = choice.topk(k, dim=1).indices
        gamma = float(torch.rand(1, generator=gen)) * 2 + 0.3
        cap = capacity(gamma, t, k, e)
        new = apply_capacity(selected, choice, cap, policy)
        kept = new[new >= 0]
        assert torch.bincount(kept, minlength=e).max() <= cap, (trial, cap)
        # No token holds an expert twice; a slot either keeps its expert, is dropped or (reroute) moves.
        for row in new:
            real = row[row >= 0]
            assert real.unique().numel() == real.numel()
        unchanged = (new == selected) | (new < 0)
        if policy == "drop":
            assert unchanged.all()
        # Nothing is dropped while its expert had room: the total kept is min(slots, what fits).
        if policy == "drop":
            counts = torch.bincount(selected.reshape(-1), minlength=e)
            assert kept.numel() == int(counts.clamp(max=cap).sum())
        else:
            assert kept.numel() >= int(torch.bincount(selected.reshape(-1), minlength=e).clamp(max=cap).sum())


def test_capacity_drop_keeps_the_best_scored_slots():
    choice = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3]])
    selected = torch.tensor([[0], [0], [0]])
    assert apply_capacity(selected, choice, 2, "drop").tolist() == [[0], [0], [-1]]
    assert apply_capacity(selected, choice, 2, "reroute").tolist() == [[0], [0], [1]]


def test_bias_balancing_changes_selection_but_not_combine_weights():
    """A hand-built sigmoid router in which expert 0 wins every token by a small margin."""
    spec = RouterSpec(num_experts=4, top_k=1, scoring="sigmoid", routed_scaling_factor=2.0)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(512, 4, generator=gen) * 0.05
    logits[:, 0] += 0.3
    routing = route(spec, logits)
    assert (routing.selected == 0).all()
    state = BiasState(rate=0.5, step_tokens=32)
    new = bias_balancing(state)(0, routing, torch.zeros(512, 8))
    assert (new.selected != 0).any(), "the bias never moved a choice"
    load = torch.bincount(new.selected.reshape(-1), minlength=4)
    assert load.max() < 512 * 0.6  # balance improved from 512 on one expert
    # Combine weights: the family rule on the unbiased scores of the experts now selected.
    torch.testing.assert_close(new.weights, 2.0 * routing.scores.gather(1, new.selected))
    torch.testing.assert_close(new.weights, combine_weights(spec, routing.scores, new.selected))
    assert state.bias[0].abs().max() > 0 and torch.equal(new.scores, routing.scores)


def test_topk_overlap_counts_shared_experts_per_token():
    a = torch.tensor([[0, 1], [2, 3]])
    b = torch.tensor([[1, 0], [2, 0]])
    assert topk_overlap(a, b, 4).tolist() == [1.0, 0.5]


@pytest.fixture(scope="module")
def moe_ckpt(tiny_models, tmp_path_factory):
    """RTN W4A16 of the tiny Qwen2-MoE, calibrated in fp32 so the runtime recount sees the same numbers."""
    from quantkit.pipeline.engine import quantize_model
    from quantkit.recipe import Recipe

    out = tmp_path_factory.mktemp("moeq") / "q"
    r = Recipe()
    r.model.source = str(tiny_models["qwen2_moe"])
    r.quantization.method, r.quantization.scheme, r.quantization.group_size = "gptq", "W4A16", 32
    r.calibration.num_samples, r.calibration.seq_len = 4, 32
    summary = quantize_model(r, out, compute_dtype="float32")
    assert summary.get("routing_profile") == PROFILE
    return out


def test_routing_profile_counts_equal_a_plain_recount(moe_ckpt, tiny_models):
    from transformers import AutoTokenizer

    from quantkit.data.calibration import build_token_blocks
    from quantkit.runtime import load_model
    from quantkit.runtime.moe import observe_routing

    profile = read_profile(moe_ckpt)
    assert profile is not None and profile.num_experts == 4 and profile.top_k == 2
    tok = AutoTokenizer.from_pretrained(str(tiny_models["qwen2_moe"]))
    ids = build_token_blocks(tok, "kjv", 4, 32, 42).input_ids
    recount = RoutingProfile(4, 2)
    rt = load_model(moe_ckpt, "float32")
    with observe_routing(rt.model, recount.observer()), torch.no_grad():
        rt(input_ids=ids, use_cache=False)
    assert sorted(profile.layers) == sorted(recount.layers) == [0, 1]
    for layer, c in recount.layers.items():
        assert profile.layers[layer].tokens == c.tokens == ids.numel()
        assert profile.layers[layer].counts.tolist() == c.counts.tolist()
        assert profile.layers[layer].coactivation.tolist() == c.coactivation.tolist()
        assert int(c.counts.sum()) == 2 * ids.numel()
    # The profile is part of the checkpoint: the manifest hashes it.
    manifest = json.loads((moe_ckpt / "quantkit_manifest.json").read_text())
    assert PROFILE in json.dumps(manifest)


def test_moe_on_a_dense_model_is_one_line_exit_2(tiny_models):
    result = runner.invoke(app, ["eval", str(tiny_models["llama"]), "--baseline", str(tiny_models["llama"]),
                                 "--moe", "--num-samples", "2", "--seq-len", "16"])
    assert result.exit_code == 2
    err = result.stderr.strip()
    assert err.count("\n") == 0 and "dense model" in err and "Traceback" not in result.output


def test_offload_cache_outside_k_to_e_is_refused_with_the_range(moe_ckpt, tiny_models):
    for n in ("1", "5"):
        result = runner.invoke(app, ["eval", str(moe_ckpt), "--baseline", str(tiny_models["qwen2_moe"]), "--moe",
                                     "--offload-cache", n, "--num-samples", "2", "--seq-len", "16"])
        assert result.exit_code == 2 and "2..4" in result.stderr and result.stderr.strip().count("\n") == 0


def test_eval_moe_json(moe_ckpt, tiny_models, tmp_path, monkeypatch):
    import tempfile

    from quantkit.runtime import offload

    scratch, mkstemp = [], tempfile.mkstemp
    monkeypatch.setattr(offload.tempfile, "mkstemp", lambda **kw: scratch.append(kw["dir"]) or mkstemp(**kw))
    result = runner.invoke(app, ["eval", str(moe_ckpt), str(tiny_models["qwen2_moe"]), "--baseline",
                                 str(tiny_models["qwen2_moe"]), "--moe", "--json", "--num-samples", "4",
                                 "--seq-len", "24", "--moe-samples", "2", "--batch-size", "2",
                                 "--compute-dtype", "float32", "--offload-scratch", str(tmp_path)],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    # The quantised checkpoint's offload runs keep their kernel tensors where --offload-scratch says.
    assert scratch and set(scratch) == {str(tmp_path)}
    report = json.loads(result.stdout)
    q, same = (r["moe"] for r in report["results"])
    for m in (q, same):
        assert set(m) >= {"routing_topk_overlap", "max_over_mean_load", "capacity", "offload"}
        assert {(c["gamma"], c["policy"]) for c in m["capacity"]} >= {(1.25, "drop"), (2.0, "reroute")}
        assert all(c["over_capacity_calls"] == 0 for c in m["capacity"])
        assert len(m["layers"]) == 2 and all(abs(sum(r["load"]) - 1) < 1e-3 for r in m["layers"])
        assert m["max_over_mean_load"] >= 1.0
        # Offload runs at the default cache of E/2: every policy decodes exactly the resident logits.
        runs = {o["policy"]: o for o in m["offload"]}
        assert set(runs) == {"resident", "lru", "lfu", "trace", "lru+prefetch", "lru+prefetch-sync",
                             "trace+prefetch"}
        assert all(o["exact"] for o in m["offload"]) and runs["lru"]["cache"] == 2
        assert 0 <= runs["lru"]["hit_rate"] <= 1 and runs["lru+prefetch"]["prefetch_fidelity"] is not None
    # The baseline against itself: identical routing; the quantised checkpoint drifts somewhat.
    assert same["routing_topk_overlap"] == 1.0
    assert 0.5 < q["routing_topk_overlap"] <= 1.0
    drop = {c["gamma"]: c for c in same["capacity"] if c["policy"] == "drop"}
    assert drop[1.0]["max_load_reduction"] >= drop[2.0]["max_load_reduction"] >= 0


def test_eval_moe_report_has_tables_and_load_png(moe_ckpt, tiny_models, tmp_path):
    result = runner.invoke(app, ["eval", str(moe_ckpt), "--baseline", str(tiny_models["qwen2_moe"]), "--moe",
                                 "--num-samples", "2", "--seq-len", "16", "--moe-samples", "1",
                                 "--report", str(tmp_path / "rep")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## MoE routing" in md and "Capacity-aware" in md
    assert (tmp_path / "rep" / "moe_load_0.png").stat().st_size > 1000
    assert "routing top-k overlap" in " ".join(result.stdout.split())


def test_offload_scratch_is_checked_in_one_line(moe_ckpt, tiny_models, tmp_path):
    args = ["eval", str(moe_ckpt), "--baseline", str(tiny_models["qwen2_moe"]), "--num-samples", "2", "--seq-len", "16"]
    missing = runner.invoke(app, [*args, "--moe", "--offload-scratch", str(tmp_path / "missing")])
    assert missing.exit_code == 2 and "--offload-scratch" in missing.stderr and "not a folder" in missing.stderr
    assert missing.stderr.strip().count("\n") == 0
    alone = runner.invoke(app, [*args, "--offload-scratch", str(tmp_path)])
    assert alone.exit_code == 2 and "--offload-scratch needs --moe" in alone.stderr
