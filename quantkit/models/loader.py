"""A lazy model handle: the transformers skeleton on the meta device, with one decoder layer (or one
top-level module) materialised at a time from memory-mapped safetensors."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantkit.errors import InputError
from quantkit.models.adapters import Adapter, adapter_for_model, split_stored_layer_name
from quantkit.models.experts import UnfusedExperts, unfuse_experts
from quantkit.models.safetensors_index import SafetensorsIndex
from quantkit.models.source import ResolvedModel


def _get(module: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _set(module: nn.Module, path: str, value: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(module, parent) if parent else module, name, value)


@dataclass
class ModelHandle:
    source: ResolvedModel
    config: object
    adapter: Adapter
    index: SafetensorsIndex
    skeleton: nn.Module  # parameters on meta, buffers real (rotary tables etc.)
    trust_remote_code: bool = False
    _fused_layouts: dict = field(default_factory=dict)
    _renamed: dict | None = None  # module tensor name -> stored name, where transformers renames on load

    @property
    def path(self) -> Path:
        return self.source.path

    @property
    def num_layers(self) -> int:
        return len(self.layers())

    def layers(self) -> nn.ModuleList:
        return _get(self.skeleton, self.adapter.layers_path)

    def layer_prefix(self, i: int) -> str:
        """Where layer i's tensors are stored (checkpoint names)."""
        return f"{self.adapter.checkpoint_layers_path}.{i}."

    def source_dtype(self) -> torch.dtype:
        """The dtype most floating tensors have on disk (what unquantised outputs are written in)."""
        counts: dict[torch.dtype, int] = {}
        for name in self.index.names():
            dt = self.index.dtype(name)
            if dt.is_floating_point:
                counts[dt] = counts.get(dt, 0) + self.index.tensors[name].nbytes
        return max(counts, key=counts.get) if counts else torch.float32

    def layer_checkpoint_names(self, i: int) -> list[str]:
        prefix = self.layer_prefix(i)
        return [n for n in self.index.names() if n.startswith(prefix)]

    def non_layer_checkpoint_names(self) -> list[str]:
        """Tensors outside the decoder layers the skeleton has, in checkpoint order: embeddings, final norm, head,
        and layers past the last one (DeepSeek-V3's multi-token-prediction blocks, `num_nextn_predict_layers`,
        stored as model.layers.N... but not part of transformers' model), which are kept as they are."""
        extra = set(self.extra_layer_indices())
        layer_root = self.adapter.checkpoint_layers_path + "."
        return [n for n in self.index.names() if not n.startswith(layer_root) or self._layer_index(n) in extra]

    def _layer_index(self, name: str) -> int | None:
        head = name[len(self.adapter.checkpoint_layers_path) + 1:].partition(".")[0]
        return int(head) if head.isdigit() else None

    def extra_layer_indices(self) -> list[int]:
        """Indices of checkpoint layers beyond the skeleton's decoder layers (multi-token-prediction blocks).
        Without a skeleton (the data-free FP8 stream) every stored layer is planned alike, MTP blocks included."""
        if self.skeleton is None:
            return []
        layer_root = self.adapter.checkpoint_layers_path + "."
        found = {self._layer_index(n) for n in self.index.names() if n.startswith(layer_root)}
        return sorted(i for i in found if i is not None and i >= self.num_layers)

    def meta_layer(self, i: int, source: nn.Module | None = None) -> nn.Module:
        """A meta-device copy of decoder layer i (or of `source`, the skeleton's layer i kept elsewhere) with fused
        MoE experts replaced by per-expert linears."""
        import copy

        layer = copy.deepcopy(self.layers()[i] if source is None else source)
        layout = self.adapter.experts
        if layout is not None:
            try:
                fused = _get(layer, layout.module)
            except AttributeError:
                fused = None  # a dense layer inside a MoE model (DeepSeek's first_k_dense_replace)
            if fused is not None and hasattr(fused, "gate_up_proj"):
                _set(layer, layout.module, unfuse_experts(fused, layout))
        return layer

    def materialize_layer(self, i: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                          shell: nn.Module | None = None) -> nn.Module:
        """A real copy of decoder layer i (experts unfused), weights read from disk and cast to `dtype`; into
        `shell` (an earlier meta_layer(i) whose weights went back to meta) where one is given."""
        layer = shell if shell is not None else self.meta_layer(i)
        prefix = self.layer_prefix(i)
        # Each parameter is swapped in as it is read (no empty copy of the whole layer first): peak is one
        # layer, not two.
        for name, _ in list(layer.named_parameters()):
            ckpt = prefix + self.adapter.to_checkpoint(self._experts_ckpt_name(name))
            tensor = self.index.get(ckpt).to(dtype).to(device)
            parent, _, leaf = name.rpartition(".")
            owner = _get(layer, parent) if parent else layer
            owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        for name, buf in list(layer.named_buffers()):
            parent, _, leaf = name.rpartition(".")
            owner = _get(layer, parent) if parent else layer
            if buf.device.type == "meta":
                raise InputError(f"layer {i}: buffer {name} has no value (not in the checkpoint)")
            owner._buffers[leaf] = buf.to(device)
        # No autograd: also keeps autocast from caching stale low-precision copies of edited weights.
        return layer.to(dtype).eval().requires_grad_(False)

    def _experts_ckpt_name(self, local: str) -> str:
        """Unfused expert params are named `<module>.experts.<e>.<proj>.weight`; on disk the list level is the module."""
        layout = self.adapter.experts
        if layout is not None and local.startswith(layout.module + ".experts."):
            return layout.module + "." + local[len(layout.module + ".experts."):]
        return local

    def checkpoint_name(self, i: int, local_module: str) -> str:
        """Full checkpoint name of a layer-local module (as it must be written for vLLM)."""
        return self.layer_prefix(i) + self.adapter.to_checkpoint(self._experts_ckpt_name(local_module))

    def materialize_module(self, path: str, dtype: torch.dtype | None = torch.float32, device: str = "cpu",
                           mapped: bool = False) -> nn.Module:
        """Load a top-level module (embeddings, final norm) in place in the skeleton; returns it.
        `mapped` (CPU, dtype None = as stored) leaves the weights memory-mapped instead of read."""
        module = _get(self.skeleton, path)
        if self._renamed is None:
            self._renamed = renamed_checkpoint_names(self.skeleton, self.index.names())
        for name, param in list(module.named_parameters()):
            full = f"{path}.{name}"
            full = self._renamed.get(full, full)
            if full not in self.index and name == "weight" and module is self.skeleton.get_output_embeddings():
                full = self._renamed.get(self.embedding_path() + ".weight", self.embedding_path() + ".weight")
            if mapped and dtype is None and device == "cpu":
                tensor = self.index.mapped(full)
            else:
                tensor = self.index.get(full)
                tensor = tensor.to(dtype or tensor.dtype).to(device)
            parent, _, leaf = name.rpartition(".")
            owner = _get(module, parent) if parent else module
            owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        return module

    def release_module(self, path: str) -> None:
        module = _get(self.skeleton, path)
        for name, param in list(module.named_parameters()):
            parent, _, leaf = name.rpartition(".")
            owner = _get(module, parent) if parent else module
            owner._parameters[leaf] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)

    def embedding_path(self) -> str:
        emb = self.skeleton.get_input_embeddings()
        for name, module in self.skeleton.named_modules():
            if module is emb:
                return name
        raise InputError("cannot locate the input embedding module")

    def around_layers(self) -> list[str]:
        """Paths of the base model's modules besides its decoder layers that hold weights still on meta: the
        embedding, learned positions, norms (not a vision tower, which sits outside the base model)."""
        prefix = self.adapter.layers_path.rpartition(".")[0]
        layers = self.layers()
        return [f"{prefix}.{n}" if prefix else n for n, c in self.base_model().named_children()
                if c is not layers and any(p.is_meta for p in c.parameters())]

    def base_model(self) -> nn.Module:
        """The module that owns the decoder layers (its forward runs embeddings -> layers -> norm)."""
        parent = self.adapter.layers_path.rpartition(".")[0]
        return _get(self.skeleton, parent) if parent else self.skeleton


def open_model(source: ResolvedModel, trust_remote_code: bool = False) -> ModelHandle:
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(source.path), trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise InputError(f"cannot read config.json of {source.path}: {str(exc).splitlines()[0]}") from None
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        check_source_quantization(qc if isinstance(qc, dict) else qc.to_dict(), source.path)
        del config.quantization_config  # native FP8: the index dequantises, the skeleton is the dense model
    index = SafetensorsIndex(source.path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with init_empty_weights(include_buffers=False):
            skeleton = build_skeleton(source.path, config, trust_remote_code)
    skeleton.eval()
    renamed = renamed_checkpoint_names(skeleton, index.names())
    adapter = with_stored_layers(adapter_for_model(config, skeleton, index.names(), renamed), renamed)
    return ModelHandle(source, config, adapter, index, skeleton, trust_remote_code, _renamed=renamed)


def with_stored_layers(adapter: Adapter, renamed: dict[str, str]) -> Adapter:
    """`adapter` with its stored_layers_path set where transformers renames the layers' stored names on load
    (`renamed`: renamed_checkpoint_names)."""
    import dataclasses

    root = adapter.layers_path + "."
    for module_name, stored in renamed.items():
        index = module_name[len(root):].partition(".")[0]
        split = split_stored_layer_name(stored, int(index)) if module_name.startswith(root) and index.isdigit() \
            else None
        if split and split[0] != adapter.layers_path:
            return dataclasses.replace(adapter, stored_layers_path=split[0])
    return adapter


def renamed_checkpoint_names(model: nn.Module, names) -> dict[str, str]:
    """Module tensor name -> checkpoint name for the stored names transformers renames on load (GPT-NeoX's
    `embed_out` is its `lm_head`), from transformers' own list of plain renamings; other names map to themselves."""
    import re

    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        renamings = [(src, dst) for t in get_model_conversion_mapping(model) if type(t) is WeightRenaming
                     for src, dst in zip(t.source_patterns, t.target_patterns * len(t.source_patterns))]
    except (ImportError, AttributeError, TypeError):  # a transformers without the mapping: names as stored
        return {}
    out = {}
    for name in names:
        renamed = name
        for src, dst in renamings:
            renamed = re.sub(src, dst, renamed)
        if renamed != name:
            out[renamed] = name
    return out


def build_skeleton(path: Path, config, trust_remote_code: bool = False) -> nn.Module:
    """transformers' model for `config` with SDPA attention where the architecture has it and eager where it does
    not (Gemma 2's logit softcapping): deterministic, and no optional attention packages."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    # A vision-language config (Qwen2-VL, Mistral 3) has no causal-LM class: its image-text-to-text one.
    auto = AutoModelForCausalLM
    if type(config) not in auto._model_mapping and type(config) in AutoModelForImageTextToText._model_mapping:
        auto = AutoModelForImageTextToText
    for attention in ("sdpa", "eager"):
        try:
            return auto.from_config(config, trust_remote_code=trust_remote_code, attn_implementation=attention)
        except ValueError as exc:
            if attention == "eager" or "scaled_dot_product_attention" not in str(exc):
                raise InputError(f"{path}: {str(exc).splitlines()[0]}") from None


def check_source_quantization(qc: dict | None, path: Path) -> None:
    """Accept an unquantised source, or a native FP8 one (read dequantised); refuse anything else quantised."""
    if not qc:
        return
    method = qc.get("quant_method", "?")
    if method == "fp8":
        return
    raise InputError(
        f"{path} is already quantised ({method}); quantising it again would compound the error: "
        f"start from the original unquantised model (or a native FP8 one)"
    )


def read_config_json(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())
