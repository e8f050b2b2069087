"""Shared fixtures: tiny random models of each supported family, saved as HF folders, and the real model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("QUANTKIT_NO_PROGRESS", "1")
# Tests that name the kernel serving a layer must not depend on a timing: the registration order serves, and the
# measured choice is tested on its own (tests/runtime/test_kernel_choice.py).
os.environ.setdefault("QUANTKIT_KERNEL_CHOICE", "priority")
# Never the user's ~/.cache/quantkit: the suite's converted models and generated data live in the checkout (kept
# between runs, so the embedded GGUF is converted once), unless the caller names a cache (CI does).
os.environ.setdefault("QUANTKIT_CACHE", str(Path(__file__).resolve().parents[1] / ".cache-test"))

# A failed assertion names tensors in its explanation: a few items each, not whole tensors.
torch.set_printoptions(threshold=16, edgeitems=2, linewidth=120)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)

FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma": {"head_dim": 16},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 16,
                    "qk_nope_head_dim": 16, "v_head_dim": 16, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
                    "num_key_value_heads": 4},
}


def make_tiny_model(folder: Path, family: str, dtype=torch.float32, seed: int = 0, **overrides) -> Path:
    """A randomly initialised model of `family`, saved with its tokenizer-free config as an HF folder.

    A family outside FAMILIES (any model type transformers knows) gets TINY plus `overrides` only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = {**TINY, **FAMILIES.get(family, {}), **overrides}
    config = AutoConfig.for_model(family, **kwargs)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    # Random init of norms is all ones; perturb them so folding/scaling bugs cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.config.dtype = str(dtype).replace("torch.", "")
    model.save_pretrained(folder)
    _write_tokenizer(folder, kwargs["vocab_size"])
    return folder


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE-free word tokenizer over a tiny vocabulary, enough for calibration on plain text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    for i, ch in enumerate("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;'!?-()"):
        vocab[ch] = 4 + i
        vocab.pop(f"<{4 + i}>", None)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", eos_token="<2>", bos_token="<1>")
    fast.save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_model(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real embedded model (converted once into the quantkit cache)."""
    from quantkit.models.source import resolve_model

    return resolve_model(None).path


@pytest.fixture()
def text_file(tmp_path) -> Path:
    """Plain English text from the built-in KJV manifest, as a local .txt file."""
    from quantkit.data.calibration import load_documents

    path = tmp_path / "calib.txt"
    path.write_text("\n\n".join(load_documents("kjv")[:200]))
    return path
