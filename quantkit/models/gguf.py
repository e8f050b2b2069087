"""GGUF -> an HF safetensors folder (bf16), one tensor at a time.

transformers reads the GGUF's metadata (config, tokenizer) and supplies the architecture's name map and tensor
processor (`modeling_gguf_pytorch_utils`); the tensors themselves are dequantised here in blocks of rows straight
into their bf16 slot of a planned safetensors file, so the conversion holds about one bf16 tensor instead of the
whole model in fp32 (what `from_pretrained(gguf_file=...)` builds). Architectures whose tensor processor builds
tensors across several GGUF entries (fused MoE experts) keep transformers' whole-model path (`convert_whole`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from quantkit.errors import InputError

ROWS_PER_BLOCK_BYTES = 1 << 24  # fp32 bytes dequantised at a time (16 MB)


def _plain_config(config):
    """The GGUF's config as a plain bf16 model's (transformers marks a GGUF-loaded model as quantised)."""
    from transformers import AutoConfig

    d = config.to_dict()
    d.pop("quantization_config", None)
    d.pop("_name_or_path", None)
    plain = AutoConfig.for_model(**d)
    plain.dtype = "bfloat16"
    return plain


def _per_tensor_processor(processor) -> bool:
    """True for processors that map one GGUF tensor to one HF tensor of the same shape (no cross-tensor state)."""
    from transformers import modeling_gguf_pytorch_utils as g

    names = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor", "NemotronTensorProcessor",
             "Lfm2TensorProcessor")
    return type(processor) in tuple(getattr(g, n) for n in names if hasattr(g, n))


def convert_streaming(gguf: Path, out: Path) -> bool:
    """Write config, tokenizer and bf16 safetensors of `gguf` into the empty folder `out`; False (nothing
    written) where the architecture needs transformers' whole-model path."""
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as g

    from quantkit.formats.safetensors_writer import PlannedShardWriter, TensorSpec

    from quantkit.pipeline.memory import release_freed_memory

    # Every parse of the metadata (the tokenizer's vocabulary and merges as Python objects: ~160 MB for a 49k
    # vocabulary) is a transient as large as the model's biggest tensor, so each is done alone and dropped:
    # the tensor list first (its metadata fields released), then the config, then the tokenizer.
    reader = GGUFReader(gguf)
    tensors = list(reader.tensors)
    reader.fields.clear()
    del reader
    release_freed_memory()
    try:
        parsed = g.load_gguf_checkpoint(str(gguf), return_tensors=False)
        arch_config = parsed["config"]
        config = _plain_config(AutoConfig.for_model(**arch_config))
        del parsed
        release_freed_memory()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:
        raise InputError(f"cannot read GGUF file {gguf}: {str(exc).splitlines()[0]}") from None
    processor = g.TENSOR_PROCESSORS.get(arch_config.get("model_type"), g.TensorProcessor)(config=arch_config)
    if not _per_tensor_processor(processor):
        return False
    tokenizer.save_pretrained(out)
    del tokenizer
    release_freed_memory()
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    mapping = g.get_gguf_hf_weights_map(skeleton, processor)
    plan = [(t, mapping[t.name]) for t in tensors if t.name in mapping and mapping[t.name] in shapes]
    specs = [TensorSpec(hf, torch.bfloat16, shapes[hf]) for _, hf in plan]
    writer = PlannedShardWriter(out, specs)
    parsed = {"config": arch_config, "tensors": {}}  # what a per-tensor processor may read
    try:
        with open(gguf, "rb") as fh:
            for tensor, hf in plan:
                writer.write(hf, _bf16(fh, tensor, shapes[hf], processor, mapping, parsed, dequantize))
    finally:
        writer.close()
    writer.write_index()
    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(out)
    if skeleton.can_generate():
        skeleton.generation_config.save_pretrained(out)
    return True


def _changes(processor, name: str) -> bool:
    """Whether transformers' processor transforms this tensor (else it is the dequantised values as they are)."""
    kind = type(processor).__name__
    if kind == "TensorProcessor":
        return False
    if kind == "LlamaTensorProcessor":  # llama.cpp permutes Q and K rows for its rotary layout
        return ".attn_q." in name or ".attn_k." in name
    return True


def _read(fh, tensor, r0: int, r1: int) -> np.ndarray:
    """Rows [r0, r1) of a GGUF tensor's stored data (a 1-D tensor is one row), read from the file: the reader's
    memory map is never touched, so the file's pages never count as the process's memory."""
    data = tensor.data
    row_shape = data.shape[1:] if data.ndim > 1 else data.shape
    per_row = int(np.prod(row_shape)) * data.dtype.itemsize
    fh.seek(int(tensor.data_offset) + r0 * per_row)
    return np.frombuffer(fh.read((r1 - r0) * per_row), dtype=data.dtype).reshape(r1 - r0, *row_shape)


def _bf16(fh, tensor, shape, processor, mapping, parsed, dequantize) -> torch.Tensor:
    """One GGUF tensor as its HF bf16 tensor: processed whole where the processor changes it, else dequantised
    a block of rows at a time into the bf16 result."""
    rows = tensor.data.shape[0] if tensor.data.ndim > 1 else 1
    if rows == 1 or _changes(processor, tensor.name):
        raw = _read(fh, tensor, 0, rows).reshape(tensor.data.shape)
        weights = processor.process(weights=dequantize(raw, tensor.tensor_type), name=tensor.name,
                                    tensor_key_mapping=mapping, parsed_parameters=parsed).weights
        return torch.from_numpy(np.array(weights, dtype=np.float32)).to(torch.bfloat16).reshape(shape)
    out = torch.empty(shape, dtype=torch.bfloat16)
    flat = out.view(rows, -1)
    step = max(1, ROWS_PER_BLOCK_BYTES // (4 * flat.shape[1]))
    for r0 in range(0, rows, step):
        block = dequantize(_read(fh, tensor, r0, min(rows, r0 + step)), tensor.tensor_type)
        flat[r0:r0 + block.shape[0]] = torch.from_numpy(block.reshape(block.shape[0], -1))
    return out


def convert_whole(gguf: Path, out: Path) -> None:
    """transformers' whole-model path: the model loaded in fp32 from the GGUF, saved as a plain bf16 model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:
        raise InputError(f"cannot read GGUF file {gguf}: {str(exc).splitlines()[0]}") from None
    plain = AutoModelForCausalLM.from_config(_plain_config(loaded.config), dtype=torch.bfloat16)
    plain.load_state_dict({k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}, strict=False)
    plain.tie_weights()
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def convert(gguf: Path, out: Path, streaming: bool = True) -> str:
    """Convert into the empty folder `out`; returns the path taken ("streaming" or "whole")."""
    if streaming and convert_streaming(gguf, out):
        return "streaming"
    for f in out.iterdir():
        f.unlink()
    convert_whole(gguf, out)
    return "whole"


def describe(out: Path, how: str, gguf: Path, digest: str) -> None:
    (out / "quantkit_source.json").write_text(json.dumps({"gguf": str(gguf), "sha256_prefix": digest,
                                                          "conversion": how}))
