"""The emulated CUDA device end to end: `--kernels cuda-emulated` serves tiny checkpoints of every format the CUDA
kernels take through the real dispatch, prepared weights and launch code (csrc/cuda on the CPU emulator), and
its logits agree with the torch reference path.

Each test also asserts which kernels dispatch picked and which entries ran, so a CUDA kernel that stops being
picked for a layer it supports (or an op the runtime stops calling: MoE grouped GEMM, MLA decode, tree mask)
fails here.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.runtime.cuda import emulator
from quantkit.runtime.model import load_model
from quantkit.runtime.step import KVCache, step, tree_mask, tree_positions
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.skipif(emulator.compiler() is None, reason="no g++ on PATH")

# name: (family, size overrides, scheme, method, gptq options, linear kernel expected for every linear)
CASES = {
    "w4a16": ("llama", {}, "W4A16", "rtn", None, {"w4a16": {"cuda-emulated-w4a16": 14}}),
    "w4a16-asym": ("llama", {}, "W4A16_ASYM", "rtn", None, {"w4a16": {"cuda-emulated-w4a16": 14}}),
    "w4a16-act-order": ("llama", {}, "W4A16", "gptq", {"actorder": "group"}, {"w4a16": {"cuda-emulated-w4a16": 14}}),
    "w8a16": ("llama", {}, "W8A16", "rtn", None, {"w8a16": {"cuda-emulated-w8a16": 14}}),
    "w8a8": ("llama", {}, "W8A8", "rtn", None, {"int8": {"cuda-emulated-w8a8-int8": 14}}),
    # hidden 256: 128x128 blocks; intermediate 320: gate/up end in a ragged block of 64 rows, and down (K = 320)
    # is written per-channel FP8, a format no CUDA kernel takes: the reference serves it.
    "fp8-block": ("llama", dict(hidden_size=256, intermediate_size=320), "FP8_BLOCK", "rtn", None,
                  {"fp8": {"cuda-emulated-fp8-block": 12, "reference": 2}}),
    "moe": ("qwen3_moe", {}, "W4A16", "rtn", None, {"w4a16": {"cuda-emulated-w4a16": 32}}),
    "mla": ("deepseek_v3", {}, "W4A16", "rtn", None, {"w4a16": {"cuda-emulated-w4a16": 26}}),
}
OPS = {"moe": {"moe": {"cuda-emulated-moe-grouped-gemm": 2}},
       "mla": {"mla": {"cuda-emulated-mla-decode": 2}, "moe": {"cuda-emulated-moe-grouped-gemm": 1}}}
TREE = {"tree": {"cuda-emulated-tree-mask": 1}}
# Logits, emulated kernels against the reference: bf16 rounding of different summation orders (and for FP8 the
# reference's bf16 dequantised operands against the kernel's fp32 block-scale promotion), through two layers.
TOL = {"fp8-block": 6e-2, "w8a8": 2e-2}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from quantkit.pipeline.engine import quantize_model
    from quantkit.recipe import Recipe

    root = tmp_path_factory.mktemp("emulated")
    bases, out = {}, {}
    for name, (family, sizes, scheme, method, options, _) in CASES.items():
        key = (family, tuple(sorted(sizes.items())))
        if key not in bases:
            bases[key] = make_tiny_model(root / f"base-{len(bases)}", family, dtype=torch.bfloat16, **sizes)
        r = Recipe()
        r.model.source = str(bases[key])
        r.quantization.method, r.quantization.scheme = method, scheme
        r.quantization.group_size = 32 if scheme.startswith("W4") else -1
        if options:
            r.quantization.options = {method: options}
        r.calibration.num_samples, r.calibration.seq_len = 2, 16
        quantize_model(r, root / name)
        out[name] = root / name
    return out


def _logits(model, ids: torch.Tensor, decode_steps: int) -> torch.Tensor:
    """Prefill then `decode_steps` single-token steps (GEMV shapes, MLA decode); the last logits of each."""
    b, t = ids.shape
    cache = KVCache()
    rows = [step(model, ids, torch.arange(t)[None].expand(b, t), cache)[:, -1]]
    for i in range(decode_steps):
        rows.append(step(model, ids[:, i:i + 1], torch.full((b, 1), t + i), cache)[:, -1])
    return torch.stack(rows).float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", list(CASES))
def test_runtime_serves_every_format_with_the_cuda_kernels(ckpts, name):
    emu = emulator.emulator()
    model = load_model(ckpts[name], kernels="cuda-emulated")
    assert model.kernels == {**CASES[name][5], **OPS.get(name, {}), **TREE}
    ref = load_model(ckpts[name], kernels="reference")
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    emu.launched.clear()
    got = _logits(model, ids, decode_steps=3)
    ran = dict(emu.launched)
    assert _rel(got, _logits(ref, ids, decode_steps=3)) < TOL.get(name, 1e-2)
    if name.startswith(("w4", "w8a16")):  # prefill (40 rows) on the GEMM, decode (2 rows) on the GEMV
        bits = 8 if name == "w8a16" else 4
        assert ran[f"qk_w{bits}a16_gemm_bf16"] == 14 and ran[f"qk_w{bits}a16_gemv_bf16"] == 3 * 14
    if name == "moe":  # one align and one launch per projection per MoE layer and step, never one per expert
        assert ran["qk_moe_align"] == 2 * 4 and ran["qk_moe_w4a16_gemm_bf16"] == 3 * 2 * 4
    if name == "mla":  # prefill: transformers' attention over the latent cache; each decode step: the kernel
        assert ran["qk_mla_decode_split"] == ran["qk_mla_decode_combine"] == 2 * 3


def test_tree_verification_builds_its_mask_with_the_kernel_over_an_mla_cache(ckpts, monkeypatch):
    """A tree step over the joint latent cache, the accepted path kept, then a kernel decode step: logits as the
    reference path's; and speculative decoding's masks come from qk_tree_mask, equal to the torch masks."""
    from quantkit.runtime.speculative import decode
    from quantkit.runtime.speculative import ModelDraft, SpecConfig, parse_tree, speculative_generate

    emu = emulator.emulator()
    model = load_model(ckpts["mla"], kernels="cuda-emulated")
    ref = load_model(ckpts["mla"], kernels="reference")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    parents = [-1, 0, 0, 1, -1]
    tree = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    outs = []
    for m in (model, ref):
        cache = KVCache()
        step(m, ids, torch.arange(12)[None], cache)
        verify = step(m, tree, tree_positions(parents, 12), cache, tree_mask(parents, 12))[0]
        cache.keep(12, [0, 1, 3])
        nxt = step(m, ids[:, :1], torch.tensor([[15]]), cache)[0]
        outs.append(torch.cat([verify, nxt]).float())
    assert _rel(outs[0], outs[1]) < 1e-2

    seen = []
    real = decode.cuda_tree_mask

    def spy(net, par, prefix, device):
        mask = real(net, par, prefix, device)
        seen.append(torch.equal(mask, tree_mask(par, prefix)))
        return mask

    before = emu.launched["qk_tree_mask"]
    monkeypatch.setattr(decode, "cuda_tree_mask", spy)
    result = speculative_generate(model, ModelDraft(ref, "reference"), ids[0].tolist(),
                                  SpecConfig(parse_tree("static:2x2", 4), 6))
    assert len(result.tokens) == 6 and seen and all(seen)
    assert emu.launched["qk_tree_mask"] - before == len(seen)


runner = CliRunner()


@pytest.mark.parametrize("name", ["w4a16-act-order", "w8a8", "fp8-block", "moe", "mla"])
def test_quantkit_eval_with_the_emulated_device(ckpts, name):
    """`quantkit eval --kernels cuda-emulated` end to end: the report names the CUDA kernels and its KL agrees
    with the reference path's."""
    data = ["--num-samples", "2", "--seq-len", "24", "--json"]

    def run(kernels):
        res = runner.invoke(app, ["eval", str(ckpts[name]), *data, "--kernels", kernels], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)["results"][0]

    emu, ref = run("cuda-emulated"), run("reference")
    assert emu["kernels"] == {**CASES[name][5], **OPS.get(name, {}), **TREE}
    assert emu["kl_mean"] == pytest.approx(ref["kl_mean"], rel=0.1, abs=2e-5)
    assert emu["ppl"] == pytest.approx(ref["ppl"], rel=1e-2)


def test_unknown_kernels_is_one_line_naming_the_modes(ckpts):
    res = runner.invoke(app, ["eval", str(ckpts["w4a16"]), "--kernels", "bogus"])
    assert res.exit_code == 2 and "cuda-emulated" in res.output and "Traceback" not in res.output
