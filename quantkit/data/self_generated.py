"""Calibration text sampled from the model being quantised (`--dataset self`), and dataset mixtures
(`--dataset kjv:0.5,self:0.5`, components may be files).

Self-generated text follows the model's own distribution, needs no external data, and is not tied to one
domain: sequences start from seeded, varied openers and are sampled (temperature 1, top-p 0.95) in batches
with a KV cache. Results are cached on disk by (model files, seed, count, length).

The model writing it is streamed (`streamed_model`): transformers' model and generate, with each decoder layer
read from the safetensors for every forward call and dropped after it, so memory stays at one layer plus the
embeddings, head and KV cache whatever the model's size; it samples the same tokens as the whole model.
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import torch

from quantkit.errors import InputError
from quantkit.formats.files import publish

OPENERS = [
    "The history of", "In mathematics,", "def main():", "Dear Sir or Madam,", "Ingredients:", "Breaking news:",
    "Once upon a time", "The patient presented with", "Abstract. We", "import numpy as np", "Chapter 1",
    "Q: How do I", "The court held that", "To install the package,", "My favourite", "In 1848,", "Step 1:",
    "The weather today", "Photosynthesis is", "SELECT name FROM", "Hello! Can you", "The following table",
    "According to the report,", "Terms and conditions:", "The theory of", "<html>", "Yesterday I",
    "Dear diary,", "The stock market", "Here is a summary of", "Users can configure", "The first step in",
    "In this tutorial,", "Scientists have discovered", "The recipe calls for", "The match ended",
]
CACHE_DIR = Path(os.environ.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit")) / "self-calibration"


def parse_mixture(source: str) -> list[tuple[str, float]]:
    """`a:0.5,b:0.5` -> [(a, 0.5), (b, 0.5)]; a component without a weight gets 1. Weights are normalised."""
    parts = []
    for item in source.split(","):
        item = item.strip()
        if not item:
            continue
        name, weight = item, 1.0
        head, sep, tail = item.rpartition(":")
        if sep:
            try:
                weight = float(tail)
                name = head
            except ValueError:
                pass
        if weight <= 0:
            raise InputError(f"dataset mixture weight must be positive: {item!r}")
        parts.append((name, weight))
    if not parts:
        raise InputError("empty dataset specification")
    total = sum(w for _, w in parts)
    return [(n, w / total) for n, w in parts]


def is_special(source: str) -> bool:
    """True for sources this module builds: `self` or a mixture of several components."""
    parts = parse_mixture(source)
    return len(parts) > 1 or parts[0][0] == "self"


def _allocate(num: int, parts: list[tuple[str, float]]) -> list[int]:
    counts = [int(num * w) for _, w in parts]
    by_remainder = sorted(range(len(parts)), key=lambda i: -(num * parts[i][1] - counts[i]))
    for i in by_remainder[: num - sum(counts)]:
        counts[i] += 1
    return counts


def _model_key(model_path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(model_path.iterdir()):
        if f.is_file() and f.suffix in (".json", ".safetensors"):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


class _StreamedLayer(torch.nn.Module):
    """Stands where decoder layer i was: each call reads the layer from the checkpoint, runs it, and lets it go,
    so one decoder layer is resident at a time (the KV cache is the caller's). `resident` counts live layers."""

    def __init__(self, handle, index: int, dtype: torch.dtype, meta: torch.nn.Module, resident: list[int]):
        super().__init__()
        self._handle, self._meta, self._resident = [handle], [meta], resident  # lists: not submodules
        self._shell: list[torch.nn.Module] = []  # the layer's module tree, built once; weights on meta between calls
        self.index, self.dtype = index, dtype
        for key, value in vars(meta).items():  # what the model's forward reads of a layer (attention_type...)
            if not key.startswith("_") and isinstance(value, (bool, int, float, str)):
                setattr(self, key, value)

    def forward(self, *args, **kwargs):
        handle = self._handle[0]
        if not self._shell:
            self._shell.append(handle.meta_layer(self.index, self._meta[0]))
        layer = handle.materialize_layer(self.index, self.dtype, shell=self._shell[0])
        self._resident[0] += 1
        self._resident[1] = max(self._resident[1], self._resident[0])
        try:
            return layer(*args, **kwargs)
        finally:
            self._resident[0] -= 1
            for module in layer.modules():  # the weights go back to meta: read again at the next call
                for leaf, p in module._parameters.items():
                    if p is not None:
                        module._parameters[leaf] = torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                                                      requires_grad=False)


def streamed_model(model_path: Path, dtype: torch.dtype):
    """The causal LM at model_path for generation with one decoder layer resident: transformers' own model
    (its forward, generate and KV cache) built on meta, its embeddings, final norm and head read once, each
    decoder layer read from the safetensors for every forward call. `model.streamed_peak` is the most decoder
    layers that were ever resident together."""
    from quantkit.models.loader import _get, open_model
    from quantkit.models.source import ResolvedModel

    handle = open_model(ResolvedModel(Path(model_path), str(model_path)))
    model = handle.skeleton
    model.config._attn_implementation = _default_attention(handle.config)  # the skeleton's forced sdpa may not fit
    layers = handle.layers()
    resident = [0, 0]
    for i in range(len(layers)):
        layers[i] = _StreamedLayer(handle, i, dtype, layers[i], resident)
    root = handle.adapter.layers_path + "."
    tops = sorted({name.rpartition(".")[0] for name, p in model.named_parameters()
                   if p.is_meta and not name.startswith(root)})
    tied = getattr(handle.config, "tie_word_embeddings", False)
    head = model.get_output_embeddings()
    for path in tops:
        module = _get(model, path)
        if tied and module is head:
            continue
        if any(p.is_meta for p in module.parameters(recurse=False)):
            handle.materialize_module(path, dtype)
    if tied:
        head._parameters["weight"] = model.get_input_embeddings().weight
    # Generation scores the last position only, a slice matmul cannot fold into one GEMM unless the weight
    # requires grad: otherwise it goes to bmm, which copies the head once per sequence of the batch (16 x 57 MB
    # for SmolLM2's). Nothing is recorded: generate runs under no_grad.
    head.weight.requires_grad_(True)
    model.streamed_peak = lambda: resident[1]
    return model.eval()


def _default_attention(config) -> str:
    """The attention transformers picks for this config by itself (Gemma 2's logit soft-capping refuses sdpa)."""
    import copy
    import warnings

    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    fresh = copy.deepcopy(config)
    fresh._attn_implementation = None
    with warnings.catch_warnings(), init_empty_weights(include_buffers=False):
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(fresh).config._attn_implementation


def generate_blocks(model_path: str | Path, num_samples: int, seq_len: int, seed: int, batch_size: int = 16,
                    top_p: float = 0.95) -> torch.Tensor:
    """[num_samples, seq_len] token ids sampled from the model at model_path."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    model_path = Path(model_path)
    key = f"{_model_key(model_path)}-{seed}-{num_samples}-{seq_len}-{top_p}"
    cached = CACHE_DIR / f"{key}.safetensors"
    if cached.is_file():
        return load_file(str(cached))["input_ids"]
    tok = AutoTokenizer.from_pretrained(str(model_path))
    model = streamed_model(model_path, torch.bfloat16)
    rng = random.Random(seed)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None and tok("a").input_ids[:1] == [tok.bos_token_id] else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    rows: list[list[int]] = []
    torch_gen_seed = seed
    while len(rows) < num_samples:
        n = min(batch_size, num_samples - len(rows))
        prompts = [bos + tok(rng.choice(OPENERS), add_special_tokens=False).input_ids for _ in range(n)]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        torch.manual_seed(torch_gen_seed)
        torch_gen_seed += 1
        new = seq_len - min(len(p) for p in prompts)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=top_p,
                                 top_k=0, max_new_tokens=new, min_new_tokens=new, pad_token_id=pad)
        for r, p in enumerate(prompts):
            rows.append(out[r, width - len(p):][:seq_len].tolist())
    ids = torch.tensor(rows, dtype=torch.int64)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    save_file({"input_ids": ids}, str(tmp), metadata={"model": str(model_path), "key": key})
    publish(tmp, cached)
    return ids


def build_mixture(tokenizer, source: str, num_samples: int, seq_len: int, seed: int, split: str,
                  text_column: str | None, build_one, self_blocks=None):
    """Token blocks for `self` or a mixture: each component contributes its share of the samples
    (rounded by largest remainder); `build_one` builds a plain source's blocks; `self_blocks(count, seq_len, seed)`,
    where given, writes the `self` share instead of generating it from the tokenizer's model folder."""
    from quantkit.data.calibration import CalibrationSet

    parts = parse_mixture(source)
    counts = _allocate(num_samples, parts)
    blocks, available = [], 0
    for (name, _), count in zip(parts, counts):
        if count == 0:
            continue
        if name == "self" and self_blocks is not None:
            ids = self_blocks(count, seq_len, seed if split == "calibration" else seed + 1_000_003)
            available += ids.numel()
        elif name == "self":
            model_path = getattr(tokenizer, "name_or_path", None)
            if not model_path or not Path(model_path).is_dir():
                raise InputError("--dataset self needs the model's folder (the tokenizer was not loaded from one)")
            # Held-out text comes from a different seed, so it never repeats calibration samples.
            gen_seed = seed if split == "calibration" else seed + 1_000_003
            ids = generate_blocks(model_path, count, seq_len, gen_seed)
            available += ids.numel()
        else:
            part = build_one(tokenizer, name, count, seq_len, seed, split, text_column)
            ids, available = part.input_ids, available + part.available_tokens
        blocks.append(ids)
    ids = torch.cat(blocks)
    order = list(range(ids.shape[0]))
    random.Random(seed).shuffle(order)
    return CalibrationSet(ids[order], source, split, seed, available)


__all__ = ["build_mixture", "generate_blocks", "is_special", "parse_mixture"]
