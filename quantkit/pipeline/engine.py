"""The sequential engine: calibration tokens -> embeddings -> layer 0 -> ... -> layer N-1, each layer once.

For layer i: materialise it alone; run the cached inputs through it with the methods' statistics hooks
(this pass also gives the unquantised outputs, the reference for the layer's error); let the methods
transform/quantise; run the inputs through the quantised layer to get layer i+1's inputs (so later layers
calibrate on what the quantised model really computes); write its tensors to their planned place in the
output shards; commit the journal; free the layer. Peak memory is one layer plus the activations.
"""

from __future__ import annotations

import dataclasses

import gc
import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import quantkit
from quantkit.data.calibration import CalibrationSet, build_token_blocks
from quantkit.errors import InputError, RunError
from quantkit.formats.compressed_tensors import build_quantization_config, pack_quantized, quantized_specs
from quantkit.formats.files import publish
from quantkit.formats.manifest import write_manifest
from quantkit.formats.safetensors_writer import PlannedShardWriter, TensorSpec
from quantkit.methods import LayerContext, Method, build_methods
from quantkit.models.adapters import GENERIC
from quantkit.models.experts import UnfusedExperts
from quantkit.models.loader import ModelHandle, open_model
from quantkit.models.source import resolve_model
from quantkit.pipeline.activations import ActivationStore
from quantkit.pipeline.attention import use_blocked_attention
from quantkit.pipeline.capture import capture_layer_inputs, run_layer
from quantkit.distributed import SINGLE, Ranks
from quantkit.pipeline.journal import Journal
from quantkit.pipeline.memory import (DevicePeak, activation_placement, layer_working_bytes, peak_rss_bytes,
                                     release_freed_memory, release_freed_memory_between_layers,
                                     return_large_frees_to_os)
from quantkit.compute import choose_compute_dtype, matmul_shapes
from quantkit.progress import announce, progress_bar
from quantkit.quant.kv_cache import kv_strategy
from quantkit.quant.schemes import Scheme, block_fallback, get_scheme
from quantkit.recipe import Recipe

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")


@dataclass
class LinearPlan:
    local: str  # module name inside the layer
    checkpoint: str  # full module name on disk
    out_features: int
    in_features: int
    scheme: Scheme  # the run's scheme, or the fallback this linear needs


@dataclass
class LayerPlan:
    index: int
    targets: list[LinearPlan]
    kept: dict[str, tuple[str, torch.dtype, tuple]]  # local param -> (checkpoint name, disk dtype, shape)
    copied: list[str]  # checkpoint tensors of the layer that no module parameter covers
    skipped_linears: list[str] = field(default_factory=list)  # checkpoint names of linears left unquantised
    kv_attention: str | None = None  # --kv-cache: layer-local name of the attention module whose cache is fp8
    kv_heads: int = 0  # its KV heads
    kv_latent: bool = False  # MLA: the cache holds the compressed latent and the rope part, under one scale


def plan_kv_cache(handle: ModelHandle, plans: list[LayerPlan], mode: str) -> None:
    """Find each layer's attention module (the one storing keys and values through transformers' cache) for a
    calibrated fp8 KV cache; refuse, with one line, a layout whose cache quantkit cannot calibrate."""
    from quantkit.models.kv_tap import attention_modules
    from quantkit.quant.kv_cache import kv_strategy

    kv_strategy(mode)
    config = handle.config.get_text_config() if hasattr(handle.config, "get_text_config") else handle.config
    latent = bool(getattr(config, "kv_lora_rank", None))
    if latent and kv_strategy(mode) != "tensor":
        raise InputError("--kv-cache fp8-head on an MLA model: its cache holds one compressed latent shared by every "
                         "head (vLLM scales it with one k_scale); use --kv-cache fp8")
    heads = 1 if latent else (getattr(config, "num_key_value_heads", None)
                              or getattr(config, "num_attention_heads", None))
    for p in plans:
        found = attention_modules(handle.meta_layer(p.index))
        if len(found) != 1:
            what = "no" if not found else f"{len(found)}"
            raise InputError(f"--kv-cache: layer {p.index} of {handle.config.model_type} has {what} attention modules "
                             "that store keys and values through a cache (expected one named self_attn or "
                             "attention); its cache layout is not known to quantkit")
        p.kv_attention, p.kv_heads, p.kv_latent = found[0][0], int(heads), latent


def ignore_matches(pattern: str, name: str) -> bool:
    """compressed-tensors semantics (`re:` prefix = regex match, else exact), plus dotted-suffix matches."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def plan_layers(handle: ModelHandle, scheme: Scheme, ignore: list[str], strict: bool = False) -> list[LayerPlan]:
    plans = []
    for i in range(handle.num_layers):
        layer = handle.meta_layer(i)
        targets, skipped = [], []
        linear_params = set()
        for local, module in layer.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            ckpt = handle.checkpoint_name(i, local)
            if handle.adapter.is_protected(local) or any(ignore_matches(p, ckpt) for p in ignore):
                skipped.append(ckpt)
                continue
            fallback = block_fallback(scheme, module.in_features)
            if fallback is not None and strict:
                raise InputError(
                    f"{ckpt} has {module.in_features} input features, not a multiple of the {scheme.name} block "
                    f"{scheme.weights.block[1]}; drop --strict to let such layers use {fallback.name}"
                )
            targets.append(LinearPlan(local, ckpt, module.out_features, module.in_features, fallback or scheme))
            linear_params.add(f"{local}.weight")
        kept, covered = {}, set()
        for local, param in layer.named_parameters():
            ckpt = handle.checkpoint_name(i, local)  # the whole name: a rename may move one tensor of a module
            covered.add(ckpt)
            if local in linear_params:
                continue
            if ckpt not in handle.index:
                raise InputError(f"checkpoint is missing {ckpt}")
            kept[local] = (ckpt, handle.index.dtype(ckpt), tuple(param.shape))
        copied = [n for n in handle.layer_checkpoint_names(i) if n not in covered]
        plans.append(LayerPlan(i, targets, kept, copied, skipped))
    return plans


def check_group_divisibility(plans: list[LayerPlan], scheme: Scheme) -> None:
    args = scheme.weights
    if args.strategy not in ("group", "tensor_group"):
        return
    widths = {t.in_features for p in plans for t in p.targets}
    for p in plans:
        for t in p.targets:
            if t.in_features % args.group_size and args.is_fp4:
                raise InputError(
                    f"{t.checkpoint} has {t.in_features} input features, not a multiple of {scheme.name}'s groups of "
                    f"{args.group_size}; leave it unquantised with --ignore {t.checkpoint}")
            if t.in_features % args.group_size:
                fits = [g for g in (args.group_size // 2**k for k in range(1, 8)) if g >= 8 and all(w % g == 0 for w in widths)]
                hint = f"--group-size {fits[0]}" if fits else "--group-size -1 (per channel)"
                raise InputError(
                    f"{t.checkpoint} has {t.in_features} input features, not a multiple of group size "
                    f"{args.group_size} (compressed-tensors and vLLM need whole groups); use {hint}"
                )


def _protected_ignore(handle: ModelHandle, plans: list[LayerPlan], user_ignore: list[str]) -> list[str]:
    """The ignore list written to the config: user regexes verbatim, every unquantised linear by name."""
    names: list[str] = []
    for pattern in user_ignore:
        if pattern.startswith("re:"):
            names.append(pattern)
    # Each by its stored name (vLLM's) and, where transformers renames it on load, by its module name too:
    # transformers matches the ignore against its modules (Phi-MoE's router is stored as block_sparse_moe.gate).
    for p in plans:
        prefix = handle.layer_prefix(p.index)
        stored = list(p.skipped_linears)
        # Router gates that transformers does not model as nn.Linear are still linears to vLLM.
        for name in handle.layer_checkpoint_names(p.index):
            module = name.rpartition(".")[0]
            if handle.adapter.is_protected(handle.adapter.to_module(module[len(prefix):])) and module not in stored:
                stored.append(module)
        for name in stored:
            loaded = f"{handle.adapter.layers_path}.{p.index}.{handle.adapter.to_module(name[len(prefix):])}"
            names.extend(n for n in (name, loaded) if n not in names)
    # Multi-token-prediction blocks (layers past the decoder's) stay at source precision: vLLM loads them as
    # the speculative head, unquantised, when the config's ignore says so.
    for i in handle.extra_layer_indices():
        names.append("re:" + re.escape(handle.layer_prefix(i)) + ".*")
    lm_head = [n.rpartition(".")[0] for n in handle.non_layer_checkpoint_names() if n.endswith("lm_head.weight")]
    names = (lm_head or ["lm_head"]) + [n for n in names if n not in lm_head and n != "lm_head"]
    return names + [n for n in _outside_linears(handle) if n not in names]


def _outside_linears(handle: ModelHandle) -> list[str]:
    r"""Ignore entries for the linears outside the decoder layers besides the head, which stay unquantised: a
    multimodal model's vision tower and projector as one pattern each (`re:.*vision_tower\..*`, which matches the
    stored and the loaded names alike), a lone linear beside the layers (OPT's project_in) by its name."""
    if handle.skeleton is None:  # the data-free stream of a registered text model: nothing outside its layers
        return []
    layers = handle.adapter.layers_path.split(".")
    head = handle.skeleton.get_output_embeddings()
    out: list[str] = []
    for name, module in handle.skeleton.named_modules():
        if not isinstance(module, nn.Linear) or module is head or name.startswith(handle.adapter.layers_path + "."):
            continue
        parts = name.split(".")
        k = next(i for i, (a, b) in enumerate(zip(parts, layers + [""] * len(parts))) if a != b)
        entry = name if k == len(parts) - 1 else "re:.*" + re.escape(parts[k]) + r"\..*"
        if entry not in out:
            out.append(entry)
    return out


def _resolve_device(device: str) -> str:
    """auto -> cuda where torch sees a GPU, else cpu. An unknown device, or cuda where there is none, is an
    InputError: the CLI prints one line and exits 2 before any model is opened."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise InputError(f"unknown device {device!r}: use auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA support" if torch.version.cuda is None else "torch sees no CUDA device"
        raise InputError(f"--device cuda given but no CUDA device is available ({why}); use --device cpu")
    return device


def device_name(device: str) -> str | None:
    """The GPU's name for the manifest (None on CPU)."""
    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else None


def _run_key(recipe: Recipe, calib: CalibrationSet, handle: ModelHandle) -> str:
    h = hashlib.sha256()
    rec = recipe.to_dict()
    rec["output"] = None
    h.update(json.dumps(rec, sort_keys=True, default=str).encode())
    h.update(calib.fingerprint.encode())
    for name, info in sorted(handle.index.tensors.items()):
        h.update(f"{name}:{info.dtype}:{info.shape}:{info.file.stat().st_size}".encode())
    h.update(quantkit.__version__.encode())
    return h.hexdigest()


def routed_expert_linears(layer: nn.Module, targets: dict[str, nn.Linear]) -> set[str]:
    """The targets that belong to a routed expert (inside an UnfusedExperts), by their layer-local names."""
    inside = {id(m) for u in layer.modules() if isinstance(u, UnfusedExperts) for m in u.modules()}
    return {n for n, m in targets.items() if id(m) in inside}


def _set_calibration_mode(layer: nn.Module, on: bool) -> None:
    for module in layer.modules():
        if isinstance(module, UnfusedExperts):
            module.calibrate_all_experts = on


def statistics_cap(stage: list[Method]) -> int | None:
    """The calibration tokens a stage's statistics need (`Method.statistics_tokens`), None for all of them."""
    wanted = [m.statistics_tokens for m in stage if m.uses_statistics]
    return None if not wanted or None in wanted else max(wanted)


def _auto_batch(seq_len: int) -> int:
    # About 2048 tokens per forward: large enough for efficient matmuls, small enough that a layer's
    # activations (the MLP's intermediate is the largest) stay well below the layer's own weights.
    return max(1, 2048 // seq_len)


@dataclass
class LayerBatches:
    """The calibration batches a layer runs on: `acts[j]` (the layer's inputs, replaced by its outputs) and
    `calls[j][layer]` (the keyword arguments each layer receives) for every global batch index j in `owned`:
    all batches in one process, this rank's contiguous shard in a data-parallel run. Batches
    0..error_batches-1 of the whole run measure each layer's error."""

    acts: ActivationStore
    calls: Sequence | Mapping
    owned: list[int]
    error_batches: int
    ranks: Ranks = SINGLE
    batch_tokens: int = 0  # tokens in a full batch (0: unknown, every calibration pass covers every batch)

    def for_statistics(self, stage: list[Method], observe: bool) -> list[int]:
        """The batches a calibration pass for `stage` runs on: every owned batch, unless every method of the
        stage that gathers statistics says it needs only so many tokens (`Method.statistics_tokens`); then the
        run's first batches up to that many tokens (the same batches whatever the ranks' split), plus the
        error-measuring ones. Static activation observers (`observe`) see every batch."""
        cap = None if observe else statistics_cap(stage)
        if cap is None or self.batch_tokens <= 0:
            return list(self.owned)
        first = max(self.error_batches, math.ceil(cap / self.batch_tokens))
        return [j for j in self.owned if j < first]

    @classmethod
    def local(cls, acts: ActivationStore, calls: Sequence, error_batches: int) -> "LayerBatches":
        """Every batch, in this process."""
        return cls(acts, calls, list(range(len(calls))), min(error_batches, len(calls)))


def process_layer(
    layer: nn.Module,
    ctx: LayerContext,
    methods: list[Method],
    batches: LayerBatches,
    on_batch=None,
    on_routing=None,
    timings: dict | None = None,
    schedule: str = "two-pass",
) -> float:
    """Calibrate, quantise and propagate one layer: `batches.acts` holds the layer's inputs on entry and its
    quantised outputs (the next layer's inputs) on return, one generation resident, each batch replaced as soon
    as its output exists. Returns the layer's relative output error, measured on the error-measuring batches.
    `on_routing(selected [T, k])` sees the quantised pass's routing of each batch (MoE layers), once per token.

    The first pass gives the statistics of the first stage of methods and the unquantised reference outputs of
    the error-measuring batches (only those are kept: a reference of every batch would be a second generation
    of activations, the largest term of a run's memory after the layer itself). A
    calibrating transform (SmoothQuant) changes what later methods see, so the methods after it (GPTQ's
    Hessian, static input scales) get their statistics from another pass over the transformed layer. In a
    data-parallel run each pass covers this rank's batches and the statistics are combined over the ranks
    before the methods apply (`Method.reduce_statistics`).
    `timings`, when given, accumulates the seconds spent in forward passes and in the methods' apply (what
    `plan` extrapolates from: the first scales with the samples, the second does not).
    `schedule` (recipe calibration.schedule): with one-pass or auto the last stage calibrates group by group inside
    one forward per batch (quantkit.pipeline.grouped) where the layer allows it (`_one_pass_applies`; auto also
    within a memory budget); its quantised pass is then that same pass. `ctx.schedule` says which ran."""
    timings = {} if timings is None else timings
    timings.setdefault("forward", 0.0)
    timings.setdefault("apply", 0.0)
    check_finite_weights(ctx)
    acts, calls, ranks = batches.acts, batches.calls, batches.ranks
    ctx.ranks = ranks
    static = [n for n in ctx.targets if ctx.scheme_for(n).static_activations]
    stages = method_stages(methods)
    measured = [j for j in batches.owned if j < batches.error_batches]
    references: dict[int, torch.Tensor] = {}
    ctx.schedule = "two-pass"
    if schedule != "two-pass" and _one_pass_applies(layer, ctx, stages, static, ranks, on_routing, batches,
                                                    forced=schedule == "one-pass"):
        rel = _process_layer_one_pass(layer, ctx, stages, batches, measured, on_batch, timings)
        if rel is not None:
            ctx.schedule = "one-pass"
            return rel
    for k, stage in enumerate(stages):
        observe = static if k == len(stages) - 1 else []
        needs_stats = any(m.uses_statistics for m in stage) or bool(observe)
        if k == 0 or needs_stats:
            hooks = [h for m in stage for h in m.attach(ctx)] if needs_stats else []
            hooks += [_observe_absmax(ctx, n) for n in observe]
            _set_calibration_mode(layer, needs_stats and ctx.all_expert_tokens)
            began = time.perf_counter()
            passed = batches.for_statistics(stage, bool(observe)) if needs_stats else measured
            with torch.no_grad(), ctx.phase("calibration_pass"):
                for j in passed:
                    out = run_layer(layer, acts[j], calls[j][ctx.index])
                    if k == 0 and j < batches.error_batches:
                        references[j] = out
                    if on_batch:
                        on_batch()
            for _ in range(len(batches.owned) - len(passed) if on_batch else 0):
                on_batch()  # the bar counts the batches this pass leaves out as done
            timings["forward"] += time.perf_counter() - began
            cap = statistics_cap(stage) if needs_stats and not observe else None
            if cap is not None:  # `plan` scales this part only up to the cap
                timings["capped_forward"] = timings.get("capped_forward", 0.0) + time.perf_counter() - began
                timings["capped_tokens"] = max(timings.get("capped_tokens", 0), cap)
            for h in hooks:
                h.remove()
            _set_calibration_mode(layer, False)
            if needs_stats and ranks.distributed:
                with ctx.phase("reduce"):
                    for m in stage:
                        if m.uses_statistics:
                            m.reduce_statistics(ranks)
                    if observe:
                        ctx.input_absmax = ranks.reduce(ctx.input_absmax, "max")
        began = time.perf_counter()
        with ctx.phase("apply"):
            for method in stage:
                method.apply(ctx)
        timings["apply"] += time.perf_counter() - began
    if ctx.pending():
        raise RunError(f"layer {ctx.index}: {ctx.pending()[0]} was not quantised by {methods[-1].name}")
    input_scales = {n: _static_input_scale(ctx, n) for n in static}
    # The quantised pass simulates activation quantisation as the consumer will run it, so the next layer
    # calibrates on what deployment computes.
    hooks = [_simulate_activations(ctx, n, input_scales.get(n)) for n in ctx.targets
             if ctx.scheme_for(n).input_activations is not None]
    if on_routing is not None:
        hooks += [m.register_forward_pre_hook(lambda mod, args: on_routing(args[1]))
                  for m in layer.modules() if isinstance(m, UnfusedExperts)]
    errors: list[tuple[int, float, float]] = []
    began = time.perf_counter()
    ctx.kv_absmax.clear()  # the KV cache scales come from this pass: the layer as it will be served
    with torch.no_grad(), ctx.phase("quantised_pass"):
        for j in batches.owned:
            quantized = run_layer(layer, acts[j], calls[j][ctx.index])
            if j in references:
                reference = references.pop(j)
                errors.append((j, (quantized - reference).double().pow(2).sum().item(),
                               reference.double().pow(2).sum().item()))
                del reference
            # Every batch, not only the measured ones: a NaN/Inf anywhere would poison the next layer's statistics.
            if not bool(torch.isfinite(quantized).all()):
                raise RunError(f"layer {ctx.index} produced NaN/Inf after quantisation")
            acts[j] = quantized
            if on_batch:
                on_batch()
    timings["forward"] += time.perf_counter() - began
    for h in hooks:
        h.remove()
    ctx.input_scales = input_scales
    # Summed in batch order whatever rank measured which batch: the same float sums as one process.
    num = den = 0.0
    for _, e_num, e_den in sorted(e for part in ranks.gather(errors) for e in part):
        num += e_num
        den += e_den
    return math.sqrt(num / den) if den > 0 else 0.0


# auto: one-pass while the activations the paused batches hold stay under this share of the free memory.
ONE_PASS_MEMORY_SHARE = 0.25


def paused_activation_bytes(ctx: LayerContext, batches: LayerBatches) -> int:
    """What the one-pass schedule holds beyond the two-pass one, estimated: every batch paused at once, each
    holding about its widest linear's output (the MLP intermediate, down_proj's input) and four hidden-sized
    tensors (residual, normed input, attention output, the layer input). Measured on SmolLM2 GPTQ 64 x 512:
    estimate 252 MB, peak RSS +443 MB over two-pass (the rest: heap fragmentation of interleaved lifetimes)."""
    x = batches.acts[batches.owned[0]]
    tokens = x.numel() // x.shape[-1] * len(batches.owned)
    widest = max(lin.weight.shape[0] for lin in ctx.targets.values())
    return tokens * (widest + 4 * x.shape[-1]) * x.element_size()


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def _one_pass_applies(layer: nn.Module, ctx: LayerContext, stages: list[list[Method]], static: list[str],
                      ranks: Ranks, on_routing, batches: LayerBatches, forced: bool) -> bool:
    """Group-by-group calibration needs a last stage that gathers statistics and quantises any subset of the
    layer's linears (`Method.groupwise`), a static call order (no MoE routing), no static activation scales (their
    observers run over the unquantised pass), and in a data-parallel run a batch on every rank (each rank probes
    its own; the ranks then pause at the same groups and combine each group's statistics before it is applied).
    Unless forced, the paused batches' activations must also fit in a quarter of the free memory."""
    last = stages[-1]
    ok = (all(m.groupwise for m in last) and any(m.uses_statistics for m in last) and not static
          and on_routing is None and not any(isinstance(m, UnfusedExperts) for m in layer.modules())
          and len(batches.owned) > 0)
    if ok and not forced:
        device = next(iter(ctx.targets.values())).weight.device
        ok = paused_activation_bytes(ctx, batches) <= ONE_PASS_MEMORY_SHARE * _free_memory(device)
    if ranks.distributed:  # the same answer on every rank, or their collectives would not match
        return all(ranks.gather(ok))
    return ok


def _process_layer_one_pass(layer: nn.Module, ctx: LayerContext, stages: list[list[Method]], batches: LayerBatches,
                            measured: list[int], on_batch, timings: dict) -> float | None:
    """process_layer with the last stage calibrated in dependency order inside one forward per batch. Returns
    None (nothing changed yet) when the probe finds no static group order; the caller then runs both passes."""
    from quantkit.pipeline.grouped import GroupedPass, probe_groups

    acts, calls = batches.acts, batches.calls
    forward = lambda j: run_layer(layer, acts[j], calls[j][ctx.index])  # noqa: E731
    references: dict[int, torch.Tensor] = {}
    began = time.perf_counter()
    # The probe first, before anything changes the layer: one unquantised forward (with a single stage it is the
    # first measured batch's reference, which the error needs anyway). No static order: the caller runs two-pass.
    first = measured[0] if measured else batches.owned[0]
    sources = _group_transform_sources(ctx, stages)
    outputs: dict[str, torch.Tensor] = {}
    modules = dict(layer.named_modules())
    capture = [modules[n].register_forward_hook(lambda mod, args, out, n=n: outputs.setdefault(n, out))
               for n in sources or {}]
    inputs: list[torch.Tensor] = []
    try:
        with torch.no_grad(), ctx.phase("calibration_pass"):
            out, groups = probe_groups(ctx.targets, lambda: forward(first), inputs)
    finally:
        for h in capture:
            h.remove()
    if groups is None:
        timings["forward"] += time.perf_counter() - began
        return None
    # The last transform stage joins the grouped pass where each of its modules' output is exactly the input of the
    # group it transforms (the same tensor object: dividing it in place is what the transformed module computes).
    fused = sources is not None and all(
        any(set(g) == set(names) and x is outputs.get(src) for g, x in zip(groups, inputs))
        for src, names in sources.items())
    del inputs, outputs
    if first in measured and (len(stages) == 1 or fused and len(stages) == 2):
        references[first] = out
    del out
    separate = stages[:-2] if fused else stages[:-1]
    for k, stage in enumerate(separate):  # transforms (SmoothQuant) calibrate on the whole unquantised layer
        hooks = [h for m in stage for h in m.attach(ctx)]
        with torch.no_grad(), ctx.phase("calibration_pass"):
            for j in batches.for_statistics(stage, False):
                out = forward(j)
                if k == 0 and j in measured:
                    references[j] = out
        for h in hooks:
            h.remove()
        with ctx.phase("apply"):
            for method in stage:
                method.apply(ctx)
    with torch.no_grad(), ctx.phase("calibration_pass"):
        for j in measured:
            if j not in references:
                references[j] = forward(j)
    ctx.input_leaders = {name: group[0] for group in groups for name in group}
    last = stages[-1]
    transforms = stages[-2] if fused else []
    applying = {"seconds": 0.0}

    def apply_group(names: list[str]) -> None:
        t0 = time.perf_counter()
        ctx.active = set(names)
        try:
            if ctx.ranks.distributed:
                with ctx.phase("reduce"):
                    for method in [*transforms, *last]:
                        if method.uses_statistics:
                            method.reduce_statistics(ctx.ranks)
            with ctx.phase("apply"):
                for method in transforms:
                    s = method.transform_group(ctx, names)
                    if s is None:
                        continue
                    for x in grouped.paused_inputs(groups.index(names)):
                        x.div_(s.to(x.device))
                    for m in last:
                        m.rescale_input_statistics(names[0], s)
                for method in last:
                    method.apply(ctx)
        finally:
            ctx.active = None
        applying["seconds"] += time.perf_counter() - t0

    grouped = GroupedPass(groups, apply_group)
    hooks = [h for m in [*transforms, *last] for h in m.attach(ctx)]
    hooks += [ctx.targets[g[0]].register_forward_pre_hook(grouped.gate(i)) for i, g in enumerate(groups)]
    # Activation quantisation is simulated on a linear's input once the linear is quantised (after its
    # statistics and the gate), as the quantised pass of the two-pass schedule does.
    hooks += [_simulate_activations(ctx, n, None, only_quantized=True) for n in ctx.targets
              if ctx.scheme_for(n).input_activations is not None]
    errors: list[tuple[int, float, float]] = []

    def done(j: int, quantized: torch.Tensor) -> None:
        if j in references:
            reference = references.pop(j)
            errors.append((j, (quantized - reference).double().pow(2).sum().item(),
                           reference.double().pow(2).sum().item()))
        if not bool(torch.isfinite(quantized).all()):
            raise RunError(f"layer {ctx.index} produced NaN/Inf after quantisation")
        acts[j] = quantized
        if on_batch:
            on_batch()
            on_batch()

    ctx.kv_absmax.clear()  # the KV cache scales come from this pass: the layer as it will be served
    with torch.no_grad(), ctx.phase("grouped_pass"):
        grouped.run(batches.owned, forward, on_done=done)
    ctx.phases["grouped_apply"] = ctx.phases.get("grouped_apply", 0.0) + applying["seconds"]
    for h in hooks:
        h.remove()
    elapsed = time.perf_counter() - began
    timings["apply"] += applying["seconds"]
    timings["forward"] += elapsed - applying["seconds"]
    if ctx.pending():
        raise RunError(f"layer {ctx.index}: {ctx.pending()[0]} was not quantised by {last[-1].name}")
    ctx.input_scales = {}
    num = den = 0.0
    for _, e_num, e_den in sorted(e for part in ctx.ranks.gather(errors) for e in part):
        num += e_num
        den += e_den
    return math.sqrt(num / den) if den > 0 else 0.0


def _group_transform_sources(ctx: LayerContext, stages: list[list[Method]]) -> dict[str, list[str]] | None:
    """{module: the linears its output feeds} of the transform stage before the last, where every method of it can
    run inside the one-pass grouped pass and every statistics user of the last stage can follow its input scaling;
    None otherwise (the stage then calibrates in a pass of its own)."""
    if (len(stages) < 2 or not all(m.rescales_inputs or not m.uses_statistics for m in stages[-1])
            or any(type(m).group_sources is Method.group_sources for m in stages[-2])):
        return None
    found: dict[str, list[str]] = {}
    for method in stages[-2]:
        for h in method.attach(ctx):  # resolves the method's mappings for this layer; records nothing yet
            h.remove()
        sources = method.group_sources(ctx)
        if sources is None or set(sources) & set(found):
            return None
        found.update(sources)
    return found


# Phases a method times inside `apply` (what is left of apply is reported as `method_other`).
METHOD_PHASES = ("factorisation", "solve", "scale_search", "clip_search", "error_report")


def layer_phases(raw: dict[str, float]) -> dict[str, float]:
    """A layer's seconds per phase, without overlap: statistics hooks run inside the calibration pass, so the pass
    is reported as `forward` (its own matmuls) plus `statistics`; the methods' named phases run inside `apply`."""
    out = dict(raw)
    calib = out.pop("calibration_pass", 0.0) + out.pop("grouped_pass", 0.0) - out.pop("grouped_apply", 0.0)
    out["forward"] = max(calib - out.get("statistics", 0.0), 0.0) + out.pop("quantised_pass", 0.0)
    apply = out.pop("apply", 0.0)
    out["method_other"] = max(apply - sum(out.get(p, 0.0) for p in METHOD_PHASES), 0.0)
    return {k: round(v, 4) for k, v in sorted(out.items())}


def phase_totals(records: list[dict], wall: float) -> dict[str, float]:
    """Seconds per phase summed over the layers, and `outside_layers`: the rest of the wall time (loading, the
    calibration set, the first layer's inputs, config and manifest)."""
    totals: dict[str, float] = {}
    for r in records:
        for k, v in r.get("phases", {}).items():
            totals[k] = totals.get(k, 0.0) + v
    totals["outside_layers"] = max(wall - sum(r["seconds"] for r in records), 0.0)
    return {k: round(v, 3) for k, v in sorted(totals.items())}


def _routing_counter(layer: nn.Module):
    """A routing-profile counter for a sparse-MoE layer (None for dense layers and dense models)."""
    from quantkit.models.routing_profile import LayerCounts

    experts = [m for m in layer.modules() if isinstance(m, UnfusedExperts)]
    return LayerCounts(experts[0].num_experts) if experts else None


def write_routing_profile(handle: ModelHandle, journal: Journal, calib, folder: Path) -> bool:
    """routing_profile.json from the counts of the quantised calibration pass (MoE models only)."""
    from quantkit.models.moe import router_spec
    from quantkit.models.routing_profile import RoutingProfile

    if not journal.routing:
        return False
    spec = router_spec(handle.adapter, handle.config)
    if spec is not None:
        num_experts, top_k = spec.num_experts, spec.top_k
    else:  # a family whose own router routes: the counts say how many experts, and how many each token takes
        first = next(iter(journal.routing.values()))
        num_experts, top_k = len(first["counts"]), round(sum(first["counts"]) / max(first["tokens"], 1))
    d = calib.describe()
    RoutingProfile.from_dict({"num_experts": num_experts, "top_k": top_k, "layers": journal.routing,
                              "source": f"quantised calibration pass: {d.get('source')} "
                                        f"{d.get('num_samples')} x {d.get('seq_len')}"}).write(folder)
    return True


def method_stages(methods: list[Method]) -> list[list[Method]]:
    """Split the method chain after each calibrating method that is not last: it transforms the layer
    (smoothing, AWQ scales), and what follows must calibrate on the result."""
    stages: list[list[Method]] = [[]]
    for m in methods[:-1]:
        stages[-1].append(m)
        if m.needs_calibration:
            stages.append([])
    stages[-1].append(methods[-1])
    return stages


def check_finite_weights(ctx: LayerContext) -> None:
    """FP8 scales come from the absmax, so only inf/NaN weights can leave the e4m3 range: refuse them."""
    for name, linear in ctx.targets.items():
        if ctx.scheme_for(name).weights.type == "float" and not torch.isfinite(linear.weight).all():
            bad = int((~torch.isfinite(linear.weight)).sum())
            raise InputError(
                f"{ctx.checkpoint_names.get(name, name)} has {bad} inf/NaN weight(s), which FP8 cannot represent; "
                f"repair the checkpoint or leave the layer unquantised with --ignore"
            )


def _observe_absmax(ctx: LayerContext, name: str):
    def hook(module, args):
        absmax = args[0].detach().abs().amax().float()
        prev = ctx.input_absmax.get(name)
        ctx.input_absmax[name] = absmax if prev is None else torch.maximum(prev, absmax)

    return ctx.targets[name].register_forward_pre_hook(hook)


def _static_input_scale(ctx: LayerContext, name: str) -> torch.Tensor:
    """Static per-tensor activation scale from the calibration absmax (int8: /127.5, fp8 e4m3: /448),
    rounded to the checkpoint dtype as it will be stored; NVFP4's fp32 global scale 448 * 6 / absmax."""
    acts = ctx.scheme_for(name).input_activations
    absmax = ctx.input_absmax.get(name)
    if absmax is None or not torch.isfinite(absmax):
        raise RunError(f"layer {ctx.index}: no finite calibration statistics for {ctx.checkpoint_names[name]}")
    if acts.fp4_global:
        from quantkit.quant.fp4 import nvfp4_global_scale

        return nvfp4_global_scale(absmax).to(absmax.device)
    half_range = 448.0 if acts.type == "float" else ((1 << acts.num_bits) - 1) / 2
    scale = (absmax / half_range).reshape(1)
    scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(ctx.weight_dtype).eps), scale)
    return scale.to(ctx.weight_dtype)


def _simulate_activations(ctx: LayerContext, name: str, input_scale: torch.Tensor | None,
                          only_quantized: bool = False):
    from quantkit.quant.activations import quantize_activation

    args = ctx.scheme_for(name).input_activations

    def hook(module, inputs):
        if only_quantized and name not in ctx.results:
            return None
        x = inputs[0]
        if args.fp4_global:  # NVFP4: the static part is a global scale, kept in fp32
            return (quantize_activation(x, args, input_global_scale=input_scale),) + inputs[1:]
        return (quantize_activation(x, args, None if input_scale is None else input_scale.to(x.dtype)),) + inputs[1:]

    return ctx.targets[name].register_forward_pre_hook(hook)


@dataclass
class RunSetup:
    """Everything a layer-streaming run decides before touching a layer: what is quantised how, with which
    calibration tokens, into which tensors. Shared by `quantize` and `plan`."""

    recipe: Recipe
    scheme: Scheme
    methods: list[Method]
    resolved: object  # ResolvedModel
    handle: ModelHandle
    tokenizer: object
    plans: list[LayerPlan]
    tp_warnings: list[dict]
    calib: CalibrationSet
    n_samples: int
    batch_size: int
    n_batches: int
    weight_dtype: torch.dtype
    specs: list[TensorSpec]
    precision: dict | None = None  # --target-bits / --max-kl: the per-linear plan (quantkit.pipeline.mixed)

    def activation_bytes(self, dtype: torch.dtype | None = None) -> int:
        """One generation of calibration activations (every sample's hidden states entering a layer)."""
        hidden = getattr(self.handle.config, "hidden_size", None) or self.handle.config.get_text_config().hidden_size
        size = torch.empty((), dtype=dtype or torch.float32).element_size()
        return self.n_samples * self.calib.input_ids.shape[1] * hidden * size

    @property
    def error_batches(self) -> int:
        """Batches whose unquantised outputs measure each layer's error (`calibration.error_samples`)."""
        return max(1, math.ceil(min(self.recipe.calibration.error_samples, self.n_samples) / self.batch_size))

    def output_bytes_lower_bound(self) -> int:
        return sum(spec.nbytes for spec in self.specs)


def prepare_run(recipe: Recipe, tp: int | None = None, device: str = "cpu") -> RunSetup:
    q, c = recipe.quantization, recipe.calibration
    c.__post_init__()  # fields set after loading (CLI flags) are checked as a loaded recipe's are
    scheme = get_scheme(q.scheme, q.group_size)
    methods = build_methods(q.method, scheme, q.options)
    folding = [m.name for m in methods if m.name in ("awq", "smoothquant")]
    if c.expert_tokens == "routed" and folding:
        raise InputError(f"calibration.expert_tokens routed does not work with {folding[0]}: it folds one scale "
                         "into the input of every expert of a layer, which wants every expert's statistics on the "
                         "same tokens; use expert_tokens all")
    choices = _mixed_choices(q, methods) if q.mixed else None
    resolved = resolve_model(recipe.model.source)
    handle = open_model(resolved, recipe.model.trust_remote_code)
    if torch.device(device).type == "cpu":
        use_blocked_attention(handle.skeleton)
    if "smoothquant" in folding and handle.adapter.notes == GENERIC:
        raise InputError(f"smoothquant needs the norm -> linear mappings of {handle.adapter.name!r}, which quantkit "
                         f"does not describe (awq derives checked ones; gptq, rtn and fp8 need none)")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(handle.path), trust_remote_code=recipe.model.trust_remote_code)
    except Exception as exc:
        raise InputError(f"cannot load the tokenizer of {handle.path}: {str(exc).splitlines()[0]}") from None

    plans = plan_layers(handle, scheme, q.ignore, strict=q.strict)
    if q.kv_cache:
        plan_kv_cache(handle, plans, q.kv_cache)
    if not q.mixed:  # a mixed plan drops, per linear, the choices whose groups do not fit
        check_group_divisibility(plans, scheme)
    if not any(p.targets for p in plans):
        if not any(isinstance(m, nn.Linear) for m in handle.layers().modules()):
            kinds = sorted({type(m).__name__ for m in handle.layers()[0].modules() if not list(m.children())})
            raise InputError(f"nothing to quantise: the decoder layers of {handle.adapter.name!r} hold no nn.Linear "
                             f"(their modules: {', '.join(kinds)})")
        raise InputError("nothing to quantise: every linear is ignored")
    needs_stats = any(m.needs_calibration for m in methods) or scheme.static_activations or bool(q.kv_cache)
    # a mixed plan's sensitivity pass reads its samples and as many held-out ones (quantkit.pipeline.sensitivity)
    few = max(c.error_samples, 2 * q.mixed.samples if q.mixed else 0)
    n_samples = c.num_samples if needs_stats else min(c.num_samples, few)
    calib = build_token_blocks(tokenizer, c.dataset, n_samples, c.seq_len, c.seed, text_column=c.text_column)
    vocab = getattr(handle.config, "vocab_size", None) or getattr(handle.config.get_text_config(), "vocab_size", None)
    if vocab is not None and int(calib.input_ids.max()) >= vocab:
        raise InputError(
            f"the tokenizer produced token id {int(calib.input_ids.max())} but the model's vocabulary has {vocab} "
            f"entries; the tokenizer in {handle.path} does not belong to this model"
        )
    batch_size = c.batch_size or _auto_batch(c.seq_len)
    n_batches = math.ceil(n_samples / batch_size)
    weight_dtype = handle.source_dtype()
    precision = None
    if q.mixed:
        from quantkit.pipeline.mixed import base_scheme, plan_precision

        with progress_bar() as progress:
            task = progress.add_task("sensitivity", total=len(plans), info="per-linear KL estimate")
            precision = plan_precision(handle, plans, q.mixed, choices, calib.input_ids, weight_dtype, device,
                                       method=methods[-1], on_layer=lambda: progress.advance(task))
        scheme = base_scheme(plans)
        for p in plans:
            for t in p.targets:
                if t.scheme.label == scheme.label:
                    t.scheme = scheme
        methods = build_methods(q.method, scheme, q.options)
    from quantkit.pipeline.tp import tp_warnings

    shard_warnings = tp_warnings(plans, tp)  # after a mixed plan: each linear's own scheme
    # Every output tensor, in order: non-layer tensors as on disk, then each layer.
    specs: list[TensorSpec] = []
    for name in handle.non_layer_checkpoint_names():
        info = handle.index.tensors[name]
        specs.append(TensorSpec(name, handle.index.dtype(name), info.shape))
    for p in plans:
        for t in p.targets:
            specs.extend(quantized_specs(t.checkpoint, t.out_features, t.in_features, t.scheme, weight_dtype,
                                         with_g_idx=_writes_g_idx(methods)))
        for ckpt, dtype, shape in p.kept.values():
            specs.append(TensorSpec(ckpt, dtype, shape))
        for name in p.copied:
            specs.append(TensorSpec(name, handle.index.dtype(name), handle.index.tensors[name].shape))
        if p.kv_attention:
            shape = (1,) if kv_strategy(q.kv_cache) == "tensor" else (p.kv_heads, 1, 1)
            attn = handle.checkpoint_name(p.index, p.kv_attention)
            specs += [TensorSpec(f"{attn}.{leaf}", weight_dtype, shape) for leaf in ("k_scale", "v_scale")]
    return RunSetup(recipe, scheme, methods, resolved, handle, tokenizer, plans, shard_warnings, calib, n_samples,
                    batch_size, n_batches, weight_dtype, specs, precision)


def _mixed_choices(q, methods: list[Method]) -> list[Scheme]:
    """The schemes a mixed plan may use, each one every method of the run can produce."""
    from quantkit.methods import check_schemes
    from quantkit.pipeline.mixed import parse_choices

    choices = parse_choices(q.mixed, q.group_size)
    for s in choices:
        check_schemes([m.name for m in methods], s)
    if _writes_g_idx(methods):
        raise InputError("mixed precision with GPTQ act-order 'group' is not supported (its g_idx layout is "
                         "per scheme); use --actorder static (the default)")
    return choices


def quantize_model(
    recipe: Recipe,
    output: Path,
    resume: bool = False,
    overwrite: bool = False,
    offload_dir: Path | None = None,
    device: str = "auto",
    max_shard_bytes: int | None = None,
    compute_dtype: str = "auto",
    tp: int | None = None,
) -> dict:
    """Quantise `recipe`'s model into `output` (written as `output.partial`, renamed at the end). One run
    per output at a time: a second one exits 2 naming the first one's pid. Under torchrun every rank calls
    this with the same arguments (quantkit.distributed): rank 0 takes the lock and writes; the others return
    `{"rank": r, "output": ...}`."""
    from contextlib import ExitStack

    from quantkit.distributed import ranks_from_env
    from quantkit.pipeline.lock import output_lock

    with ranks_from_env(_resolve_device(device)) as (ranks, device), ExitStack() as stack:
        error = None
        if ranks.writer:
            try:
                stack.enter_context(output_lock(Path(output)))
            except InputError as exc:
                error = exc
                if not ranks.distributed:
                    raise
        ranks.first_error(error)
        options = _RunOptions(Path(output), resume, overwrite, offload_dir, device, max_shard_bytes, compute_dtype, tp)
        return _quantize_locked(recipe, options, ranks)


@dataclass
class _RunOptions:
    output: Path
    resume: bool
    overwrite: bool
    offload_dir: Path | None
    device: str
    max_shard_bytes: int | None
    compute_dtype: str
    tp: int | None


def _check_output(options: _RunOptions, partial: Path, run_key: str) -> Journal | None:
    """Refuse an output that exists, or a partial run from another recipe; the journal to resume, if any."""
    output, resume, overwrite = options.output, options.resume, options.overwrite
    if output.exists() and not overwrite:
        raise InputError(f"output {output} already exists; pass --overwrite to replace it")
    if not partial.exists():
        return None
    if resume:
        journal = Journal.load(partial)
        if journal is None or journal.run_key != run_key:
            raise InputError(
                f"{partial} is from a different run (model, recipe or data changed); pass --overwrite to start over"
            )
        return journal
    if overwrite:
        shutil.rmtree(partial)
        return None
    raise InputError(f"an unfinished run exists at {partial}; pass --resume to continue it or --overwrite to start over")


def _quantize_locked(recipe: Recipe, options: _RunOptions, ranks: Ranks = SINGLE) -> dict:
    t_start = time.time()
    return_large_frees_to_os()
    output, offload_dir, device = options.output, options.offload_dir, options.device
    device_peak = DevicePeak(device)  # reset here: the manifest's device peak is this run's
    q = recipe.quantization
    scheme = get_scheme(q.scheme, q.group_size)
    methods = build_methods(q.method, scheme, q.options)
    from quantkit.pipeline.stream import stream_quantize, streams

    if not q.mixed and streams(methods, scheme, q.kv_cache):
        if not ranks.writer:  # data-free: nothing to calibrate, rank 0 converts tensor by tensor
            return {"rank": ranks.rank, "output": str(output)}
        return stream_quantize(recipe, output, scheme, overwrite=options.overwrite,
                               max_shard_bytes=options.max_shard_bytes, tp=options.tp)
    partial = output.with_name(output.name + ".partial")
    setup = prepare_run(recipe, options.tp, device)
    resolved, handle, plans, calib = setup.resolved, setup.handle, setup.plans, setup.calib
    scheme = setup.scheme  # a mixed plan's most common choice
    n_batches = setup.n_batches
    weight_dtype = setup.weight_dtype
    methods = setup.methods  # fresh instances: the ones above only decided the path
    from quantkit.pipeline.plan import check_disk_space

    run_key = _run_key(recipe, calib, handle)
    ranks.agree(run_key, "recipe, model, calibration data or quantkit version")
    ranks.check_shared(output.parent, "--output's folder")
    if ranks.world > n_batches:
        raise InputError(f"{ranks.world} ranks but this run calibrates on only {n_batches} batch(es) "
                         f"({setup.n_samples} samples, {setup.batch_size} a batch): use at most {n_batches} processes")
    journal, error = None, None
    if ranks.writer:
        try:
            # Refuse now, not hours in, when the output and the resume state (or spilled activations) cannot fit.
            generation = setup.activation_bytes()  # fp32: the widest activations a run keeps
            check_disk_space(output, setup.output_bytes_lower_bound(), offload_dir=offload_dir, resume=options.resume,
                             state_bytes=0 if offload_dir else 2 * generation,
                             spill_bytes=2 * generation if offload_dir else 0)
            journal = _check_output(options, partial, run_key)
        except InputError as exc:
            if not ranks.distributed:
                raise
            error = exc
    ranks.first_error(error)
    fresh = journal is None
    # Calibrate in whichever dtype this machine multiplies fastest (measured once per machine; bf16 on CPUs
    # with AVX-512 BF16 / AMX, fp32 on AVX2-only ones, where bf16 is ~30x slower); statistics are fp32 in the
    # methods either way. An fp32 model keeps fp32 master weights and runs bf16 under autocast; a bf16 model
    # computing in fp32 is upcast one layer at a time, so the memory bound of one layer stays. A resumed run
    # keeps the choice it started with, so its bytes equal an uninterrupted run's; every rank takes rank 0's.
    compute_dtype = options.compute_dtype
    resumed = not fresh and bool(journal.compute)
    if resumed:
        compute_dtype = journal.compute["dtype"]
    if ranks.writer:
        compute = choose_compute_dtype(compute_dtype, weight_dtype, device, matmul_shapes(handle.config))
        if resumed:  # the journal chose it, not the user
            compute = dataclasses.replace(compute, reason="resumed")
        announce(compute.describe())
    chosen = ranks.broadcast(compute.name if ranks.writer else None)
    if not ranks.writer:
        compute = choose_compute_dtype(chosen, weight_dtype, device)
    autocast = compute.autocast
    run = LayerRun(handle, plans, methods, scheme, n_batches, device, None, journal, partial, partial / ".state",
                   Path(offload_dir) if offload_dir else None, weight_dtype,
                   compute.layer_dtype, autocast, setup.error_batches, ranks,
                   schedule=recipe.calibration.schedule, device_peak=device_peak,
                   kv_cache=recipe.quantization.kv_cache, expert_tokens=recipe.calibration.expert_tokens,
                   min_expert_tokens=recipe.calibration.min_expert_tokens)
    if ranks.writer:
        if fresh:
            run.journal = Journal(run_key, compute=compute.to_dict())
            partial.mkdir(parents=True)
        try:
            run.writer = PlannedShardWriter(partial, setup.specs, options.max_shard_bytes or 5 * 10**9, create=fresh)
            if fresh:
                run.journal.commit(partial)
        except OSError as exc:
            _cleanup_on_disk_full(exc, partial)
            raise
    start = ranks.broadcast(run.journal.resume_layer() if ranks.writer else None)
    try:
        _run_layers(run, calib, setup.batch_size, start)
    except OSError as exc:
        _cleanup_on_disk_full(exc, partial)
        raise RunError(f"cannot write {partial}: {exc.strerror or exc}") from None
    except InputError:
        # The input itself is unusable (e.g. inf weights): a resume would fail the same way.
        if run.writer is not None:
            run.writer.close()
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if not ranks.writer:
        return {"rank": ranks.rank, "output": str(output)}
    journal, writer = run.journal, run.writer
    writer.close()
    writer.write_index()

    recipe_used, overrides = write_config_and_extras(handle, plans, scheme, recipe, partial, output,
                                                     actorder=_actorder(methods))
    if setup.precision is not None:
        from quantkit.pipeline.mixed import PLAN_FILE

        (partial / PLAN_FILE).write_text(json.dumps(setup.precision, indent=2))
    # Before the manifest, so the profile is hashed with the rest of the checkpoint.
    wrote_profile = write_routing_profile(handle, journal, calib, partial)
    shutil.rmtree(run.state_dir, ignore_errors=True)
    Journal.path(partial).unlink(missing_ok=True)

    wall = time.time() - t_start
    summary = {
        "output": str(output),
        "model": resolved.label,
        "model_path": str(handle.path),
        "method": "+".join(m.name for m in methods),
        "scheme": scheme.name,
        "group_size": scheme.weights.group_size if scheme.weights.strategy == "group" else -1,
        "device": device,
        "device_name": device_name(device),
        "compute_dtype": compute.name + (" (bf16 autocast)" if autocast else ""),
        "compute": compute.to_dict(),
        "wall_seconds": round(wall, 3),
        "peak_rss_bytes": peak_rss_bytes(),
        # torch.cuda.max_memory_allocated over the run on a GPU; null on CPU (peak_rss_bytes is the figure there).
        "device_peak_bytes": device_peak.run(),
        "activations": run.activations,  # where the calibration activations lived: device, host or disk
        "original_bytes": handle.index.total_bytes(),
        "quantized_linears": sum(len(p.targets) for p in plans),
        "calibration": calib.describe(),
        "layers": journal.layer_records,
        "phase_seconds": phase_totals(journal.layer_records, wall),
        "events": journal.events,
        "scheme_overrides": overrides,
        "tp_warnings": setup.tp_warnings,
        "resume_state_bytes": journal.state_bytes,
    }
    if setup.precision is not None:
        summary["precision"] = {k: v for k, v in setup.precision.items() if k != "linears"}
    if ranks.distributed:
        moved = [r.get("bytes_moved", 0) for r in journal.layer_records]
        summary["distributed"] = {"world_size": ranks.world, "backend": ranks.backend,
                                  "batches_per_rank": [len(Ranks(r, ranks.world).shard(n_batches))
                                                       for r in range(ranks.world)],
                                  "bytes_moved_per_layer": round(sum(moved) / max(1, len(moved)))}
    if wrote_profile:
        summary["routing_profile"] = "routing_profile.json"
        summary["experts"] = starved_experts(journal.routing, recipe.calibration)
    return finish_output(partial, output, recipe_used, summary, handle)


def starved_experts(routing: dict, calibration) -> dict:
    """The manifest's account of expert calibration: how experts were calibrated and which were routed fewer
    than min_expert_tokens calibration tokens (their statistics came from every token with expert_tokens
    all; methods that need statistics gave them RTN with routed)."""
    starved = [{"layer": int(layer), "expert": e, "routed_tokens": int(n)}
               for layer, rec in sorted(routing.items(), key=lambda kv: int(kv[0]))
               for e, n in enumerate(rec["counts"]) if n < calibration.min_expert_tokens]
    return {"calibration": calibration.expert_tokens, "min_expert_tokens": calibration.min_expert_tokens,
            "treatment": "all-token statistics" if calibration.expert_tokens == "all" else "rtn",
            "starved": starved}


def scheme_overrides(plans: list[LayerPlan], scheme: Scheme) -> dict[str, list[str]]:
    """Scheme label -> checkpoint names of the linears that use it instead of the run's scheme (fallbacks, or a
    mixed plan's other choices)."""
    overrides: dict[str, list[str]] = {}
    for p in plans:
        for t in p.targets:
            if t.scheme.label != scheme.label:
                overrides.setdefault(t.scheme.label, []).append(t.checkpoint)
    return overrides


def write_config_and_extras(handle: ModelHandle, plans: list[LayerPlan], scheme: Scheme, recipe: Recipe,
                            partial: Path, output: Path, actorder: str | None = None) -> tuple[Recipe, dict]:
    """config.json with its quantization_config, the tokenizer and other non-weight files, recipe.yaml.
    Returns the recipe as written and the scheme overrides."""
    q = recipe.quantization
    config = json.loads((handle.path / "config.json").read_text())
    overrides = scheme_overrides(plans, scheme)
    config["quantization_config"] = build_quantization_config(
        scheme, _protected_ignore(handle, plans, q.ignore), actorder=actorder, overrides=overrides,
        kv_cache=q.kv_cache)
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    for item in handle.path.iterdir():
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and item.name not in (
            "config.json", "model.safetensors.index.json", "quantkit_manifest.json", "recipe.yaml", "quantkit_source.json"
        ) and not (item.suffix == ".py" and not recipe.model.trust_remote_code):
            shutil.copy2(item, partial / item.name)
    recipe_used = Recipe.from_dict(recipe.to_dict())
    recipe_used.output = str(output)
    (partial / "recipe.yaml").write_text(recipe_used.to_yaml())
    return recipe_used, overrides


def finish_output(partial: Path, output: Path, recipe_used: Recipe, summary: dict, handle: ModelHandle) -> dict:
    """Write the manifest (hashes of everything written) and move the finished folder into place."""
    manifest = write_manifest(partial, recipe_used, summary, handle)
    summary["output_bytes"], summary["weights_bytes"] = manifest["output_bytes"], manifest["weights_bytes"]
    summary["bits_per_weight"] = manifest["bits_per_weight"]
    publish(partial, output)
    return summary


def _writes_g_idx(methods: list[Method]) -> bool:
    return any(getattr(m, "writes_g_idx", False) for m in methods)


def _actorder(methods: list[Method]) -> str | None:
    if _writes_g_idx(methods):
        return "group"
    # A method may record how it ordered columns (GPTQ static act-order -> "weight"); the format is unchanged.
    return next((m.config_actorder for m in methods if getattr(m, "config_actorder", None)), None)


def _cleanup_on_disk_full(exc: OSError, partial: Path) -> None:
    if exc.errno == 28:
        shutil.rmtree(partial, ignore_errors=True)
        raise RunError(f"disk full while writing {partial}; nothing was left behind") from None


@dataclass
class LayerRun:
    """What the layer loop of one run works with (on ranks past 0 of a data-parallel run, `writer` and
    `journal` are None: rank 0 writes)."""

    handle: ModelHandle
    plans: list[LayerPlan]
    methods: list[Method]
    scheme: Scheme
    n_batches: int
    device: str
    writer: PlannedShardWriter | None
    journal: Journal | None
    partial: Path
    state_dir: Path
    spill: Path | None
    weight_dtype: torch.dtype
    compute_dtype: torch.dtype
    autocast: bool
    error_batches: int
    ranks: Ranks = SINGLE
    schedule: str = "auto"  # recipe calibration.schedule: auto, one-pass or two-pass
    device_peak: DevicePeak | None = None  # per-layer and run peak of device memory (GPU runs)
    activations: str = "device"  # where the activations live (run_activation_placement; disk with a spill folder)
    kv_cache: str | None = None  # recipe quantization.kv_cache
    expert_tokens: str = "all"  # recipe calibration.expert_tokens
    min_expert_tokens: int = 64

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype the calibration activations are kept in: the one the layers compute in. Under bf16 autocast
        that is bf16 (each matmul reads its input rounded to bf16 anyway, and the engines serving the checkpoint
        carry a 16-bit residual stream), which halves the largest buffer of the run."""
        return torch.bfloat16 if self.autocast else self.compute_dtype


def run_activation_placement(handle: ModelHandle, plans: list[LayerPlan], device: str, compute_dtype: torch.dtype,
                             tokens: int) -> str:
    """`activation_placement` for a run: one generation of `tokens` hidden states in the compute dtype against
    the device memory free now, beside the largest layer's working set (device on CPU, without asking)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return "device"
    config = handle.config
    hidden = getattr(config, "hidden_size", None) or config.get_text_config().hidden_size
    element = torch.empty((), dtype=compute_dtype).element_size()
    working = max((layer_working_bytes([(t.out_features, t.in_features) for t in p.targets], element)
                   for p in plans), default=0)
    return activation_placement(dev, tokens * hidden * element, working, _free_memory(dev),
                                os.environ.get("QUANTKIT_DEVICE_ACTIVATIONS") or None)


def _run_layers(run: LayerRun, calib: CalibrationSet, batch_size: int, start: int) -> None:
    handle, ranks = run.handle, run.ranks
    with progress_bar() as progress:
        if run.writer is not None and not run.journal.non_layer_done:
            for name in handle.non_layer_checkpoint_names():
                info = handle.index.tensors[name]
                if name in handle.index.native_fp8:
                    run.writer.write(name, handle.index.get(name))
                else:
                    run.writer.write_raw(name, info.file, info.offset, info.nbytes)
            run.writer.sync()
            run.journal.non_layer_done = True
            run.journal.commit(run.partial)

        # This rank's batches (all of them in one process): the same batches, of the same size, as one process.
        owned = ranks.shard(run.n_batches)
        spill = None
        if run.spill is not None:
            spill = run.spill / "a" if not ranks.distributed else run.spill / f"a-rank{ranks.rank}"
        rows = slice(owned[0] * batch_size, (owned[-1] + 1) * batch_size)
        ids = calib.input_ids[rows]
        # On a GPU the activations stay on the device while they fit beside a layer, else in host memory
        # (each batch moved over when a layer runs it); a spill folder keeps them on disk. Either way a batch
        # leaves the device as soon as it is captured, so the capture never holds a whole generation there.
        host = spill is None and run_activation_placement(handle, run.plans, run.device, run.activation_dtype,
                                                          ids.numel()) == "host"
        off_device = (host or spill is not None) and torch.device(run.device).type != "cpu"
        hidden, calls = capture_layer_inputs(handle, ids, batch_size, run.device, run.activation_dtype,
                                             hidden_device="cpu" if off_device else None)
        calls = dict(zip(owned, calls))
        if start == 0:
            acts = ActivationStore(spill, run.device, host, run.activation_dtype)
            for j, h in zip(owned, hidden):
                acts[j] = h
        else:
            acts = ActivationStore.load_from(run.state_dir / f"gen-{start:05d}", owned, spill, run.device, host,
                                             run.activation_dtype)
        run.activations = acts.placement
        del hidden
        release_freed_memory()
        # Everything alive now (the libraries, the skeleton) outlives the layer loop: keep it out of the
        # per-layer gc.collect, which otherwise rescans it every layer (0.15 s each on SmolLM2).
        gc.freeze()
        try:
            _layer_loop(run, progress, LayerBatches(acts, calls, owned, run.error_batches, ranks,
                                                    batch_tokens=batch_size * ids.shape[1]), start)
        finally:
            gc.unfreeze()


def observe_kv(layer: nn.Module, plan: LayerPlan, ctx: LayerContext) -> list:
    """--kv-cache: record the absmax per KV head of the keys and values the layer's attention stores. An MLA
    layer stores its latent (as keys) and its rope part after RoPE (as values) in one cache row under one scale:
    both scales then take the absmax of the two."""
    if not plan.kv_attention:
        return []
    from quantkit.models.kv_tap import tap_kv
    from quantkit.quant.kv_cache import head_absmax

    def observe(k: torch.Tensor, v: torch.Tensor):
        seen = {"k": head_absmax(k), "v": head_absmax(v)}
        if plan.kv_latent:
            seen["k"] = seen["v"] = torch.maximum(seen["k"].amax(), seen["v"].amax()).reshape(1)
        for key, m in seen.items():
            prev = ctx.kv_absmax.get(key)
            ctx.kv_absmax[key] = m if prev is None else torch.maximum(prev, m)
        return k, v

    return [tap_kv(dict(layer.named_modules())[plan.kv_attention], observe)]


def kv_scales(handle: ModelHandle, plan: LayerPlan, ctx: LayerContext, mode: str | None,
              dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The layer's k_scale / v_scale tensors by checkpoint name (none without --kv-cache)."""
    if not plan.kv_attention:
        return {}
    from quantkit.quant.kv_cache import kv_scale, kv_strategy

    if set(ctx.kv_absmax) != {"k", "v"}:
        raise RunError(f"layer {plan.index}: --kv-cache saw no keys or values stored by {plan.kv_attention}")
    attn = handle.checkpoint_name(plan.index, plan.kv_attention)
    return {f"{attn}.{leaf}_scale": kv_scale(ctx.kv_absmax[leaf], kv_strategy(mode), dtype).cpu() for leaf in "kv"}


def layer_context(handle: ModelHandle, plan: LayerPlan, layer: nn.Module, scheme: Scheme,
                  weight_dtype: torch.dtype, compute_dtype: torch.dtype, autocast: bool) -> LayerContext:
    modules = dict(layer.named_modules())
    return LayerContext(
        index=plan.index,
        layer=layer,
        targets={t.local: modules[t.local] for t in plan.targets},
        scheme=scheme,
        schemes={t.local: t.scheme for t in plan.targets if t.scheme is not scheme},
        checkpoint_names={t.local: t.checkpoint for t in plan.targets},
        weight_dtype=weight_dtype,
        adapter=handle.adapter,
        matmul_dtype=torch.bfloat16 if autocast else compute_dtype,
    )


def _layer_loop(run: LayerRun, progress, batches: LayerBatches, start: int) -> None:
    from quantkit.pipeline.journal import StatePolicy

    handle, plans, ranks, writer, journal = run.handle, run.plans, run.ranks, run.writer, run.journal
    layer_task = progress.add_task("layers", total=len(plans), completed=start, info="")
    n_own = len(batches.owned)
    batch_task = progress.add_task("  batches", total=2 * n_own, info="")
    delay = float(os.environ.get("QUANTKIT_DEBUG_LAYER_DELAY", "0"))  # test aid: widen the kill window
    policy = StatePolicy()
    for plan in plans[start:]:
        t0 = time.time()
        i = plan.index
        ranks.at_layer(i)
        moved0 = ranks.bytes_moved
        if delay:
            time.sleep(delay)
        began = time.perf_counter()
        layer = handle.materialize_layer(i, run.compute_dtype, run.device)
        ctx = layer_context(handle, plan, layer, run.scheme, run.weight_dtype, run.compute_dtype, run.autocast)
        ctx.all_expert_tokens, ctx.min_expert_tokens = run.expert_tokens == "all", run.min_expert_tokens
        ctx.expert_linears = routed_expert_linears(layer, ctx.targets)
        ctx.phases["load"] = time.perf_counter() - began
        modules = None
        progress.reset(batch_task, total=2 * n_own, info=f"layer {i}")
        counts = _routing_counter(layer)
        taps = observe_kv(layer, plan, ctx)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=run.autocast):
                rel = process_layer(layer, ctx, run.methods, batches,
                                    on_batch=lambda: progress.advance(batch_task),
                                    on_routing=counts.add if counts is not None else None, schedule=run.schedule)
        finally:
            for tap in taps:
                tap.remove()
        if plan.kv_attention and ranks.distributed:
            ctx.kv_absmax = ranks.reduce(ctx.kv_absmax, "max")
        if counts is not None and ranks.distributed:
            counts.merge(ranks.reduce(counts.tensors(), "sum"))
        if writer is not None and counts is not None and counts.tokens:
            journal.routing[str(i)] = {"tokens": counts.tokens, "counts": counts.counts.tolist(),
                                       "coactivation": counts.coactivation.tolist()}
        params = dict(layer.named_parameters())
        if writer is not None:
            with ctx.phase("write"):
                for t in plan.targets:
                    for name, tensor in pack_quantized(t.checkpoint, ctx.results[t.local], t.scheme, run.weight_dtype,
                                                       ctx.input_scales.get(t.local)).items():
                        writer.write(name, tensor)
                for local, (ckpt, dtype, _) in plan.kept.items():
                    writer.write(ckpt, params[local].detach().to(dtype))
                for name in plan.copied:
                    writer.write(name, handle.index.get(name))
                for name, tensor in kv_scales(handle, plan, ctx, run.kv_cache, run.weight_dtype).items():
                    writer.write(name, tensor)
                writer.sync()
        # Persist the activations entering the next layer when the policy says the cost is due, then commit:
        # a kill resumes from the newest saved generation (recomputing any layers after it, same bytes).
        # Only that one generation is kept; the previous one is deleted once the journal names the new one.
        # Each rank saves its own batches into the one folder (on a filesystem every rank sees); rank 0's
        # clock decides, and commits once every rank has saved.
        previous = journal.state_layer if journal is not None else None
        due = ranks.broadcast(i + 1 < len(plans) and policy.due() if ranks.writer else None)
        if due:
            began = time.monotonic()
            with ctx.phase("state_save"):
                saved = batches.acts.save_to(run.state_dir / f"gen-{i + 1:05d}", batches.owned)
            saved = sum(ranks.gather(saved))
            policy.saved(began)
            if journal is not None:
                journal.state_bytes += saved
                journal.state_layer = i + 1
        if journal is not None:
            record = {"layer": i, "rel_error": rel, "seconds": round(time.time() - t0, 3), "schedule": ctx.schedule,
                      "phases": layer_phases(ctx.phases), "linear_errors": ctx.linear_errors}
            layer_peak = run.device_peak.layer() if run.device_peak is not None else None
            if layer_peak is not None:  # GPU runs: the layer's peak device memory (the first includes the capture)
                record["device_peak_bytes"] = layer_peak
            if ranks.distributed:
                record["bytes_moved"] = ranks.bytes_moved - moved0
            journal.layer_records.append(record)
            journal.events.extend(ctx.events)
            journal.layers_done = i + 1
            journal.commit(run.partial)
            if previous and previous != journal.state_layer:
                shutil.rmtree(run.state_dir / f"gen-{previous:05d}", ignore_errors=True)
        del layer, ctx, modules, params
        release_freed_memory_between_layers(time.time() - t0)
        progress.update(layer_task, advance=1, info=f"rel err {rel:.4f}")
    ranks.at_layer(None)
    ranks.barrier()  # rank 0 renames the folder only once no rank still reads the resume state
    batches.acts.drop()
