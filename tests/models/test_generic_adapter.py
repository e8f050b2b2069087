"""Architectures without an adapter here: the layout is read off transformers' own model, and what the pipeline
and the runtime compute is checked against transformers (the full model, and a consumer of the checkpoint)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.models.adapters import find_layers_path
from quantkit.models.loader import open_model
from quantkit.models.source import resolve_model
from quantkit.pipeline.reference import layerwise_logits
from quantkit.runtime.model import load_model
from quantkit.runtime.moe import moe_blocks
from tests.conftest import make_tiny_model

# Each one differs from Llama somewhere the pipeline reads: fused q/k/v and gate/up (phi3), norms after the
# attention and MLP (olmo2), parallel attention and MLP with LayerNorm (cohere), layers under gpt_neox.layers and a
# head stored as embed_out (gpt_neox), layers under model.decoder.layers with learned positions and projections
# around them (opt), Gemma 2's logit softcapping, which SDPA cannot run, a LayerNorm on the embeddings (bloom),
# layers stored under another list name with every tensor renamed (EXAONE 3's transformer.h.N.ln_1 for
# model.layers.N.input_layernorm), Mamba mixers beside attention, whose 3-D conv weights are no experts (falcon_h1),
# an expert count in a dense model's config (doge: num_experts 16384, is_moe false).
FAMILIES = {"phi3": {"pad_token_id": 0}, "olmo2": {}, "cohere": {}, "gpt_neox": {}, "opt": {},
            "gemma2": {"head_dim": 16}, "bloom": {}, "exaone": {}, "falcon_h1": {"head_dim": 16}, "doge": {}}


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


# bloom under bf16 autocast: its embedding LayerNorm runs in fp32 there, on the fp32 embedding's output, which it
# can only do with weights of the embedding's dtype.
@pytest.mark.parametrize("family,compute", [("gpt_neox", "auto"), ("opt", "auto"), ("phi3", "auto"),
                                            ("bloom", "bfloat16"), ("exaone", "auto"), ("falcon_h1", "auto"),
                                            ("doge", "auto")])
def test_a_gptq_checkpoint_runs_in_the_runtime_as_in_transformers(generic_models, family, compute, text_file,
                                                                  tmp_path):
    out = tmp_path / "q"
    result = _quantize("--model", str(generic_models[family]), "--method", "gptq", "--scheme", "W4A16",
                       "--group-size", "16", "--dataset", str(text_file), "--num-samples", "8", "--seq-len", "64",
                       "--output", str(out), "--compute-dtype", compute)
    assert result.exit_code == 0, result.output
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(generic_models[family], dtype=torch.float32)
        source = plain(ids).logits
        consumer = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
        runtime = load_model(out, dtype=torch.float32)(ids).logits.float()
    torch.testing.assert_close(runtime, consumer, rtol=1e-4, atol=1e-4 * float(consumer.abs().max()))
    # Every linear of every decoder layer is quantised (the head stays as it is) ...
    from tests.pipeline.test_engine import _tensors

    layers = plain.get_submodule(find_layers_path(plain.config, plain))
    linears = sum(isinstance(m, torch.nn.Linear) for m in layers.modules())
    assert sum(n.endswith(".weight_packed") for n in _tensors(out)) == linears > 0
    # ... and 4-bit weights change the logits, while a mis-mapped layer would not land in this band.
    rel = float((consumer - source).norm() / source.norm())
    assert 0.001 < rel < 0.5, rel


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


# Sparse-MoE families without a described router: transformers' standard fused experts, stored one linear per
# expert, each differing from the others where the inferred layout reads it: plain softmax routing (olmoe); sigmoid
# scores, a selection bias, shared experts and a dense first layer (glm4_moe); a router linear nested in the gate
# (hunyuan's gate.wg); a selection bias stored outside the router module it loads into (exaone_moe, ernie4_5_moe's
# moe_statics); experts and router stored as block_sparse_moe.experts / block_sparse_moe.gate and loaded as
# mlp.experts / mlp.router, the router an nn.Linear (phimoe); MLA attention (deepseek_v2).
MOE = {
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                     n_group=1, topk_group=1, head_dim=16),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, head_dim=16),
    "exaone_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    # a router tensor stored under the experts (laguna's mlp.experts.e_score_correction_bias is the router's), and
    # attention sinks stored under another name (mimo_v2_flash's attention_sink_bias): renames of single tensors
    "laguna": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "mimo_v2_flash": dict(num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          head_dim=16, n_group=1, topk_group=1),
    "deepseek_v2": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                        n_group=1, topk_group=1, n_shared_experts=1, num_key_value_heads=4),
}


# The routing rule each family's transformers block implements (scoring, the selection bias it ranks with, its
# shared experts), read from transformers' modelling code; the runtime finds it on the loaded router. Phi-MoE's
# sparse mixer (a masked second softmax) is no rule RouterSpec describes: transformers' block keeps routing it.
RULES = {
    "olmoe": ("softmax", None, None),
    "glm4_moe": ("sigmoid", "e_score_correction_bias", "shared_experts"),
    "hunyuan_v1_moe": ("softmax", None, "shared_mlp"),
    "exaone_moe": ("sigmoid", "e_score_correction_bias", "shared_experts"),
    "ernie4_5_moe": ("softmax", "moe_statics.e_score_correction_bias", "shared_experts"),
    "phimoe": None,
    "laguna": ("sigmoid", "e_score_correction_bias", "shared_experts"),
    "mimo_v2_flash": ("sigmoid", "e_score_correction_bias", None),
    "deepseek_v2": ("softmax", None, "shared_experts"),
}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("generic-moe")
    return {f: make_tiny_model(root / f, f, **overrides) for f, overrides in MOE.items()}


def _stored_experts(folder) -> dict[str, list[str]]:
    """Layer prefix + experts path -> the projections stored per expert, read off the safetensors names."""
    import re

    from tests.pipeline.test_engine import _tensors

    found: dict[str, set] = {}
    for name in _tensors(folder):
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        if m:
            found.setdefault(m.group(1), set()).add((int(m.group(2)), m.group(3)))
    return {k: sorted(v) for k, v in found.items()}


@pytest.mark.parametrize("family", list(MOE))
def test_a_moe_family_without_described_routing_is_quantised_and_served_by_the_rule_found_on_its_router(
        moe_models, family, text_file, tmp_path):
    from tests.pipeline.test_engine import _reference_with_dequantised, _tensors

    src, out = moe_models[family], tmp_path / "q"
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
    # The streamed pipeline's layer-by-layer forward, experts unfused, is the model's own.
    streamed = layerwise_logits(open_model(resolve_model(str(src))), ids, batch_size=2)
    torch.testing.assert_close(streamed, source, rtol=1e-5, atol=1e-5)

    result = _quantize("--model", str(src), "--method", "gptq", "--scheme", "W4A16", "--group-size", "16",
                       "--dataset", str(text_file), "--num-samples", "8", "--seq-len", "64", "--output", str(out),
                       "--json")
    assert result.exit_code == 0, result.output
    # Every expert projection of every sparse layer is quantised under its stored name; nothing else is left dense
    # but the routers, which keep their bytes and are listed in the ignore.
    experts = _stored_experts(src)
    assert experts
    written, original = _tensors(out), _tensors(src)
    for block, projections in experts.items():
        for e, proj in projections:
            assert f"{block}.{e}.{proj}.weight_packed" in written and f"{block}.{e}.{proj}.weight" not in written
    dense_2d = [n for n, t in written.items() if n.endswith(".weight") and t.dim() == 2 and ".layers." in n]
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert dense_2d and all(n.rpartition(".")[0] in ignore and torch.equal(written[n], original[n]) for n in dense_2d)
    summary = json.loads(result.stdout)
    profile = json.loads((out / "routing_profile.json").read_text())
    assert profile["num_experts"] == 4 and profile["top_k"] == 2, profile
    assert summary["experts"]["starved"] is not None

    consumer_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    oracle, replaced = _reference_with_dequantised(src, out, 4, 16)
    assert replaced == sum(n.endswith(".weight_packed") for n in written)
    with torch.no_grad():
        consumer, expected = consumer_model(ids).logits, oracle(ids).logits
        rt = load_model(out, dtype=torch.float32)
        runtime = rt(ids).logits.float()
    blocks = moe_blocks(rt.model)
    assert [(b.spec.scoring, b.spec.selection_bias, b.spec.shared_experts) for b in blocks[:1]] == \
        ([RULES[family]] if RULES[family] else [])
    torch.testing.assert_close(consumer, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(runtime, consumer, rtol=1e-4, atol=1e-4 * float(consumer.abs().max()))
    assert 0.01 < float((consumer - source).norm() / source.norm()) < 0.5


def test_what_the_generic_layout_cannot_do_is_refused_in_one_line(generic_models, text_file, tmp_path):
    # gpt-oss: experts with biases, a clamped gate of their own and transposed weights; GraniteMoE: experts stored
    # fused on disk (input_linear / output_linear), which compressed-tensors cannot name per expert.
    gpt_oss = make_tiny_model(tmp_path / "gpt_oss", "gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    granite = make_tiny_model(tmp_path / "granitemoe", "granitemoe", num_local_experts=4, num_experts_per_tok=2)
    # Dory runs its middle layers in a loop: each layer's inputs differ per pass, which one calibration pass per layer
    # cannot see.
    dory = make_tiny_model(tmp_path / "dory", "dory")
    cases = [(gpt_oss, "gptq", "W4A16", "unsupported MoE architecture 'gpt_oss' (GptOssExperts in its layers): its "
                                        "experts are not transformers' standard"),
             (dory, "gptq", "W4A16 --group-size 16", "more than once per forward (a looped model)"),
             (granite, "gptq", "W4A16", "unsupported MoE architecture 'granitemoe': its experts are stored fused"),
             (generic_models["gpt_neox"], "smoothquant+gptq", "W8A8", "smoothquant needs the norm -> linear mappings")]
    for model, method, scheme, needle in cases:
        result = _quantize("--model", str(model), "--method", method, "--scheme", *scheme.split(), "--dataset", str(text_file),
                           "--num-samples", "4", "--seq-len", "32", "--output", str(tmp_path / "out"))
        err = result.stderr.strip()
        assert result.exit_code == 2, (method, result.output)
        assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in result.output, err
        assert not (tmp_path / "out").exists()


def test_moe_analysis_runs_on_the_rule_found_on_the_router_and_refuses_a_block_without_one(moe_models):
    """`eval --moe` replays and alters the routing rule (capacity, bias balancing, offloading): a family without a
    described router gets the rule the runtime found on its loaded router; one whose block matches none is refused
    in one line."""
    src = moe_models["glm4_moe"]
    result = CliRunner().invoke(app, ["eval", str(src), "--baseline", str(src), "--moe", "--num-samples", "2",
                                      "--seq-len", "16", "--offload-cache", "2", "--json"])
    assert result.exit_code == 0, result.output
    moe = json.loads(result.stdout)["results"][0]["moe"]
    # The model against itself: the same experts for every token; offloaded decoding as resident.
    assert (moe["num_experts"], moe["top_k"], moe["routing_topk_overlap"]) == (4, 2, 1.0)
    assert all(row["exact"] for row in moe["offload"])

    src = moe_models["phimoe"]
    result = CliRunner().invoke(app, ["eval", str(src), "--baseline", str(src), "--moe", "--num-samples", "2",
                                      "--seq-len", "16"])
    err = result.stderr.strip()
    assert result.exit_code == 2, result.output
    assert "'phimoe' MoE blocks matches no rule" in err and len(err.splitlines()) == 1, err


def test_the_runtime_still_runs_an_unquantised_moe_the_pipeline_refuses(tmp_path):
    """GPT-OSS's experts (biases, a clamped gate of their own) cannot be unfused, but an unquantised checkpoint (an
    eval baseline) runs in the runtime through transformers' own blocks, experts fused as stored."""
    src = make_tiny_model(tmp_path / "gpt_oss", "gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        got = load_model(src, dtype=torch.float32)(ids).logits.float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
