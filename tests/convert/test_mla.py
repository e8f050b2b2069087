"""MLA conversion: exactness where it is possible, transformers loading the DeepSeek-V3 folder, RoPE math,
bad input, and that the converted model quantises."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.convert.mla import (MLA_NORM_EPS, MLAOptions, convert_model, evaluate_pair, mla_attention,
                                  mla_reference_logits, plan_dims)
from quantkit.convert.rope import apply_rope_half, complex_rows, frequency_rotations, inv_frequencies, real_rows
from tests.conftest import make_tiny_model

runner = CliRunner()


def _hf_logits(folder, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64)
    return model, model(ids).logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    return {
        "mqa": make_tiny_model(root / "mqa", "llama", num_key_value_heads=1, seed=1),
        "gqa": make_tiny_model(root / "gqa", "llama", seed=2),
        "qwen2_mqa": make_tiny_model(root / "qwen2", "qwen2", num_key_value_heads=1, seed=3),
        "mqa_tied": make_tiny_model(root / "tied", "llama", num_key_value_heads=1, seed=4, tie_word_embeddings=True),
        "root": root,
    }


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["mqa", "qwen2_mqa", "mqa_tied"])
def test_full_rank_single_kv_head_reproduces_logits(tiny, name, compute_dtype, tmp_path):
    """One KV head and rope_dim = head_dim: nothing is lost, so the DeepSeek-V3 model must equal the source,
    whichever dtype the source forward runs in (`auto` picks bf16 on CPUs with fast bf16: there the refinement
    once fitted the targets' bf16 rounding and moved the exact closed form 1% away)."""
    out = tmp_path / "out"
    convert_model(str(tiny[name]), out, MLAOptions(kv_lora_rank=-1, rope_dim=16, compute_dtype=compute_dtype),
                  num_samples=4, seq_len=64)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    _, want = _hf_logits(tiny[name], ids)
    model, got = _hf_logits(out, ids)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < 1e-4, f"max logit difference {rel:.2e} of the largest logit"
    # Never tied, even from a tied source: vLLM's DeepSeek-V3 ignores tying and needs lm_head.weight.
    from safetensors import safe_open

    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        assert "lm_head.weight" in f.keys()


def test_output_loads_in_transformers_and_matches_own_forward(tiny, tmp_path):
    out = tmp_path / "out"
    convert_model(str(tiny["gqa"]), out, MLAOptions(kv_lora_rank=20, rope_dim=8), num_samples=4, seq_len=64)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert "auto_map" not in cfg and cfg["q_lora_rank"] is None
    assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"]
    assert (out / "tokenizer.json").is_file()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    model, got = _hf_logits(out, ids)
    attn = model.model.layers[0].self_attn
    assert attn.kv_a_proj_with_mqa.weight.shape == (20 + 8, 64)
    assert not hasattr(model.model.layers[0].mlp, "experts")
    ref = mla_reference_logits(out, ids)
    assert (got - ref).abs().max() < 1e-6 * ref.abs().max()


def test_full_rank_gqa_loses_only_rope_and_beats_low_rank(tiny, tmp_path):
    """Two KV heads cannot share one RoPE key exactly; the full latent must still beat a truncated one."""
    kls = {}
    for rank in (-1, 8):
        out = tmp_path / f"r{rank}"
        convert_model(str(tiny["gqa"]), out, MLAOptions(kv_lora_rank=rank, rope_dim=16), num_samples=4, seq_len=64)
        kls[rank] = evaluate_pair(str(tiny["gqa"]), out, num_samples=2, seq_len=64)["kl"]
    assert kls[-1] < kls[8]


def test_mla_attention_is_what_transformers_deepseek_v3_computes(tiny, tmp_path):
    """The refinement's differentiable forward (mla_attention) must be the attention the written folder runs."""
    from transformers import AutoConfig

    out = tmp_path / "out"
    convert_model(str(tiny["gqa"]), out, MLAOptions(kv_lora_rank=20, rope_dim=8, refine_steps=0), num_samples=4,
                  seq_len=64)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(4))
    model, _ = _hf_logits(out, ids)
    attn = model.model.layers[0].self_attn
    seen = {}
    attn.register_forward_hook(lambda m, a, k, o: seen.update(x=k["hidden_states"], out=o[0]), with_kwargs=True)
    model(ids)
    dims = plan_dims(AutoConfig.from_pretrained(str(tiny["gqa"])), 20, 8)
    r = dims.kv_lora_rank
    kv_a = attn.kv_a_proj_with_mqa.weight
    small = math.sqrt(MLA_NORM_EPS) / float(attn.kv_a_layernorm.weight[0])
    ang = torch.arange(40, dtype=torch.float64)[:, None] * inv_frequencies(dims.rope_dim, dims.rope_theta)[None]
    with torch.no_grad():
        got = mla_attention(seen["x"], attn.q_proj.weight, kv_a[:r] / small, kv_a[r:], attn.kv_b_proj.weight,
                            attn.o_proj.weight, dims, ang.cos(), ang.sin())
        # The refinement's subsampled queries: the same positions' outputs of the whole-sequence forward.
        positions = torch.tensor([0, 3, 17, 18, 39])
        some = mla_attention(seen["x"], attn.q_proj.weight, kv_a[:r] / small, kv_a[r:], attn.kv_b_proj.weight,
                             attn.o_proj.weight, dims, ang.cos(), ang.sin(), positions)
    # the only difference allowed is the latent norm's linear-regime approximation (~1e-5 relative)
    assert (got - seen["out"]).abs().max() < 1e-4 * seen["out"].abs().max()
    assert (some - seen["out"][:, positions]).abs().max() < 1e-4 * seen["out"].abs().max()


def test_refinement_lowers_held_out_kl(tiny, tmp_path):
    kls, reports = {}, {}
    for steps in (0, 100):
        out = tmp_path / f"s{steps}"
        summary = convert_model(str(tiny["gqa"]), out, MLAOptions(kv_lora_rank=12, rope_dim=8, refine_steps=steps),
                                num_samples=8, seq_len=64)
        reports[steps] = summary.get("refine")
        kls[steps] = evaluate_pair(str(tiny["gqa"]), out, num_samples=4, seq_len=64)["kl"]
    assert reports[0] is None and len(reports[100]) == 2  # one entry per layer of the tiny model
    assert any(r["after"] < r["before"] for r in reports[100])
    assert kls[100] < kls[0], kls


def test_refinement_stops_when_the_held_out_error_does(tiny, tmp_path):
    """A budget far past what the tiny model needs: every layer stops early (at a held-out check, never before
    MIN_STEPS), keeps the best held-out error it saw, and the conversion is still better than the closed form."""
    from quantkit.convert import mla

    out = tmp_path / "long"
    summary = convert_model(str(tiny["gqa"]), out, MLAOptions(kv_lora_rank=12, rope_dim=8, refine_steps=2000),
                            num_samples=8, seq_len=64)
    for r in summary["refine"]:
        assert mla.MIN_STEPS <= r["steps"] < 2000 and r["steps"] % mla.CHECK_EVERY == 0, r
        assert r["after"] <= r["before"]
    assert any(r["after"] < r["before"] for r in summary["refine"])


@pytest.mark.parametrize("use_complex", [True, False])
def test_rope_rotation_keeps_scores_at_any_positions(use_complex):
    """Rotating keys across KV heads within each frequency (and queries to match) commutes with RoPE."""
    g = torch.Generator().manual_seed(0)
    hidden, n_kv, n_heads, hd, theta = 24, 3, 6, 8, 10000.0
    wk = torch.randn(n_kv * hd, hidden, generator=g, dtype=torch.float64)
    wq = torch.randn(n_heads * hd, hidden, generator=g, dtype=torch.float64)
    x = torch.randn(50, hidden, generator=g, dtype=torch.float64)
    u, _ = frequency_rotations(complex_rows(wk, n_kv, hd), x.T @ x / 50, use_complex=use_complex)
    u = u.to(torch.complex128)  # [pairs, n_kv, n_kv], unitary per frequency
    keys, queries = complex_rows(wk, n_kv, hd), complex_rows(wq, n_heads, hd)
    rot_keys = torch.einsum("pgl,pgh->plh", u.conj(), keys)  # component l of every frequency
    pos_q = torch.randint(0, 5000, (50,), generator=g)
    pos_k = torch.randint(0, 5000, (50,), generator=g)
    k_rot = real_rows(rot_keys)  # n_kv "heads" of rotated components
    for h in range(n_heads):
        grp = h // (n_heads // n_kv)
        q = (x @ wq[h * hd:(h + 1) * hd].T)
        k = (x @ wk[grp * hd:(grp + 1) * hd].T)
        want = apply_rope_half(q, pos_q, theta) @ apply_rope_half(k, pos_k, theta).T
        q_rot = real_rows(u[:, grp, :].conj().permute(0, 1)[:, :, None] * queries[:, h:h + 1])  # [n_kv*hd, H]
        got = torch.zeros_like(want)
        for comp in range(n_kv):
            qc = x @ q_rot[comp * hd:(comp + 1) * hd].T
            kc = x @ k_rot[comp * hd:(comp + 1) * hd].T
            got += apply_rope_half(qc, pos_q, theta) @ apply_rope_half(kc, pos_k, theta).T
        assert torch.allclose(got, want, atol=1e-9 * want.abs().max())
    # PCA order: the first component holds the most key energy at every frequency.
    energy = (rot_keys @ (x.T @ x / 50).to(torch.complex128) * rot_keys.conj()).sum(-1).real
    assert torch.all(energy[:, 0] >= energy[:, 1:].max(dim=1).values - 1e-9)


def _fail(result, code, *needles):
    assert result.exit_code == code, (result.exit_code, result.output)
    err = result.stderr.strip()
    assert "Traceback" not in result.output and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


def _convert(*args):
    return runner.invoke(app, ["convert-mla", *args, "--num-samples", "2", "--seq-len", "32",
                               "--eval-samples", "0"], catch_exceptions=False)


@pytest.mark.parametrize("family,needle", [("mixtral", "MoE"), ("deepseek_v3", "already uses latent"),
                                           ("gemma", "supports")])
def test_unconvertible_models_are_refused(tiny_models, tmp_path, family, needle):
    out = tmp_path / "out"
    _fail(_convert("--model", str(tiny_models[family]), "--output", str(out)), 2, needle)
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_sliding_window_is_refused(tmp_path):
    src = make_tiny_model(tmp_path / "m", "mistral", sliding_window=32)
    _fail(_convert("--model", str(src), "--output", str(tmp_path / "out")), 2, "sliding-window")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,needle", [(["--kv-lora-rank", "49", "--rope-dim", "16"], "exact maximum 48"),
                                         (["--rope-dim", "7"], "even"), (["--rope-dim", "18"], "head_dim (16)"),
                                         (["--kv-lora-rank", "lots"], "integer or 'full'"),
                                         (["--sweep", "8,100"], "exact maximum 56"),
                                         (["--refine-steps", "-1"], "0 or more"),
                                         (["--refine-batch", "0"], "1 or more"),
                                         (["--refine-lr", "0"], "between 0 and 1")])
def test_bad_sizes_are_refused(tiny, tmp_path, args, needle):
    out = tmp_path / "out"
    _fail(_convert("--model", str(tiny["gqa"]), "--output", str(out), *args), 2, needle)
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_sweep_writes_each_rank_and_a_plot(tiny, tmp_path):
    out = tmp_path / "sweep"
    res = runner.invoke(app, ["convert-mla", "--model", str(tiny["gqa"]), "--output", str(out), "--sweep", "8,full",
                              "--num-samples", "2", "--seq-len", "32", "--eval-samples", "1", "--json"],
                        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    ranks = [r["dims"]["kv_lora_rank"] for r in report["runs"]]
    assert ranks == [8, 56]
    assert (out / "sweep.png").stat().st_size > 1000 and (out / "rank-8" / "config.json").is_file()
    kv = report["runs"][0]["kv_cache"]
    assert kv["values_per_token_per_layer"] == {"before": 2 * 2 * 16, "after": 8 + 8}
    assert kv["bytes_per_token_bf16"]["after"] == 2 * 16 * 2 and kv["bytes_per_token_fp8"]["after"] == 16 * 2
    assert all(math.isfinite(r["eval"]["kl"]) for r in report["runs"])


def test_converted_model_quantises_and_loads(tiny, tmp_path):
    conv = tmp_path / "mla"
    convert_model(str(tiny["gqa"]), conv, MLAOptions(kv_lora_rank=32, rope_dim=8), num_samples=2, seq_len=32)
    q = tmp_path / "q"
    res = runner.invoke(app, ["quantize", "--model", str(conv), "--method", "rtn", "--scheme", "W4A16",
                              "--group-size", "16", "--num-samples", "2", "--seq-len", "32", "--output", str(q)],
                        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(q), dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    _, want = _hf_logits(conv, ids)
    got = model(ids).logits.double()
    assert torch.isfinite(got).all()
    assert (got.softmax(-1) - want.softmax(-1)).abs().sum(-1).mean() < 0.5


@pytest.mark.slow
def test_smollm2_converts_loads_and_stays_close(smollm2_path, tmp_path):
    out = tmp_path / "smol"
    convert_model(str(smollm2_path), out, MLAOptions(), num_samples=4, seq_len=128)
    ids = torch.randint(100, 40000, (1, 32), generator=torch.Generator().manual_seed(3))
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)(ids).logits.double()
    ref = mla_reference_logits(out, ids)
    assert (got - ref).abs().max() < 1e-3 * ref.abs().max()
    ev = evaluate_pair(str(smollm2_path), out, num_samples=1, seq_len=128)
    # default rank keeps 1/3 of the KV cache; calibrated on 4x128 tokens it must still be a language model
    assert ev["top1_agreement"] > 0.35 and ev["ppl"] < 4 * ev["ppl_base"], ev


def test_default_rank_is_a_latent_vllm_serves_where_one_fits():
    """Sizes vLLM's MLA attention serves: DeepSeek-V3's 512 + 64 = 576, and 320, 512 (check-serving's rule)."""
    from transformers import LlamaConfig

    from quantkit.convert.mla import vllm_latent_problem

    def dims(**kw):
        return plan_dims(LlamaConfig(vocab_size=64, **kw), None, None)

    # SmolLM2-135M: 3 KV heads x 64; half the KV values is 96 (+32 rope = 128, refused) -> 288 + 32 = 320.
    smol = dims(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=64)
    assert (smol.kv_lora_rank, smol.rope_dim) == (288, 32) and vllm_latent_problem(smol) is None
    # Llama-3-8B: 8 KV heads x 128; 512 + 64 = 576 is already DeepSeek-V3's size.
    llama8b = dims(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=64)
    assert (llama8b.kv_lora_rank, llama8b.rope_dim) == (512, 64) and vllm_latent_problem(llama8b) is None
    # A model too small for any served size keeps half its KV values, and the conversion warns.
    tiny = dims(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    assert tiny.kv_lora_rank == 16 and "vLLM refuses it" in vllm_latent_problem(tiny)
    # An explicit rank is kept as given, with the served alternatives named.
    explicit = plan_dims(LlamaConfig(vocab_size=64, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                     intermediate_size=64), 96, None)
    assert explicit.kv_lora_rank == 96 and "use --kv-lora-rank 288" in vllm_latent_problem(explicit)
