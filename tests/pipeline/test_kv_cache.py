"""--kv-cache fp8: calibrated k_scale / v_scale written as compressed-tensors' kv_cache_scheme, and the runtime's
fp8 cache against transformers running the same checkpoint through an independently written fp8 cache."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DynamicCache

from quantkit.errors import InputError
from quantkit.pipeline.engine import quantize_model
from quantkit.recipe import Recipe
from quantkit.runtime import load_model
from tests.conftest import make_tiny_model
from tests.quant.test_kv_cache import _plain

CALIB = dict(num_samples=4, seq_len=24)


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kv") / "llama", "llama", dtype=torch.bfloat16)


def _quantize(src, out, mode, scheme="W8A16"):
    r = Recipe()
    r.model.source = str(src)
    r.quantization.scheme, r.quantization.group_size, r.quantization.kv_cache = scheme, 32, mode
    r.calibration.num_samples, r.calibration.seq_len = CALIB["num_samples"], CALIB["seq_len"]
    quantize_model(r, out)
    return out


class _RecordingCache(DynamicCache):
    """transformers' own cache, recording the absmax per head of what each layer stores."""

    def __init__(self, seen, **kw):
        super().__init__(**kw)
        self.seen = seen

    def update(self, k, v, layer_idx, *args, **kwargs):
        for key, states in (("k", k), ("v", v)):
            m = states.abs().amax(dim=(0, 2, 3)).float()
            prev = self.seen.setdefault(layer_idx, {}).get(key)
            self.seen[layer_idx][key] = m if prev is None else torch.maximum(prev, m)
        return super().update(k, v, layer_idx, *args, **kwargs)


class _PlainFP8Cache(DynamicCache):
    """transformers' own cache, storing keys and values rounded to the nearest e4m3 value (tests/quant)."""

    def __init__(self, scales, **kw):
        super().__init__(**kw)
        self.scales = scales

    def update(self, k, v, layer_idx, *args, **kwargs):
        ks, vs = self.scales[layer_idx]
        return super().update(_plain(k, ks), _plain(v, vs), layer_idx, *args, **kwargs)


def _scales(path):
    out = {}
    with safe_open(next(path.glob("*.safetensors")), "pt") as f:
        for i in range(2):
            out[i] = tuple(f.get_tensor(f"model.layers.{i}.self_attn.{t}_scale") for t in "kv")
    return out


@pytest.mark.parametrize("mode,shape", [("fp8", (1,)), ("fp8-head", (2, 1, 1))])
def test_scales_are_the_stored_keys_and_values_absmax_over_448(bf16_llama, tmp_path, mode, shape):
    from quantkit.data.calibration import build_token_blocks
    from transformers import AutoTokenizer

    path = _quantize(bf16_llama, tmp_path / "q", mode)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == {"fp8": "tensor", "fp8-head": "attn_head"}[mode]
    scales = _scales(path)
    assert all(s.shape == shape and s.dtype == torch.bfloat16 for pair in scales.values() for s in pair)
    # Independently: transformers runs the quantised checkpoint over the same calibration blocks; what its own
    # cache receives per head, over 448, is the scale (to the fp32-vs-bf16 differences of the two forwards).
    tok = AutoTokenizer.from_pretrained(path)
    blocks = build_token_blocks(tok, "kjv", CALIB["num_samples"], CALIB["seq_len"], 42).input_ids
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    seen = {}
    with torch.no_grad():
        for row in blocks:
            model(row[None], cache=_RecordingCache(seen, config=model.config), use_cache=True)
    for i, (ks, vs) in scales.items():
        for got, key in ((ks, "k"), (vs, "v")):
            want = seen[i][key] / 448
            want = want.amax().reshape(1) if mode == "fp8" else want.reshape(-1, 1, 1)
            torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0)


def test_runtime_cache_is_transformers_with_a_plain_fp8_cache(bf16_llama, tmp_path):
    path = _quantize(bf16_llama, tmp_path / "q", "fp8-head")
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    rt, plain_rt = load_model(path), load_model(path, kv_cache=False)
    assert rt.kv_cache == "attn_head" and plain_rt.kv_cache is None
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        got, off = rt(input_ids=ids).logits.float(), plain_rt(input_ids=ids).logits.float()
        ref = model(ids, cache=_PlainFP8Cache(_scales(path), config=model.config), use_cache=True).logits.float()
        ref_off = model(ids).logits.float()
    assert torch.equal(off, ref_off)
    assert not torch.equal(got, off)  # the cache rounds something
    assert torch.equal(got, ref), f"max diff {(got - ref).abs().max().item()}"


def test_decode_steps_read_the_rounded_cache(bf16_llama, tmp_path):
    """Prefill then one-token steps through the runtime's own cache: the same logits as one full forward."""
    from quantkit.runtime.step import KVCache, prefill, step

    path = _quantize(bf16_llama, tmp_path / "q", "fp8")
    rt = load_model(path, dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = rt(input_ids=ids).logits[0, -1].float()
        cache = KVCache()
        prefill(rt, ids[:, :8], cache)
        for t in range(8, 12):
            logits = step(rt, ids[:, t : t + 1], torch.tensor([[t]]), cache)
    torch.testing.assert_close(logits.reshape(-1).float(), full, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kv") / "deepseek_v3", "deepseek_v3")


def test_mla_latent_and_rope_part_share_one_scale(deepseek, tmp_path):
    """MLA caches its compressed latent and its rope part after RoPE, one row under vLLM's k_scale: the scale is
    the absmax of both over 448, measured independently by transformers' own cache on the quantised model."""
    from quantkit.data.calibration import build_token_blocks
    from transformers import AutoTokenizer

    path = _quantize(deepseek, tmp_path / "q", "fp8", scheme="W4A16")
    scales = _scales(path)
    assert all(s.shape == (1,) for pair in scales.values() for s in pair)
    tok = AutoTokenizer.from_pretrained(path)
    blocks = build_token_blocks(tok, "kjv", CALIB["num_samples"], CALIB["seq_len"], 42).input_ids
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    seen = {}
    with torch.no_grad():
        for row in blocks:
            model(row[None], cache=_RecordingCache(seen, config=model.config), use_cache=True)
    rank = model.config.kv_lora_rank
    for i, (ks, vs) in scales.items():
        want = torch.maximum(seen[i]["k"].amax(), seen[i]["v"].amax()).reshape(1) / 448
        torch.testing.assert_close(ks.float(), want, rtol=0.02, atol=0)
        assert torch.equal(ks, vs)
    assert rank == 32  # the latent is what the cache received as keys (not per-head decompressed keys)


def test_mla_runtime_cache_is_transformers_with_a_plain_fp8_latent_cache(deepseek, tmp_path):
    path = _quantize(deepseek, tmp_path / "q", "fp8", scheme="W4A16")
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    rt, plain_rt = load_model(path, dtype=torch.float32), load_model(path, dtype=torch.float32, kv_cache=False)
    assert rt.kv_cache == "tensor"
    scales = {i: (k, k) for i, (k, _v) in _scales(path).items()}  # vLLM scales the whole row by k_scale
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        got, off = rt(input_ids=ids).logits.float(), plain_rt(input_ids=ids).logits.float()
        ref = model(ids, cache=_PlainFP8Cache(scales, config=model.config), use_cache=True).logits.float()
    assert not torch.allclose(got, off, atol=1e-4)  # the cache rounds something
    # per-expert matmuls vs transformers' fused experts: rounding order differs (test_model.py: MoE 1e-5)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_refused_where_the_cache_layout_is_not_known(tiny_models, tmp_path):
    with pytest.raises(InputError, match="one compressed latent"):
        _quantize(tiny_models["deepseek_v3"], tmp_path / "q", "fp8-head", scheme="W4A16")
    with pytest.raises(InputError, match="valid: fp8, fp8-head"):
        _quantize(tiny_models["llama"], tmp_path / "q2", "int8", scheme="W4A16")
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()
