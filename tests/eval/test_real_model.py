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
