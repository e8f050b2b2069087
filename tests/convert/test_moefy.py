"""MoEfication (quantkit/convert/moefy.py): the split, the router, the checkpoint, and benchmarks/make_moe.py.

Oracles: at top-k = E every expert runs, so the MoE must compute the dense MLP. The combine weights are the
low-temperature router's, constant to 2^-10 relative; the tolerance below follows from that bound (a wrong
split, scale or missing shared expert moves the logits by orders of magnitude more, as the broken-scale
case shows). With the router zeroed the combine is exactly constant and the match is to rounding.
"""

from __future__ import annotations

import json

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from quantkit.convert.moefy import (MoEfyOptions, balanced_assign, balanced_kmeans, evaluate_moe, moefy_model,
                                    qwen3_norm_regime)
from quantkit.errors import InputError
from tests.conftest import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
CASES = [("qwen3_moe", 0, "llama"), ("qwen2_moe", 1, "llama"), ("deepseek_v3", 1, "deepseek_dense")]


@pytest.fixture(scope="module")
def sources(tiny_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moefy_src")
    return {"llama": tiny_models["llama"],
            # A dense DeepSeek-V3 (MLA attention, every layer dense): what convert-mla writes.
            "deepseek_dense": make_tiny_model(root / "ds_dense", "deepseek_v3", first_k_dense_replace=2)}


def _moefy(src, out, layout, shared, k, **kw) -> Path:
    opts = MoEfyOptions(experts=4, top_k=k, shared_experts=shared, layout=layout, **kw)
    moefy_model(src, out, opts, num_samples=6, seq_len=48, overwrite=True)
    return out


def _logits(path, ids):
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits


IDS = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("layout,shared,src", CASES)
def test_top_k_equal_to_experts_is_the_dense_model_in_transformers(sources, tmp_path, layout, shared, src):
    moe = _moefy(sources[src], tmp_path / "moe", layout, shared, k=4)
    dense, got = _logits(sources[src], IDS), _logits(moe, IDS)
    # Combine weights within 2^-10 of constant: the MLP outputs, and so the logits, within ~1e-3 relative.
    scale = dense.abs().max().item()
    assert (got - dense).abs().max().item() < 2e-3 * scale

    # With the router zeroed every combine weight is exactly 1/E (softmax) or 1/2 (sigmoid): exact to rounding.
    t = load_file(str(moe / "model.safetensors"))
    for name in t:
        if name.endswith("mlp.gate.weight"):
            t[name] = torch.zeros_like(t[name])
    save_file(t, str(moe / "model.safetensors"), metadata={"format": "pt"})
    torch.testing.assert_close(_logits(moe, IDS), dense, atol=1e-5, rtol=1e-5)

    # The oracle can fail: drop the E-fold (Qwen) / shared-expert (DeepSeek) compensation of one layer.
    name = "model.layers.1.mlp." + ("shared_experts" if layout == "deepseek_v3" else "experts.0") + ".down_proj.weight"
    t[name] = t[name] * 0.5
    save_file(t, str(moe / "model.safetensors"), metadata={"format": "pt"})
    assert (_logits(moe, IDS) - dense).abs().max().item() > 1e-2 * scale


@pytest.mark.parametrize("layout,shared,src", CASES)
def test_written_moe_loads_with_the_layout_and_routes_with_signal(sources, tmp_path, layout, shared, src):
    import json

    moe = _moefy(sources[src], tmp_path / "moe", layout, shared, k=2)
    cfg = json.loads((moe / "config.json").read_text())
    assert cfg["model_type"] == layout and cfg["num_experts_per_tok"] == 2 and cfg["norm_topk_prob"] is False
    model = AutoModelForCausalLM.from_pretrained(moe)
    assert type(model).__name__ == cfg["architectures"][0]
    t = load_file(str(moe / "model.safetensors"))
    if layout == "deepseek_v3":
        assert torch.equal(t["model.layers.0.mlp.gate.e_score_correction_bias"], torch.zeros(4))
        assert "model.layers.0.mlp.shared_experts.gate_proj.weight" in t
    if layout == "qwen2_moe":
        assert "model.layers.0.mlp.shared_expert.up_proj.weight" in t
        # vLLM builds Qwen2-MoE's q/k/v biases whatever qkv_bias says: they are written, as zeros (and the top-4
        # run below still equals the dense source, which has none).
        assert cfg["qkv_bias"] is True
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert not t[f"model.layers.0.self_attn.{proj}.bias"].any()
    report = evaluate_moe(sources[src], moe, [1, 2, 4], num_samples=4, seq_len=48)
    runs = report["runs"]
    assert runs["top4"]["kl"] < 1e-8  # every expert: the dense model
    assert runs["top1"]["kl"] > runs["top2"]["kl"] > runs["top4"]["kl"]
    # The router beats random routing of the same experts at the same k.
    assert runs["top2"]["kl"] < 0.8 * runs["random2"]["kl"]


def test_balanced_assign_fills_every_cluster_exactly():
    gen = torch.Generator().manual_seed(1)
    for n, c in ((12, 3), (64, 8), (40, 40)):
        sim = torch.randn(n, c, generator=gen)
        sim[:, 0] += 5  # everyone prefers cluster 0
        assign = balanced_assign(sim, n // c)
        assert torch.bincount(assign, minlength=c).tolist() == [n // c] * c
    with pytest.raises(ValueError):
        balanced_assign(torch.zeros(10, 3), 3)


def test_balanced_kmeans_recovers_planted_co_activation_groups():
    """Neurons of one planted group fire on the same tokens; the clustering must put them together."""
    gen = torch.Generator().manual_seed(2)
    groups, per, tokens = 4, 16, 400
    owner = torch.randint(0, groups, (tokens,), generator=gen)
    truth = torch.arange(groups).repeat_interleave(per)
    perm = torch.randperm(groups * per, generator=gen)
    truth = truth[perm]
    act = (owner[None, :] == truth[:, None]).float() * 2 + torch.rand(groups * per, tokens, generator=gen) * 0.3
    assign = balanced_kmeans(act, groups, iters=20, seed=0)
    for g in range(groups):
        assert len(set(assign[truth == g].tolist())) == 1, "a planted group was split"
    assert torch.bincount(assign).tolist() == [per] * groups


def test_qwen3_norm_regime_keeps_q_dot_k():
    eps = 1e-5
    sq, sk, wq, wk = qwen3_norm_regime(30.0, 50.0, eps, torch.bfloat16)
    assert sq * sq * 30.0 <= 1e-6 * eps and sk * sk * 50.0 <= 1e-6 * eps
    for v in (sq, sk):  # powers of two: q_proj * s is exact in bf16
        assert v == 2.0 ** round(torch.log2(torch.tensor(v)).item())
    for w in (wq, wk):
        assert torch.tensor(w, dtype=torch.bfloat16).item() == w
    # q.k after both norms: (s_q w_q / sqrt(eps)) (s_k w_k / sqrt(eps)) = 1 to far better than one bf16 ulp.
    assert abs(sq * wq * sk * wk / eps - 1) < 2e-4


def test_bad_options_and_sources_are_refused(sources, tiny_models, tmp_path):
    with pytest.raises(InputError, match="top-k"):
        MoEfyOptions(experts=4, top_k=5).check()
    with pytest.raises(InputError, match="no shared experts"):
        MoEfyOptions(experts=4, top_k=2, shared_experts=1, layout="qwen3_moe").check()
    with pytest.raises(InputError, match="always has a shared expert"):
        MoEfyOptions(experts=4, top_k=2, layout="deepseek_v3").check()
    with pytest.raises(InputError, match="convert-mla"):
        moefy_model(sources["llama"], tmp_path / "x", MoEfyOptions(4, 2, 1, layout="deepseek_v3"),
                    num_samples=2, seq_len=16)
    with pytest.raises(InputError, match="already a MoE"):
        moefy_model(tiny_models["mixtral"], tmp_path / "y", MoEfyOptions(4, 2), num_samples=2, seq_len=16)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_make_moe_script_bad_input_is_one_line_exit_2(sources, tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "make_moe.py"), "--model", str(sources["llama"]),
           "--experts", "4", "--top-k", "9", "--output", str(tmp_path / "o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "--top-k" in proc.stderr


def test_moefy_command_ships_with_the_package(tiny_models, tmp_path):
    """`quantkit moefy` (no benchmarks/ script needed): writes a MoE transformers loads, reports its KL."""
    from typer.testing import CliRunner
    from transformers import AutoConfig

    from quantkit.cli import app

    out = tmp_path / "moe"
    result = CliRunner().invoke(app, ["moefy", "--model", str(tiny_models["llama"]), "--experts", "4", "--top-k", "2",
                                      "--num-samples", "4", "--seq-len", "32", "--eval-samples", "2",
                                      "--local-steps", "0", "--distill-steps", "0", "--output", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == "qwen3_moe" and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    runs = summary["eval"]["runs"]
    assert runs["top4"]["kl"] < runs["random2"]["kl"]  # all experts on = the dense MLP, far from random routing
    assert "distillation" not in summary and cfg.norm_topk_prob is False  # the exact split
    # The default distils: normal-temperature router, normalised weights, a fit report.
    result = CliRunner().invoke(app, ["moefy", "--model", str(tiny_models["llama"]), "--experts", "4", "--top-k", "2",
                                      "--num-samples", "8", "--seq-len", "32", "--eval-samples", "2",
                                      "--local-steps", "5", "--distill-steps", "2", "--output", str(tmp_path / "d"),
                                      "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert AutoConfig.from_pretrained(tmp_path / "d").norm_topk_prob is True
    assert [h["step"] for h in summary["distillation"]["heldout_kl"]][::2] == [0, 2]  # every quarter, and the end
    assert 0 <= summary["eval"]["routing_overlap_bf16_fp32"] <= 1
    bad = CliRunner().invoke(app, ["moefy", "--model", str(tiny_models["llama"]), "--experts", "4", "--top-k", "9",
                                   "--output", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "--top-k must be within 1..4" in bad.stderr and not (tmp_path / "bad").exists()


VLLM_PYTHON = __import__("os").environ.get("QUANTKIT_VLLM_PYTHON")


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON, reason="set QUANTKIT_VLLM_PYTHON to an interpreter with vLLM")
def test_qwen2_moe_with_shared_experts_serves_in_vllm_as_in_the_runtime(tmp_path):
    """SmolLM2 split into a Qwen2-MoE with shared experts, every expert routed (the dense model whatever the
    routing's rounding): vLLM's CPU build scores the NLL quantkit's runtime does. Without the written zero q/k/v
    biases vLLM left its own uninitialised and every log-probability was NaN."""
    import math

    from quantkit.eval.runner import EvalOptions, run_eval

    moe = tmp_path / "moe"
    moefy_model(None, moe, MoEfyOptions(experts=4, top_k=4, shared_experts=2, layout="qwen2_moe"), num_samples=8,
                seq_len=64, overwrite=True)
    common = dict(checkpoints=[moe], baseline=str(moe), num_samples=4, seq_len=128)
    own = run_eval(EvalOptions(**common, dtype="bfloat16")).report["results"][0]
    served = run_eval(EvalOptions(**common, engine="vllm", vllm_python=VLLM_PYTHON)).report["results"][0]
    assert math.isfinite(served["ppl"])
    assert abs(math.log(served["ppl"]) - math.log(own["ppl"])) < 0.02
