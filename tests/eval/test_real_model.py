"""On the real SmolLM2: `quantkit eval` of an RTN checkpoint against an independent transformers computation."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from quantkit.cli import app
from tests.eval.test_cli_eval import _plain_kl


@pytest.mark.slow
def test_real_model_kl_within_3_percent_of_plain_transformers(smollm2_path, tmp_path):
    from transformers import AutoTokenizer

    from quantkit.data.calibration import build_token_blocks
    from quantkit.pipeline.engine import quantize_model
    from quantkit.recipe import Recipe

    r = Recipe()
    r.model.source = str(smollm2_path)
    r.quantization.scheme, r.quantization.group_size = "W4A16", 64
    r.calibration.num_samples, r.calibration.seq_len = 2, 64
    ckpt = tmp_path / "rtn"
    quantize_model(r, ckpt)
    result = CliRunner().invoke(app, ["eval", str(ckpt), "--json", "--num-samples", "3", "--seq-len", "128"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["results"][0]
    ids = build_token_blocks(AutoTokenizer.from_pretrained(smollm2_path), "kjv", 3, 128, 42, split="heldout").input_ids
    kl, ppl = _plain_kl(smollm2_path, ckpt, ids)
    assert row["kl_mean"] == pytest.approx(kl, rel=0.03)
    assert row["ppl"] == pytest.approx(ppl, rel=0.01)
    assert 0.005 < row["kl_mean"] < 1.0 and row["top1_agree"] > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("tree", ["chain", "dynamic:8"])
def test_fp32_greedy_speculative_decoding_is_plain_decoding_on_smollm2(smollm2_path, tree):
    """In fp32, verifying k drafted tokens in one k-row forward and decoding them one row at a time differ by
    rounding far below SmolLM2's top-2 logit gaps on these prompts, so greedy speculative output must equal plain
    greedy output token for token (in bf16 it may not; eval/speculative.py says why). The draft is the target itself,
    so every drafted token is accepted and every step verifies the whole chain or tree."""
    import torch
    from transformers import AutoTokenizer

    from quantkit.eval.speculative import first_divergence
    from quantkit.runtime import load_model
    from quantkit.runtime.speculative import SpecConfig, parse_tree, speculative_generate
    from quantkit.runtime.speculative.decode import plain_generate
    from quantkit.runtime.speculative.drafts import ModelDraft

    rt = load_model(smollm2_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    texts = ["In the beginning God created the heaven and the earth. And the earth was",
             "Question: what is the capital of France? Answer:",
             "def fibonacci(n):\n    "]
    cfg = SpecConfig(tree=parse_tree(tree, 4), max_new_tokens=24)
    draft = ModelDraft(rt, "self")
    for text in texts:
        ids = tok(text)["input_ids"]
        plain, _ = plain_generate(rt, ids, 24)
        spec = speculative_generate(rt, draft, ids, cfg)
        assert len(plain) == 24 and first_divergence(spec.tokens, plain) is None, (text, spec.tokens, plain)
        assert spec.accepted > 0  # the chain or tree was verified, not decoded one token at a time
