"""Checkpoints in every compressed-tensors format the runtime reads, written by compressed-tensors itself.

A tiny bf16 Llama gets a quantisation config applied, min/max quantisation parameters (and, for static
activations, input scales from a calibration pass), then compressed-tensors' ModelCompressor compresses
and saves it: exactly what llm-compressor produces, independent of quantkit's writer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import make_tiny_model


def _minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    s = str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)
    if s == "tensor":
        lo, hi = torch.aminmax(w)
        return lo.reshape(1), hi.reshape(1)
    if s == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if s == "group":
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    if s == "block":
        bh, bw = args.block_structure
        r, c = w.shape
        b = w.reshape(r // bh, bh, c // bw, bw)
        return b.amin((1, 3)), b.amax((1, 3))
    raise ValueError(s)


def build_ct_checkpoint(base: Path, out: Path, scheme, static_input: bool = False) -> Path:
    """`scheme`: a compressed-tensors preset name (W8A8, FP8, FP8_DYNAMIC, FP8_BLOCK) or QuantizationScheme kwargs."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationScheme, QuantizationStatus,
                                                 apply_quantization_config, preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    if isinstance(scheme, str):
        qscheme = preset_name_to_scheme(scheme, ["Linear"])
    else:
        qscheme = QuantizationScheme(targets=["Linear"], **scheme)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": qscheme}, ignore=["lm_head"]))
    qmods = {n: m for n, m in model.named_modules() if hasattr(m, "quantization_scheme")}
    if static_input:
        stats: dict = {}

        def hook(name):
            def record(_, args):
                lo, hi = torch.aminmax(args[0])
                old = stats.get(name)
                stats[name] = (lo, hi) if old is None else (torch.minimum(old[0], lo), torch.maximum(old[1], hi))
            return record

        handles = [m.register_forward_pre_hook(hook(n)) for n, m in qmods.items()]
        for m in qmods.values():
            m.quantization_enabled = False
        with torch.no_grad():
            model(torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1)))
        for h in handles:
            h.remove()
        for n, m in qmods.items():
            m.quantization_enabled = True
            scale, zp = calculate_qparams(stats[n][0].reshape(1), stats[n][1].reshape(1),
                                          m.quantization_scheme.input_activations)
            m.input_scale.data.copy_(scale)
            if hasattr(m, "input_zero_point"):
                m.input_zero_point.data.copy_(zp)
    for m in qmods.values():
        args = m.quantization_scheme.weights
        scale, zp = calculate_qparams(*_minmax(m.weight.data, args), args)
        m.weight_scale.data.copy_(scale)
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zp)
        m.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    return out


def ct_cases():
    from compressed_tensors.quantization import QuantizationArgs

    def w(**kw):
        return QuantizationArgs(type="int", **kw)

    return {
        "w4a16_sym_g32": (dict(weights=w(num_bits=4, symmetric=True, strategy="group", group_size=32)), False),
        "w4a16_asym_g32": (dict(weights=w(num_bits=4, symmetric=False, strategy="group", group_size=32)), False),
        "w8a16_channel": (dict(weights=w(num_bits=8, symmetric=True, strategy="channel")), False),
        "w8a8_int_dynamic": ("W8A8", False),
        "w8a8_int_static": (dict(weights=w(num_bits=8, symmetric=True, strategy="channel"),
                                 input_activations=w(num_bits=8, symmetric=True, strategy="tensor", dynamic=False)), True),
        "fp8_static": ("FP8", True),
        "fp8_dynamic": ("FP8_DYNAMIC", False),
        "fp8_block": ("FP8_BLOCK", False),
    }


def make_base(folder: Path, hidden: int = 64) -> Path:
    """A bf16 tiny Llama (hidden 256 when 128x128 blocks must fit)."""
    return make_tiny_model(folder, "llama", dtype=torch.bfloat16, hidden_size=hidden, intermediate_size=2 * hidden,
                           tie_word_embeddings=False)
