"""Distilled MoEfication (quantkit/convert/moe_distill.py through moefy_model).

Oracles: the student's routing is the runtime's `route`, so a student built with the exact split's
constant combine must compute the exact split (which the moefy tests tie to the dense MLP); the checkpoint a
distillation writes is scored independently by transformers on the blocks the distillation held out, and must
show the held-out KL the distillation reported (the writer kept what was fitted, in the layout's semantics);
and the fits must lower what they minimise.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantkit.convert.moe_distill import DistillOptions, StudentMoE, fit_local, unit_spread
from quantkit.convert.moefy import MoEfyOptions, _layout_spec, expert_size, moe_config, moefy_layer, moefy_model
from quantkit.errors import InputError
from tests.conftest import make_tiny_model

LAYOUTS = [("qwen3_moe", 0, "llama"), ("qwen2_moe", 1, "llama"), ("deepseek_v3", 1, "deepseek_dense")]
EXACT = DistillOptions(local_steps=30, steps=6, batch_size=2, batch_tokens=256, lr=1e-3, bf16=False)
# End to end only, from the raw split (far from the dense model), in fp32: the fit has something to lower.
END_TO_END = DistillOptions(local_steps=0, steps=12, batch_size=2, lr=3e-3, bf16=False)


def _loud_mlps(path):
    """The tiny models' random MLPs barely move the logits; scaled up, splitting them costs real KL."""
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("gate_proj", "up_proj"):
                getattr(layer.mlp, name).weight.mul_(4.0)
            layer.mlp.down_proj.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_src")
    return {"llama": _loud_mlps(make_tiny_model(root / "llama", "llama")),
            "deepseek_dense": _loud_mlps(make_tiny_model(root / "ds_dense", "deepseek_v3", first_k_dense_replace=2))}


def _kl(dense_logits, moe_logits) -> float:
    lt, ls = torch.log_softmax(dense_logits.double(), -1), torch.log_softmax(moe_logits.double(), -1)
    return float((lt.exp() * (lt - ls)).sum(-1).mean())


@pytest.mark.parametrize("layout,shared,src", LAYOUTS)
def test_written_checkpoint_scores_the_heldout_kl_the_distillation_reported(sources, tmp_path, layout, shared, src):
    from quantkit.data.calibration import build_token_blocks

    opts = MoEfyOptions(experts=4, top_k=1, shared_experts=shared, layout=layout, distill=END_TO_END)
    out = tmp_path / "moe"
    summary = moefy_model(sources[src], out, opts, num_samples=8, seq_len=32, overwrite=True)
    history = summary["distillation"]["heldout_kl"]
    assert history[-1]["heldout_kl"] < history[0]["heldout_kl"]  # the end-to-end fit lowers its objective
    cfg = AutoModelForCausalLM.from_pretrained(out).config
    assert cfg.norm_topk_prob is True
    # The distillation held out the last eighth of its calibration blocks: score exactly those in transformers.
    tok = AutoTokenizer.from_pretrained(sources[src])
    ids = build_token_blocks(tok, "kjv", 8, 32, 42, split="calibration").input_ids[7:]
    with torch.no_grad():
        dense = AutoModelForCausalLM.from_pretrained(sources[src]).eval()(ids).logits
        moe = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    assert _kl(dense, moe) == pytest.approx(history[-1]["heldout_kl"], rel=1e-3, abs=1e-6)


def test_student_with_the_exact_combine_computes_the_exact_split():
    """The masked all-expert student under the runtime's routing = the sum of the selected experts' outputs,
    checked against a plain per-token loop over the selection."""
    torch.manual_seed(0)
    h, inter, e, k = 16, 32, 4, 2
    x = torch.randn(64, h)
    gate, up, down = torch.randn(inter, h), torch.randn(inter, h), torch.randn(h, inter)
    opts = MoEfyOptions(experts=e, top_k=k, layout="qwen3_moe", distill=EXACT)
    split = moefy_layer(x, gate, up, down, torch.nn.SiLU(), opts)
    cfg = moe_config({"vocab_size": 32, "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_act": "silu"}, opts,
                     expert_size(inter, opts))
    spec = _layout_spec("qwen3_moe", cfg)
    student = StudentMoE(spec, torch.nn.SiLU(), replace(split, router=unit_spread(split.router_fit, x, 1.0)))
    with torch.no_grad():
        got = student(x)
        r = student.routing(x)
        want = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for slot in range(k):
                j = int(r.selected[t, slot])
                y = split.down[j] @ (torch.nn.functional.silu(split.gate[j] @ x[t]) * (split.up[j] @ x[t]))
                want[t] += r.weights[t, slot] * y
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Normalised top-k weights: each token's weights sum to one (norm_topk_prob, as the config says).
    torch.testing.assert_close(r.weights.sum(1), torch.ones(x.shape[0]))


def test_local_fit_reduces_a_layers_error_from_a_bad_start():
    torch.manual_seed(1)
    h, inter = 16, 64
    x = torch.randn(4096, h)
    gate, up, down = torch.randn(inter, h) / 4, torch.randn(inter, h) / 4, torch.randn(h, inter) / 8
    y = torch.nn.functional.linear(torch.nn.functional.silu(x @ gate.T) * (x @ up.T), down)
    opts = MoEfyOptions(experts=4, top_k=1, layout="qwen3_moe")
    split = moefy_layer(x, gate, up, down, torch.nn.SiLU(), opts)
    cfg = moe_config({"vocab_size": 32, "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_act": "silu"},
                     MoEfyOptions(experts=4, top_k=1, distill=EXACT), expert_size(inter, opts))
    student = StudentMoE(_layout_spec("qwen3_moe", cfg), torch.nn.SiLU(),
                         replace(split, router=unit_spread(split.router_fit, x, 1.0)))
    report = fit_local(student, x, y, DistillOptions(local_steps=200, batch_tokens=512, lr_local=1e-2, bf16=False),
                       torch.Generator().manual_seed(0))
    assert report["relative_error_after"] < 0.75 * report["relative_error_before"]


def test_bad_distillation_options_are_refused():
    with pytest.raises(InputError, match="steps"):
        MoEfyOptions(experts=4, top_k=2, distill=DistillOptions(local_steps=-1)).check()
    with pytest.raises(InputError, match="spread"):
        MoEfyOptions(experts=4, top_k=2, distill=DistillOptions(logit_std=0)).check()
