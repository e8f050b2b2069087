"""`--dataset self` text written by the streamed model (quantkit/data/self_generated.py): one decoder layer
resident, the same tokens as transformers' whole model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.data import self_generated
from quantkit.data.self_generated import streamed_model
from tests.conftest import make_tiny_model

IDS = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe", "deepseek_v3"])
def test_streamed_model_generates_what_the_whole_model_does_one_layer_at_a_time(tiny_models, tmp_path, family):
    # Gemma 2: logit soft-capping, which sdpa refuses, and sliding-window layers (the model's forward reads each
    # layer's attention_type); Qwen3-MoE: fused experts on disk; DeepSeek-V3: MLA attention.
    path = make_tiny_model(tmp_path / family, family) if family == "gemma2" else tiny_models[family]
    whole = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    streamed = streamed_model(path, torch.bfloat16)
    sample = dict(do_sample=True, top_p=0.95, top_k=0, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    with torch.no_grad():
        a, b = whole(IDS).logits, streamed(IDS).logits
        torch.manual_seed(3)
        want = whole.generate(IDS, **sample)
        torch.manual_seed(3)
        got = streamed.generate(IDS, **sample)
    if family in ("qwen3_moe", "deepseek_v3"):  # experts run one linear each, as calibration runs them: bf16 rounding
        torch.testing.assert_close(b.float(), a.float(), atol=0.02, rtol=0)
    else:
        assert torch.equal(a, b)
    assert torch.equal(got, want)
    assert streamed.streamed_peak() == 1
    # Between calls no decoder layer holds a tensor: only embeddings, norm and head were read.
    held = sum(p.numel() for p in streamed.parameters() if not p.is_meta)
    outside = sum(p.numel() for n, p in whole.named_parameters() if ".layers." not in n)
    assert held <= outside


def test_self_blocks_come_from_the_streamed_model(tiny_models, tmp_path, monkeypatch):
    calls = []
    real = self_generated.streamed_model

    def spy(path, dtype):
        calls.append(path)
        return real(path, dtype)

    monkeypatch.setattr(self_generated, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(self_generated, "streamed_model", spy)
    ids = self_generated.generate_blocks(tiny_models["llama"], 3, 24, seed=7, batch_size=2)
    assert ids.shape == (3, 24) and len(calls) == 1
