"""Method.preview (what mixed precision weighs each choice by) against what a real run stores: for layer 0, whose
input no earlier quantisation touches, a method's preview from that input's statistics is the checkpoint's weight."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

from quantkit.data.calibration import build_token_blocks
from quantkit.methods import build_methods
from quantkit.methods.base import PreviewStats
from quantkit.pipeline.engine import quantize_model
from quantkit.quant.schemes import get_scheme
from quantkit.recipe import Recipe

N, L = 8, 32


def _layer0_inputs(model_dir, name):
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = build_token_blocks(tok, "kjv", N, L, 42).input_ids
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen = []
    hd = model.get_submodule(name).register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        model(ids)
    hd.remove()
    return torch.cat(seen).float(), model.get_submodule(name).weight.data.clone()


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_preview_is_what_the_run_stores_for_layer0(tiny_models, tmp_path, method):
    src, name = tiny_models["llama"], "model.layers.0.self_attn.k_proj"
    r = Recipe()
    r.model.source = str(src)
    r.quantization.method, r.quantization.scheme, r.quantization.group_size = method, "W4A16", 32
    r.quantization.options = {"gptq": {"hessian_dtype": "float32"}}
    r.calibration.num_samples, r.calibration.seq_len, r.calibration.error_samples = N, L, N
    quantize_model(r, tmp_path / "q", compute_dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    want = model.get_submodule(name).weight.data.float()
    x, weight = _layer0_inputs(src, name)
    n = x.shape[0]
    # summed as the run sums them: float32 products, float64 totals (one batch here)
    stats = PreviewStats(n, (x.pow(2).sum(0).double() / n).float(), ((x.T @ x).double() * (2.0 / n)).float())
    scheme = get_scheme("W4A16", 32)
    m = build_methods(method, scheme, r.quantization.options)[-1]
    got = m.preview(weight, scheme.weights, stats, torch.float32)
    assert torch.equal(got, want), f"{(got != want).float().mean().item():.4f} differ"
    # and it is not plain round-to-nearest (the method's own work is in it)
    plain = build_methods("rtn", scheme, {"rtn": {"scale_search": "minmax"}})[-1].preview(weight, scheme.weights, None,
                                                                                       torch.float32)
    assert (plain != want).any()
