"""The calibration forwards' blocked causal attention against a float64 softmax(QK^T)V written here and against
transformers' own SDPA path, and the models it is (and is not) switched on for."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from quantkit.pipeline.attention import (BLOCKED, LONGEST, QUERY_BLOCK, blocked_sdpa_forward,
                                        use_blocked_attention)


def _reference(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d) + causal) v in float64, key/value heads repeated for grouped queries."""
    rep = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(rep, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[2]
    allowed = torch.ones(n, n, dtype=torch.bool).tril() if mask is None else mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


class _Module(nn.Module):
    is_causal = True

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("n", [2 * QUERY_BLOCK, 2 * QUERY_BLOCK + 37, 4 * QUERY_BLOCK])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_blocked_equals_float64_causal_attention(n, heads, kv_heads):
    torch.manual_seed(n + heads)
    q = torch.randn(2, heads, n, 32) * 2  # scores of several units: a softmax far from uniform
    k, v = torch.randn(2, kv_heads, n, 32) * 2, torch.randn(2, kv_heads, n, 32)
    out, weights = blocked_sdpa_forward(_Module(heads // kv_heads), q, k, v, None, scaling=32 ** -0.5)
    assert weights is None and out.shape == (2, n, heads, 32)
    torch.testing.assert_close(out.double(), _reference(q, k, v), atol=2e-5, rtol=1e-4)


def test_blocked_matches_transformers_sdpa_in_bfloat16():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(1)
    n = 3 * QUERY_BLOCK
    q = torch.randn(1, 6, n, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, n, 64, dtype=torch.bfloat16) for _ in range(2))
    module = _Module(3)
    ours, _ = blocked_sdpa_forward(module, q, k, v, None)
    theirs, _ = sdpa_attention_forward(module, q, k, v, None)
    ref = _reference(q, k, v).to(torch.bfloat16)
    # Both round to bf16 once from fp32 accumulations: within an ulp or two of the float64 result and of each other.
    assert (ours.float() - ref.float()).abs().max() <= 2 * (theirs.float() - ref.float()).abs().max() + 1e-2
    torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)


def test_what_it_does_not_handle_goes_to_sdpa_unchanged():
    """An explicit mask (padding, sliding windows), a short or long sequence, or cached keys: transformers' SDPA
    result, bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(2)
    n = 2 * QUERY_BLOCK
    q, k, v = (torch.randn(1, 2, n, 16) for _ in range(3))
    module = _Module(1)
    window = torch.ones(n, n, dtype=torch.bool).tril() & ~torch.ones(n, n, dtype=torch.bool).tril(-8)
    short = [t[:, :, :QUERY_BLOCK] for t in (q, k, v)]
    long = [torch.randn(1, 2, LONGEST + 1, 16) for _ in range(3)]
    cases = [(q, k, v, window[None, None]), (*short, None), (*long, None), (q[:, :, -1:], k, v, None)]
    for args in cases:
        ours, _ = blocked_sdpa_forward(module, *args)
        theirs, _ = sdpa_attention_forward(module, *args)
        assert torch.equal(ours, theirs)
    ours, _ = blocked_sdpa_forward(module, q, k, v, window[None, None])
    torch.testing.assert_close(ours.double(), _reference(q, k, v, window), atol=2e-5, rtol=1e-4)


def test_a_model_switched_to_it_computes_the_same_logits(monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                  max_position_embeddings=1024)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    n = 3 * QUERY_BLOCK + 5
    ids = torch.randint(0, 128, (2, n))
    with torch.no_grad():
        before = model(ids).logits
        assert use_blocked_attention(model)
        assert model.config._attn_implementation == BLOCKED
        sdpa, blocks = torch.nn.functional.scaled_dot_product_attention, []

        def counting(*args, attn_mask=None, **kwargs):
            if attn_mask is not None:
                blocks.append(tuple(attn_mask.shape))
            return sdpa(*args, attn_mask=attn_mask, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
        after = model(ids).logits
    # every layer attended block by block: 4 query blocks each, the last one reaching every key
    assert blocks == [(QUERY_BLOCK, QUERY_BLOCK), (QUERY_BLOCK, 2 * QUERY_BLOCK), (QUERY_BLOCK, 3 * QUERY_BLOCK),
                      (5, n)] * 2
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


def test_eager_models_are_left_alone():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert not use_blocked_attention(model)
    assert model.config._attn_implementation == "eager"
