"""GGUF conversion one tensor at a time against transformers' own whole-model path (the oracle: it loads the GGUF
in fp32 with from_pretrained(gguf_file=...)), on the real SmolLM2 GGUF (Q4_1)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from quantkit.models import gguf
from quantkit.models.source import default_gguf_path


@pytest.mark.slow
def test_streaming_conversion_equals_transformers_whole_model(tmp_path):
    src = default_gguf_path()
    stream, whole = tmp_path / "stream", tmp_path / "whole"
    stream.mkdir()
    whole.mkdir()
    assert gguf.convert(src, stream) == "streaming"
    gguf.convert_whole(src, whole)
    a, b = load_file(str(stream / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    assert set(a) == set(b) and len(a) > 100
    for name in a:  # Llama's Q/K rows un-permuted exactly as transformers does, every value the same bf16
        assert a[name].dtype == torch.bfloat16 and torch.equal(a[name], b[name]), name
    assert json.loads((stream / "config.json").read_text()) == json.loads((whole / "config.json").read_text())
    assert (stream / "tokenizer.json").read_text() == (whole / "tokenizer.json").read_text()


def test_processors_that_combine_tensors_take_the_whole_model_path():
    from transformers import modeling_gguf_pytorch_utils as g

    assert gguf._per_tensor_processor(g.LlamaTensorProcessor(config={}))
    assert gguf._per_tensor_processor(g.TensorProcessor(config={}))
    if hasattr(g, "Qwen2MoeTensorProcessor"):  # experts assembled from several GGUF tensors
        assert not gguf._per_tensor_processor(g.Qwen2MoeTensorProcessor(config={}))
