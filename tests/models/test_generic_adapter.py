"""Architectures without an adapter here: the layout is read off transformers' own model, and what the pipeline
and the runtime compute is checked against transformers (the full model, and a consumer of the checkpoint)."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.models.loader import open_model
from quantkit.models.source import resolve_model
from quantkit.pipeline.reference import layerwise_logits
from quantkit.runtime.model import load_model
from tests.conftest import make_tiny_model

# Each one differs from Llama somewhere the pipeline reads: fused q/k/v and gate/up (phi3), norms after the
# attention and MLP (olmo2), parallel attention and MLP with LayerNorm (cohere), layers under gpt_neox.layers and a
# head stored as embed_out (gpt_neox), layers under model.decoder.layers with learned positions and projections
# around them (opt), Gemma 2's logit softcapping, which SDPA cannot run.
FAMILIES = {"phi3": {"pad_token_id": 0}, "olmo2": {}, "cohere": {}, "gpt_neox": {}, "opt": {},
            "gemma2": {"head_dim": 16}}


@pytest.fixture(scope="module")
def generic_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("generic")
    return {f: make_tiny_model(root / f, f, **overrides) for f, overrides in FAMILIES.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layerwise_matches_the_full_model(generic_models, family):
    path = generic_models[family]
    handle = open_model(resolve_model(str(path)))
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    streamed = layerwise_logits(handle, ids, batch_size=2)
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(streamed, expected, rtol=1e-5, atol=1e-5)


def _quantize(*args):
    return CliRunner().invoke(app, ["quantize", *args], catch_exceptions=False)


@pytest.mark.parametrize("family", ["gpt_neox", "opt", "phi3"])
def test_a_gptq_checkpoint_runs_in_the_runtime_as_in_transformers(generic_models, family, text_file, tmp_path):
    out = tmp_path / "q"
    result = _quantize("--model", str(generic_models[family]), "--method", "gptq", "--scheme", "W4A16",
                       "--group-size", "16", "--dataset", str(text_file), "--num-samples", "8", "--seq-len", "64",
                       "--output", str(out))
    assert result.exit_code == 0, result.output
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        source = AutoModelForCausalLM.from_pretrained(generic_models[family], dtype=torch.float32)(ids).logits
        consumer = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
        runtime = load_model(out, dtype=torch.float32)(ids).logits.float()
    torch.testing.assert_close(runtime, consumer, rtol=1e-4, atol=1e-4 * float(consumer.abs().max()))
    # 4-bit weights change the logits, but a mis-mapped or unquantised layer would not land in this band.
    rel = float((consumer - source).norm() / source.norm())
    assert 0.01 < rel < 0.5, rel


TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
# Vision-language models: the text decoder is quantised, the vision tower and projector are not. Gemma 3 builds as
# a causal LM; Qwen2-VL and Mistral 3 only as image-text-to-text models.
VLMS = {
    "gemma3": dict(text_config={**TEXT, "head_dim": 16}, vision_config=SIGLIP, mm_tokens_per_image=4),
    "qwen2_vl": dict(text_config={**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
                     vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)),
    "mistral3": dict(text_config={**TEXT, "model_type": "mistral", "head_dim": 16},
                     vision_config={**SIGLIP, "head_dim": 16}),
}


@pytest.mark.parametrize("family", list(VLMS))
def test_a_vision_language_model_has_its_text_decoder_quantised_and_its_vision_tower_kept(family, text_file,
                                                                                           tmp_path):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from tests.conftest import _write_tokenizer

    torch.manual_seed(0)
    src = tmp_path / family
    AutoModelForImageTextToText.from_config(AutoConfig.for_model(family, **VLMS[family])).save_pretrained(src)
    _write_tokenizer(src, 256)
    out = tmp_path / "q"
    result = _quantize("--model", str(src), "--method", "gptq", "--scheme", "W4A16", "--group-size", "16",
                       "--dataset", str(text_file), "--num-samples", "8", "--seq-len", "64", "--output", str(out))
    assert result.exit_code == 0, result.output
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    source = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32)
    consumer = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        a, b = source(input_ids=ids).logits, consumer(input_ids=ids).logits
        runtime = load_model(out, dtype=torch.float32)(ids).logits.float()
    torch.testing.assert_close(runtime, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    assert 0.01 < float((b - a).norm() / a.norm()) < 0.5
    kept = {n: p for n, p in consumer.named_parameters() if "language_model" not in n and "lm_head" not in n}
    assert kept and all(torch.equal(p, dict(source.named_parameters())[n]) for n, p in kept.items())


def test_what_the_generic_layout_cannot_do_is_refused_in_one_line(generic_models, text_file, tmp_path):
    olmoe = make_tiny_model(tmp_path / "olmoe", "olmoe", num_experts=4, num_experts_per_tok=2)
    cases = [(olmoe, "gptq", "W4A16", "unsupported MoE architecture 'olmoe'"),
             (generic_models["gpt_neox"], "smoothquant+gptq", "W8A8", "smoothquant needs the norm -> linear mappings")]
    for model, method, scheme, needle in cases:
        result = _quantize("--model", str(model), "--method", method, "--scheme", scheme, "--dataset", str(text_file),
                           "--num-samples", "4", "--seq-len", "32", "--output", str(tmp_path / "out"))
        err = result.stderr.strip()
        assert result.exit_code == 2, (method, result.output)
        assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in result.output, err
        assert not (tmp_path / "out").exists()
