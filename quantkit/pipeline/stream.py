"""The data-free FP8 path (`--method fp8` with FP8_DYNAMIC or FP8_BLOCK): tensor by tensor, straight from the
safetensors to the output shards.

Dynamic FP8 needs nothing but each weight itself (its absmax per channel or per 128x128 block), so there is
no calibration pass, no tokenizer and no model skeleton: the plan (which tensors are quantised linears)
comes from the tensor names and shapes and the architecture adapter, every output tensor is placed in the
planned shards up front, and each weight is read, quantised and written while the next one is read.
Config, manifest, fallbacks (K not a multiple of the block -> FP8_DYNAMIC for that linear) and the atomic
rename are the engine's own.
"""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.errors import InputError, RunError
from quantkit.formats.compressed_tensors import pack_quantized, quantized_specs
from quantkit.formats.safetensors_writer import PlannedShardWriter, TensorSpec
from quantkit.pipeline.memory import peak_rss_bytes
from quantkit.methods import Method
from quantkit.methods.base import QuantizedWeight
from quantkit.models.adapters import adapter_for
from quantkit.models.loader import ModelHandle, check_source_quantization, open_model
from quantkit.models.safetensors_index import SafetensorsIndex
from quantkit.models.source import resolve_model
from quantkit.quant.schemes import Scheme, block_fallback
from quantkit.quant.weights import quantize_any
from quantkit.recipe import Recipe


def streams(methods: list[Method], scheme: Scheme, kv_cache: str | None = None) -> bool:
    """True when the run needs no data at all: the fp8 method alone with dynamic activations (a calibrated KV
    cache needs data)."""
    return [m.name for m in methods] == ["fp8"] and scheme.input_activations is not None \
        and scheme.input_activations.dynamic and kv_cache is None


def _layer_of(name: str, root: str) -> tuple[int, str] | None:
    if not name.startswith(root):
        return None
    idx, _, local = name[len(root):].partition(".")
    return (int(idx), local) if idx.isdigit() and local else None


def plan_tensors(handle: ModelHandle, scheme: Scheme, ignore: list[str], strict: bool):
    """LayerPlans from names and shapes alone: a 2-D `.weight` inside a decoder layer is a linear, unless the
    adapter protects it (routers) or the user ignores it."""
    from quantkit.pipeline.engine import LayerPlan, LinearPlan, ignore_matches

    root = handle.adapter.checkpoint_layers_path + "."
    by_layer: dict[int, list[str]] = {}
    for name in handle.index.names():
        hit = _layer_of(name, root)
        if hit is not None:
            by_layer.setdefault(hit[0], []).append(name)
    plans = []
    for i in sorted(by_layer):
        targets, copied, skipped = [], [], []
        prefix = handle.layer_prefix(i)
        for name in by_layer[i]:
            info = handle.index.tensors[name]
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            if module is None or len(info.shape) != 2 or not handle.index.dtype(name).is_floating_point:
                copied.append(name)
                continue
            local = handle.adapter.to_module(module[len(prefix):])
            if handle.adapter.is_protected(local) or any(ignore_matches(p, module) for p in ignore):
                skipped.append(module)
                copied.append(name)
                continue
            out_f, in_f = info.shape
            fallback = block_fallback(scheme, in_f)
            if fallback is not None and strict:
                raise InputError(
                    f"{module} has {in_f} input features, not a multiple of the {scheme.name} block "
                    f"{scheme.weights.block[1]}; drop --strict to let such layers use {fallback.name}"
                )
            targets.append(LinearPlan(local, module, out_f, in_f, fallback or scheme))
        # Biases of quantised linears stay as they are (copied).
        plans.append(LayerPlan(i, targets, {}, copied, skipped))
    return plans


@dataclass
class StreamSetup:
    """What the data-free path decides before reading a weight (shared by `quantize` and `plan`)."""

    resolved: object  # ResolvedModel
    handle: ModelHandle
    plans: list
    tp_warnings: list[dict]
    weight_dtype: torch.dtype
    specs: list[TensorSpec]


def prepare_stream(recipe: Recipe, scheme: Scheme, tp: int | None = None) -> StreamSetup:
    from quantkit.pipeline.tp import tp_warnings

    q = recipe.quantization
    resolved = resolve_model(recipe.model.source)
    config = json.loads((resolved.path / "config.json").read_text())
    check_source_quantization(config.get("quantization_config"), resolved.path)
    skeleton = None
    try:
        adapter = adapter_for(config.get("model_type", "?"))
    except InputError:  # an architecture without an adapter here: its layout read off a meta skeleton, kept for
        opened = open_model(resolved, recipe.model.trust_remote_code)  # the linears outside its layers
        adapter, skeleton = opened.adapter, opened.skeleton
    index = SafetensorsIndex(resolved.path)
    handle = ModelHandle(resolved, config, adapter, index, skeleton=skeleton)
    plans = plan_tensors(handle, scheme, q.ignore, q.strict)
    if not any(p.targets for p in plans):
        raise InputError("nothing to quantise: every linear is ignored")
    weight_dtype = handle.source_dtype()
    specs: list[TensorSpec] = [TensorSpec(n, index.dtype(n), index.tensors[n].shape)
                               for n in handle.non_layer_checkpoint_names()]
    for p in plans:
        for t in p.targets:
            specs.extend(quantized_specs(t.checkpoint, t.out_features, t.in_features, t.scheme, weight_dtype))
        specs.extend(TensorSpec(n, index.dtype(n), index.tensors[n].shape) for n in p.copied)
    return StreamSetup(resolved, handle, plans, tp_warnings(plans, tp), weight_dtype, specs)


def stream_quantize(recipe: Recipe, output: Path, scheme: Scheme, overwrite: bool = False,
                    max_shard_bytes: int | None = None, tp: int | None = None, threads: int = 2) -> dict:
    from quantkit.pipeline.engine import (
        finish_output,
        write_config_and_extras,
    )
    from quantkit.pipeline.tp import tp_warnings

    t_start = time.time()
    output = Path(output)
    q = recipe.quantization
    if output.exists() and not overwrite:
        raise InputError(f"output {output} already exists; pass --overwrite to replace it")
    partial = output.with_name(output.name + ".partial")
    setup = prepare_stream(recipe, scheme, tp)
    resolved, handle, index, plans = setup.resolved, setup.handle, setup.handle.index, setup.plans
    shard_warnings, weight_dtype, specs = setup.tp_warnings, setup.weight_dtype, setup.specs
    from quantkit.pipeline.plan import check_disk_space

    check_disk_space(output, sum(spec.nbytes for spec in specs))

    if partial.exists():
        if not overwrite:
            raise InputError(f"an unfinished run exists at {partial}; pass --overwrite to start over "
                             f"(the data-free fp8 path simply restarts)")
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        writer = PlannedShardWriter(partial, specs, max_shard_bytes or 5 * 10**9)
        records, events = _write_all(handle, plans, writer, weight_dtype, threads)
        writer.close()
        writer.write_index()
        recipe_used, overrides = write_config_and_extras(handle, plans, scheme, recipe, partial, output)
        summary = {
            "output": str(output),
            "model": resolved.label,
            "model_path": str(handle.path),
            "method": "fp8",
            "scheme": scheme.name,
            "group_size": -1,
            "device": "cpu",
            "device_name": None,
            "device_peak_bytes": None,
            "activations": None,  # data-free: no calibration activations
            "compute_dtype": "float32",
            "wall_seconds": round(time.time() - t_start, 3),
            "peak_rss_bytes": peak_rss_bytes(),
            "original_bytes": index.total_bytes(),
            "quantized_linears": sum(len(p.targets) for p in plans),
            "calibration": {"data_free": True},
            "layers": records,
            "events": events,
            "scheme_overrides": overrides,
            "tp_warnings": shard_warnings,
        }
        return finish_output(partial, output, recipe_used, summary, handle)
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)  # nothing partial is left behind
        if isinstance(exc, OSError):
            if exc.errno == 28:
                raise RunError(f"disk full while writing {partial}; nothing was left behind") from None
            raise RunError(f"cannot write {partial}: {exc.strerror or exc}") from None
        raise


def _quantize_one(handle: ModelHandle, target, weight_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    w = handle.index.get(target.checkpoint + ".weight")
    if not torch.isfinite(w).all():
        bad = int((~torch.isfinite(w)).sum())
        raise InputError(
            f"{target.checkpoint} has {bad} inf/NaN weight(s), which FP8 cannot represent; "
            f"repair the checkpoint or leave the layer unquantised with --ignore"
        )
    qv, scale, *_ = quantize_any(w, target.scheme.weights, weight_dtype)
    return pack_quantized(target.checkpoint, QuantizedWeight(qv, scale, None, method="fp8"), target.scheme, weight_dtype)


def _write_all(handle: ModelHandle, plans, writer: PlannedShardWriter, weight_dtype: torch.dtype,
               threads: int) -> tuple[list[dict], list[dict]]:
    for name in handle.non_layer_checkpoint_names():
        writer.write(name, handle.index.get(name))
    records: list[dict] = []
    # Reading and quantising release the GIL: a couple of workers keep the disk busy while one quantises.
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for p in plans:
            t0 = time.time()
            futures = [(t, pool.submit(_quantize_one, handle, t, weight_dtype)) for t in p.targets]
            for name in p.copied:
                writer.write(name, handle.index.get(name))
            for _, fut in futures:
                for name, tensor in fut.result().items():
                    writer.write(name, tensor)
            # No data, so no output error to report (rel_error None); the eval command measures quality.
            records.append({"layer": p.index, "rel_error": None, "seconds": round(time.time() - t0, 3)})
    writer.sync()
    return records, []
