"""Load a compressed-tensors checkpoint (or a plain HF model) into quantkit's runtime modules.

The transformers skeleton is built from config.json (without its quantization_config) on the meta
device, so every architecture transformers knows keeps its own attention, norms and rotary code. Fused
MoE experts become per-expert modules (`UnfusedExperts`) and sparse-MoE blocks the runtime's own
`RuntimeMoE` (explicit router, observer hooks: `runtime/moe.py`); every linear that has quantised tensors on
disk becomes a `QuantLinear` (its tensors checked against the config first); everything else is read from
the safetensors as it is. Then each QuantLinear is offered to the kernels of its device (`dispatch`), which
repack it once into their own layout.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantkit.errors import InputError
from quantkit.models.adapters import Adapter, adapter_for, adapter_for_model, find_layers_path
from quantkit.models.experts import unfuse_experts
from quantkit.models.loader import (ModelHandle, _get, _set, build_skeleton, renamed_checkpoint_names,
                                    with_stored_layers)
from quantkit.models.safetensors_index import SafetensorsIndex
from quantkit.models.source import ResolvedModel
from quantkit.runtime import dispatch
from quantkit.runtime.cuda.ops import install as install_cuda_ops
from quantkit.runtime.cuda.ops import launcher_for
from quantkit.runtime.formats import INPUT_TENSORS, WEIGHT_TENSORS, QuantConfig, parse_quantization_config
from quantkit.runtime.linear import DenseLinear, QuantLinear, dense_parameter
from quantkit.runtime.moe import install_inferred_moe, install_runtime_moe
from quantkit.runtime.validate import check_linear_tensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RuntimeModel:
    model: nn.Module  # a transformers CausalLM with quantkit modules inside
    path: Path
    config: object
    dtype: torch.dtype
    device: torch.device
    quant_config: QuantConfig | None = None
    formats: dict[str, int] = field(default_factory=dict)  # op kind -> number of quantised linears
    kernels: dict[str, dict[str, int]] = field(default_factory=dict)  # op kind -> kernel name -> linears served
    # Where several kernels could serve a layer signature: the measured choice (kernels/choice.py), as dicts.
    kernel_choice: list[dict] = field(default_factory=list)
    kv_cache: str | None = None  # the fp8 KV cache simulated ("tensor" / "attn_head" scales), None: 16-bit

    @property
    def resident_weight_bytes(self) -> int:
        """Bytes of every tensor the model holds (parameters, buffers, kernels' prepared tensors), each
        storage counted once (tied embeddings, zero-copy kernel views of checkpoint tensors)."""
        return resident_bytes(self.model)

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def resident_bytes(model: nn.Module) -> int:
    storages: dict[tuple, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for m in model.modules() if isinstance(m, QuantLinear) and m.prepared is not None
                for t in m.prepared.tensors()]
    for t in tensors:
        if t.device.type == "meta":
            continue
        st = t.untyped_storage()
        key = (t.device.type, t.device.index, st.data_ptr())
        storages[key] = max(storages.get(key, 0), st.nbytes())
    return sum(storages.values())


def check_model_folder(path: Path, what: str = "checkpoint") -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise InputError(f"{what} {path} does not exist")
    if not path.is_dir():
        raise InputError(f"{what} {path} is not a model folder")
    if not (path / "config.json").is_file():
        raise InputError(f"{what} {path} is not a model: config.json is missing")
    if not any(path.glob("*.safetensors")):
        raise InputError(f"{what} {path} is not a model: it has no .safetensors weights")
    return path


def resolve_dtype(path: Path, dtype: torch.dtype | str | None = None) -> torch.dtype:
    """The compute dtype: `dtype` if given (not "auto"), else the dtype config.json names."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in (None, "auto"):
        return DTYPES[dtype]
    cfg = read_config(path)
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    return DTYPES.get(name.replace("torch.", ""), torch.float32)


def _generic_adapter(model_type: str, model: nn.Module | None = None, names=None,
                     renamed: dict[str, str] | None = None) -> Adapter:
    """The registered adapter, or for a model transformers knows without one, its layout read off `model` and the
    checkpoint's tensor `names` (quantkit.models.adapters.adapter_for_model; model.layers when no model is
    given). Without names (callers that only want the layers), or for a sparse-MoE model the pipeline refuses
    (GPT-OSS's own experts), the layers are run as transformers builds them, experts fused as stored."""
    try:
        return adapter_for(model_type)
    except InputError:
        if model is None:
            return Adapter(model_type, (model_type,), layers_path="model.layers")
        if names is not None:
            try:
                return adapter_for_model(model.config, model, names, renamed)
            except InputError:
                pass
        return Adapter(model_type, (model_type,), layers_path=find_layers_path(model.config, model))


def _skeleton(path: Path, trust_remote_code: bool):
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise InputError(f"cannot read config.json of {path}: {str(exc).splitlines()[0]}") from None
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        del config.quantization_config
    qc = qc if isinstance(qc, dict) or qc is None else qc.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with init_empty_weights(include_buffers=False):
            model = build_skeleton(path, config, trust_remote_code)
    return config, qc, model


def _checkpoint_name(handle: ModelHandle, module_name: str) -> str:
    """Full module name in the model -> the name its tensors have on disk."""
    prefix = handle.adapter.layers_path + "."
    if module_name.startswith(prefix):
        i, _, local = module_name[len(prefix):].partition(".")
        if i.isdigit() and local:
            return handle.checkpoint_name(int(i), local)
    return module_name


def _unfuse_all_experts(handle: ModelHandle) -> None:
    layout = handle.adapter.experts
    if layout is None:
        return
    for layer in handle.layers():
        try:
            fused = _get(layer, layout.module)
        except AttributeError:
            continue
        if hasattr(fused, "gate_up_proj"):
            _set(layer, layout.module, unfuse_experts(fused, layout))


def _read(index: SafetensorsIndex, name: str, device, dtype=None) -> torch.Tensor:
    t = index.get(name)
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.to(device)


@torch.no_grad()
def load_model(path: Path | str, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
               trust_remote_code: bool = False, runtime_moe: bool = True, kernels: str = "auto",
               kv_cache: bool = True) -> RuntimeModel:
    """Build the runtime model; `dtype` None = the checkpoint's own dtype (what its consumers compute in).
    `runtime_moe` False keeps transformers' own sparse-MoE blocks (no router hooks; an oracle for tests).

    kernels: "auto" serves each quantised linear with the first kernel for its format and device (the torch
    reference where none does, warned once); "reference" runs everything through the torch reference;
    "cuda-emulated" serves the linears, MoE experts, MLA decode and tree masks with the CUDA kernels on the CPU
    emulator (a developer check, slow). `kv_cache` False ignores a checkpoint's fp8 KV cache (keys and values stay in the
    compute dtype), for measuring what the cache costs."""
    mode = dispatch.check_mode(kernels)
    path = check_model_folder(Path(path))
    config, qc_raw, model = _skeleton(path, trust_remote_code)
    if qc_raw and qc_raw.get("quant_method") == "fp8":
        qc_raw = None  # native FP8 (DeepSeek-V3 style): SafetensorsIndex reads its weights dequantised
    quant = parse_quantization_config(qc_raw, str(path)) if qc_raw else None
    dtype = resolve_dtype(path, dtype)
    device = torch.device(device)
    index = SafetensorsIndex(path)
    renamed = renamed_checkpoint_names(model, index.names())
    adapter = with_stored_layers(_generic_adapter(getattr(config, "model_type", "?"), model, index.names(), renamed),
                                 renamed)
    handle = ModelHandle(ResolvedModel(path, str(path)), config, adapter, index, model, _renamed=renamed)
    try:
        handle.layers()
    except AttributeError:
        raise InputError(f"{path}: cannot find decoder layers at {adapter.layers_path}") from None
    _unfuse_all_experts(handle)
    if runtime_moe:
        install_runtime_moe(handle.layers(), adapter, config)  # before loading: children keep their names

    formats: Counter = Counter()
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        ckpt = _checkpoint_name(handle, name)
        if f"{ckpt}.weight_scale" not in index:
            continue
        fmt = quant.format_for(ckpt) if quant else None
        if fmt is None:
            raise InputError(f"{path}: {ckpt} has quantised tensors but no quantization_config group targets it")
        tensors = {t: _read(index, f"{ckpt}.{t}", device) for t in (*WEIGHT_TENSORS, *INPUT_TENSORS)
                   if f"{ckpt}.{t}" in index}
        if fmt.compressor.values_tensor not in tensors:
            raise InputError(f"{path}: {ckpt} is {fmt.format} but has no {fmt.compressor.values_tensor} tensor")
        static = None if fmt.input is None or fmt.input.dynamic else (
            "input_global_scale" if fmt.input.fp4_global else "input_scale")
        if static is not None and static not in tensors:
            raise InputError(f"{path}: {ckpt} has static activation quantisation but no {static}")
        check_linear_tensors(str(path), ckpt, fmt, tensors, module.in_features, module.out_features)
        bias = _read(index, f"{ckpt}.bias", device, dtype) if module.bias is not None else None
        _set(model, name, QuantLinear(fmt, tensors, module.in_features, module.out_features, bias, dtype))
        formats[fmt.kind] += 1

    # Everything else: parameters and persistent buffers the checkpoint holds, in the compute dtype.
    for name, param in list(model.named_parameters()):
        if param.device.type != "meta":
            continue
        module_name, _, leaf = name.rpartition(".")
        ckpt = f"{_checkpoint_name(handle, module_name)}.{leaf}"
        ckpt = renamed.get(ckpt, ckpt)
        if ckpt not in index:
            if model.get_output_embeddings() is _get(model, module_name) and getattr(config, "tie_word_embeddings", False):
                continue  # tied to the input embedding below
            raise InputError(f"{path}: tensor {ckpt} is missing from the checkpoint")
        owner = _get(model, module_name) if module_name else model
        owner._parameters[leaf] = dense_parameter(_read(index, ckpt, device, dtype))
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = DenseLinear  # same state, the runtime's forward (see DenseLinear)
    for name, buf in list(model.named_buffers()):
        module_name, _, leaf = name.rpartition(".")
        owner = _get(model, module_name) if module_name else model
        if isinstance(owner, QuantLinear):
            continue
        ckpt = f"{_checkpoint_name(handle, module_name)}.{leaf}"
        if ckpt in index:
            owner._buffers[leaf] = _read(index, ckpt, device, dtype if buf.is_floating_point() else None)
        elif buf.device != device:
            owner._buffers[leaf] = buf.to(device)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight.device.type == "meta":
        head.weight = emb.weight
    leftover = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if leftover:
        raise InputError(f"{path}: tensors missing from the checkpoint: {', '.join(leftover[:3])}")
    model.eval()
    model.config.use_cache = True
    kv = _install_kv_cache(model, handle, quant, device, str(path)) if quant and quant.kv_cache and kv_cache else None
    choices: list = []
    kernel_counts = dispatch.prepare_model(model, mode, choices)
    if runtime_moe and adapter.router is None:
        install_inferred_moe(handle.layers(), config)  # its probe runs the loaded router and shared experts
    launcher = launcher_for(device, mode)
    if launcher is not None:  # MoE grouped GEMMs, absorbed MLA decode, tree masks (reported with the linears)
        kernel_counts.update(install_cuda_ops(model, launcher, device, dtype))
    return RuntimeModel(model, path, config, dtype, device, quant, dict(formats), kernel_counts,
                        [dataclasses.asdict(c) for c in choices], kv)


def _install_kv_cache(model: nn.Module, handle: ModelHandle, quant: QuantConfig, device, where: str) -> str:
    """Round every key and value an attention layer stores through an e4m3 cache under its checkpoint's
    k_scale / v_scale, as vLLM's fp8 cache holds them; prefill and decode attend over the rounded states alike.
    An MLA layer stores its latent and rope part in one row that vLLM scales by k_scale alone."""
    from quantkit.models.kv_tap import attention_modules, tap_kv
    from quantkit.quant.kv_cache import fake_quantize_kv

    config = handle.config.get_text_config() if hasattr(handle.config, "get_text_config") else handle.config
    latent = bool(getattr(config, "kv_lora_rank", None))
    if latent and quant.kv_cache != "tensor":
        raise InputError(f"{where}: kv_cache_scheme strategy {quant.kv_cache} on an MLA model: its latent cache has "
                         "one scale (vLLM's k_scale)")
    found = attention_modules(model)
    if not found:
        raise InputError(f"{where}: kv_cache_scheme is set but no attention module (self_attn / attention) was found")
    for name, module in found:
        ckpt = _checkpoint_name(handle, name)
        missing = [f"{ckpt}.{t}" for t in ("k_scale", "v_scale") if f"{ckpt}.{t}" not in handle.index]
        if missing:
            raise InputError(f"{where}: kv_cache_scheme is set but {missing[0]} is missing")
        k_scale, v_scale = (_read(handle.index, f"{ckpt}.{t}", device) for t in ("k_scale", "v_scale"))
        if latent:
            v_scale = k_scale
        tap_kv(module, lambda k, v, ks=k_scale, vs=v_scale: (fake_quantize_kv(k, ks), fake_quantize_kv(v, vs)))
    return quant.kv_cache


def read_config(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read {path}/config.json: {exc}") from None
