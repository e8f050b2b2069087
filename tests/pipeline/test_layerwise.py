"""Streaming one layer at a time must compute exactly what the full transformers model computes."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.models.loader import open_model
from quantkit.models.source import resolve_model
from quantkit.pipeline.reference import layerwise_logits

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_layerwise_matches_full_model(tiny_models, family):
    path = tiny_models[family]
    handle = open_model(resolve_model(str(path)))
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    streamed = layerwise_logits(handle, ids, batch_size=2)
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = full(ids).logits
    torch.testing.assert_close(streamed, expected, rtol=1e-5, atol=1e-5)


def test_unfused_experts_see_all_tokens_in_calibration_mode(tiny_models):
    """With calibrate_all_experts every expert's linears see every token, but the output is unchanged."""
    handle = open_model(resolve_model(str(tiny_models["mixtral"])))
    layer = handle.materialize_layer(0)
    experts = layer.mlp.experts
    seen = {}
    for e, expert in enumerate(experts.experts):
        expert.w1.register_forward_hook(lambda m, i, o, e=e: seen.__setitem__(e, seen.get(e, 0) + i[0].shape[0]))
    x = torch.randn(1, 10, 64)
    with torch.no_grad():
        routed = layer.mlp(x)
        seen.clear()
        experts.calibrate_all_experts = True
        calibrated = layer.mlp(x)
    assert seen == {e: 10 for e in range(4)}
    torch.testing.assert_close(routed, calibrated)
