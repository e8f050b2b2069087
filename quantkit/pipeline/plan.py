"""`quantkit plan` / `quantize --dry-run`: what a run will need before it starts.

Disk is exact: every output tensor is planned up front (the shard headers included), and config.json, the
tokenizer files and recipe.yaml are written for real into a scratch folder and measured. Memory and wall time
are measured, then extrapolated: layer 0 is materialised and run through the real method chain on one batch
of the real calibration tokens, with the forward passes (which scale with the samples) timed apart from the
methods' own work (which does not); each layer is then scaled by its size on disk relative to layer 0. Peak
memory is the trial's high-water mark plus what the trial did not hold: the rest of the activations (one
generation resident, each batch's output replacing its input, plus the reference outputs of the
error-measuring batches) and a larger layer if there is one.

The same disk check guards `quantize` itself: a run that cannot fit its output (and its resume state) is
refused before any work, with one line and exit 2.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit.errors import InputError
from quantkit.pipeline.memory import HighWaterMark, peak_rss_bytes
from quantkit.recipe import Recipe

MANIFEST_SLACK = 1 << 20
STREAM_THREADS = 2  # stream_quantize's default worker count  # the manifest (sha256 per file, per-layer records) is written last; a MB covers it


@dataclass
class PlanOptions:
    recipe: Recipe
    output: Path
    offload_dir: Path | None = None
    device: str = "auto"
    compute_dtype: str = "auto"
    tp: int | None = None
    overwrite: bool = False
    resume: bool = False
    max_shard_bytes: int | None = None
    trial_samples: int | None = None  # default: one calibration batch
    startup_peak: int = 0  # peak RSS of the process before planning started (set by plan_run)


def _with_startup_peak(opts: PlanOptions, peak: int) -> PlanOptions:
    from dataclasses import replace

    return replace(opts, startup_peak=max(opts.startup_peak, peak))


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def _tree_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def check_disk_space(output: Path, output_bytes: int, offload_dir: Path | None = None, resume: bool = False,
                     state_bytes: int = 0, spill_bytes: int = 0) -> dict:
    """Refuse (InputError, exit 2) when the filesystems cannot hold what the run writes: the output shards (already
    reserved when resuming) and the resume state next to the output, the spilled activations under
    `offload_dir`. An unfinished `OUT.partial` that a fresh run replaces counts as free."""
    output = Path(output)
    partial = output.with_name(output.name + ".partial")
    needs: dict[int, dict] = {}

    def need(path: Path, nbytes: int, what: str) -> None:
        anchor = _existing_ancestor(path)
        entry = needs.setdefault(anchor.stat().st_dev, {"anchor": anchor, "bytes": 0, "parts": []})
        entry["bytes"] += nbytes
        entry["parts"].append(f"{what} {fmt_bytes(nbytes)}")

    need(output.parent, 0 if resume else output_bytes + MANIFEST_SLACK, "output")
    if state_bytes:
        need(output.parent, state_bytes, "resume state")
    if offload_dir is not None and spill_bytes:
        need(Path(offload_dir), spill_bytes, "spilled activations")
    report = {}
    for entry in needs.values():
        free = shutil.disk_usage(entry["anchor"]).free
        if not resume and partial.exists() and _existing_ancestor(partial).stat().st_dev == entry["anchor"].stat().st_dev:
            free += _tree_bytes(partial)
        report[str(entry["anchor"])] = {"needed_bytes": entry["bytes"], "free_bytes": free}
        if entry["bytes"] > free:
            raise InputError(f"not enough disk space on {entry['anchor']}: the run needs {fmt_bytes(entry['bytes'])} "
                             f"({', '.join(entry['parts'])}), {fmt_bytes(free)} free")
    return report


def _sha256_rate() -> float:
    """Bytes per second this machine hashes (the manifest hashes every source and output file)."""
    block = os.urandom(1 << 20) * 32
    began = time.perf_counter()
    hashlib.sha256(block).hexdigest()
    return len(block) / max(time.perf_counter() - began, 1e-6)


def _layer_bytes(handle, n_layers: int) -> list[int]:
    return [sum(handle.index.tensors[n].nbytes for n in handle.layer_checkpoint_names(i)) for i in range(n_layers)]


def _extras_bytes(handle, plans, scheme, recipe, output, actorder) -> int:
    """config.json, tokenizer and other copied files, recipe.yaml: written for real into a scratch folder."""
    from quantkit.pipeline.engine import write_config_and_extras

    with tempfile.TemporaryDirectory(prefix="quantkit-plan-") as tmp:
        write_config_and_extras(handle, plans, scheme, recipe, Path(tmp), Path(output), actorder=actorder)
        return sum(p.stat().st_size for p in Path(tmp).iterdir() if p.is_file())


@dataclass
class Trial:
    samples: int
    capture_seconds: float
    materialize_seconds: float
    forward_seconds: float
    apply_seconds: float
    pack_seconds: float
    rss_before: int
    rss_peak: int
    activation_element_bytes: int
    extra: dict = field(default_factory=dict)


def _trial_layer0(setup, device: str, compute, trial_samples: int | None) -> Trial:
    from quantkit.formats.compressed_tensors import pack_quantized
    from quantkit.pipeline.activations import ActivationStore
    from quantkit.pipeline.capture import capture_layer_inputs
    from quantkit.pipeline.engine import LayerBatches, layer_context, paused_activation_bytes, process_layer
    from quantkit.pipeline.memory import release_freed_memory

    n = max(1, min(setup.n_samples, trial_samples or setup.batch_size))
    autocast = compute.autocast
    compute_dtype = compute.layer_dtype
    ids = setup.calib.input_ids[:n]
    release_freed_memory()
    hwm = HighWaterMark()
    rss_before = hwm.current()
    began = time.perf_counter()
    # Activations in the dtype the layers compute in (LayerRun.activation_dtype): bf16 under autocast.
    hidden, calls = capture_layer_inputs(setup.handle, ids, setup.batch_size, device, compute.dtype)
    capture = time.perf_counter() - began
    plan = setup.plans[0]
    element = hidden[0].element_size()
    # Layer 0 twice, timing the second: the process's first matmuls and scale searches of these shapes pay
    # one-time costs (kernel selection, lazy initialisation) that a real run pays once, not once per layer.
    # Each pass materialises the layer afresh and uses fresh method instances (methods keep per-run state).
    from quantkit.methods import build_methods

    q = setup.recipe.quantization
    layer = ctx = acts = None
    for _ in range(2):
        layer = ctx = acts = None  # the previous pass's layer is not part of this one's memory
        release_freed_memory()
        hwm = HighWaterMark()
        began = time.perf_counter()
        layer = setup.handle.materialize_layer(0, compute_dtype, device)
        materialize = time.perf_counter() - began
        ctx = layer_context(setup.handle, plan, layer, setup.scheme, setup.weight_dtype, compute_dtype, autocast)
        acts = ActivationStore(dtype=compute.dtype)
        for j, h in enumerate(hidden):
            acts[j] = h
        timings: dict = {}
        methods = build_methods(q.method, setup.scheme, q.options)
        batches = LayerBatches.local(acts, calls, setup.error_batches)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            process_layer(layer, ctx, methods, batches, timings=timings, schedule=setup.recipe.calibration.schedule)
        # One-pass holds every batch's activations at the pauses: that part of the peak grows with the samples.
        paused_per_sample = paused_activation_bytes(ctx, batches) / n if ctx.schedule == "one-pass" else 0.0
        began = time.perf_counter()
        for t in plan.targets:
            pack_quantized(t.checkpoint, ctx.results[t.local], t.scheme, setup.weight_dtype,
                           ctx.input_scales.get(t.local))
        pack = time.perf_counter() - began
    del hidden
    peak = hwm.peak()
    ctx_schedule = ctx.schedule
    del layer, ctx, acts, batches
    release_freed_memory()
    return Trial(n, capture, materialize, timings["forward"], timings["apply"], pack, rss_before, peak, element,
                 {"hwm_resettable": hwm.resettable, "schedule": ctx_schedule, "paused_bytes_per_sample": paused_per_sample,
                  "capped_forward_seconds": timings.get("capped_forward", 0.0),
                  "capped_tokens": timings.get("capped_tokens", 0)})


def plan_run(opts: PlanOptions) -> dict:
    """The plan of a quantize run (see the module docstring). Raises InputError when the disk is short."""
    from quantkit.methods import build_methods
    from quantkit.pipeline.engine import _actorder, _resolve_device, prepare_run
    from quantkit.pipeline.memory import return_large_frees_to_os
    from quantkit.pipeline.stream import streams
    from quantkit.quant.schemes import get_scheme

    return_large_frees_to_os()  # the run's allocator behaviour, so the trial's memory is the run's
    t0 = time.perf_counter()
    # What this process has peaked at so far (imports, argument parsing): the run pays it too, and the
    # high-water-mark resets below would hide it.
    opts = _with_startup_peak(opts, peak_rss_bytes())
    recipe, output = opts.recipe, Path(opts.output)
    device = _resolve_device(opts.device)  # first, as quantize does: --device cuda without a GPU is refused
    q = recipe.quantization
    scheme = get_scheme(q.scheme, q.group_size)
    if not q.mixed and streams(build_methods(q.method, scheme, q.options), scheme, q.kv_cache):
        return _plan_stream(opts, scheme, t0)
    if output.exists() and not opts.overwrite:
        raise InputError(f"output {output} already exists; pass --overwrite to replace it")
    hwm_setup = HighWaterMark()
    setup = prepare_run(recipe, opts.tp, device)
    from quantkit.compute import choose_compute_dtype, matmul_shapes

    compute = choose_compute_dtype(opts.compute_dtype, setup.weight_dtype, device, matmul_shapes(setup.handle.config))
    setup_seconds = time.perf_counter() - t0
    setup_peak = hwm_setup.peak()

    from quantkit.formats.safetensors_writer import PlannedShardWriter

    layout = PlannedShardWriter(output, setup.specs, opts.max_shard_bytes or 5 * 10**9, create=False)
    index_text = layout.index_text()
    shard_bytes = sum(layout.sizes.values()) + (len(index_text.encode()) if index_text else 0)
    extras = _extras_bytes(setup.handle, setup.plans, setup.scheme, recipe, output, _actorder(setup.methods))
    output_bytes = shard_bytes + extras
    act_dtype = compute.dtype  # what the activations are kept in (bf16 under autocast too)
    generation = setup.activation_bytes(act_dtype)
    spill = opts.offload_dir is not None
    disk = check_disk_space(output, output_bytes, opts.offload_dir, opts.resume,
                            state_bytes=0 if spill else 2 * generation, spill_bytes=2 * generation if spill else 0)

    from quantkit.pipeline.engine import run_activation_placement

    placement = "disk" if spill else run_activation_placement(setup.handle, setup.plans, device, act_dtype,
                                                              setup.calib.input_ids.numel())
    trial = _trial_layer0(setup, device, compute, opts.trial_samples)
    n, n_layers = setup.n_samples, len(setup.plans)
    sizes = _layer_bytes(setup.handle, n_layers)
    ratios = [b / sizes[0] if sizes[0] else 1.0 for b in sizes]
    # A calibration pass capped by a method's `statistics_tokens` runs the run's first whole batches up to the cap
    # (and the error-measuring ones), however many samples the run has: that part scales only to there.
    capped = trial.extra["capped_forward_seconds"]
    per_sample_forward = (trial.forward_seconds - capped) / trial.samples
    statistics_samples = n
    if trial.extra["capped_tokens"]:
        seq_len = setup.calib.input_ids.shape[1]
        batches = max(setup.error_batches, math.ceil(trial.extra["capped_tokens"] / (setup.batch_size * seq_len)))
        statistics_samples = min(n, batches * setup.batch_size)
    fixed = trial.materialize_seconds + trial.apply_seconds + trial.pack_seconds
    capped_per_sample = capped / trial.samples
    layer_seconds = [r * (fixed + per_sample_forward * n + capped_per_sample * statistics_samples) for r in ratios]
    capture_seconds = trial.capture_seconds * n / trial.samples
    source_bytes = setup.handle.index.total_bytes()
    finish_seconds = (source_bytes + output_bytes) / _sha256_rate()
    wall = setup_seconds + capture_seconds + sum(layer_seconds) + finish_seconds

    trial_acts = trial.samples * setup.calib.input_ids.shape[1] * _hidden(setup) * trial.activation_element_bytes
    full_acts = n * setup.calib.input_ids.shape[1] * _hidden(setup) * trial.activation_element_bytes
    compute_size = torch.empty((), dtype=compute.layer_dtype).element_size()
    disk_size = torch.empty((), dtype=setup.weight_dtype).element_size()
    bigger_layer = (max(sizes) - sizes[0]) * compute_size / disk_size
    # One generation resident (each batch's output replaces its input), plus the unquantised reference outputs
    # of the error-measuring batches beyond those the trial held.
    batch_acts = setup.batch_size * setup.calib.input_ids.shape[1] * _hidden(setup) * trial.activation_element_bytes
    trial_batches = math.ceil(trial.samples / setup.batch_size)
    references = (setup.error_batches - min(setup.error_batches, trial_batches)) * batch_acts
    paused = trial.extra["paused_bytes_per_sample"] * (n - trial.samples)
    if recipe.calibration.schedule == "auto" and paused > 0:
        import psutil

        from quantkit.pipeline.engine import ONE_PASS_MEMORY_SHARE

        if trial.extra["paused_bytes_per_sample"] * n > ONE_PASS_MEMORY_SHARE * psutil.virtual_memory().available:
            paused = 0  # the full run falls back to two-pass, as the trial could not (its few samples fit)
    layer_peak = trial.rss_peak + bigger_layer + (0 if spill else full_acts - trial_acts) + references + paused
    peak = max(opts.startup_peak, setup_peak, layer_peak)
    return {
        "output": str(output),
        "model": setup.resolved.label,
        "method": "+".join(m.name for m in setup.methods),
        "scheme": setup.scheme.name,
        "layers": n_layers,
        "samples": n,
        "seq_len": int(setup.calib.input_ids.shape[1]),
        "batch_size": setup.batch_size,
        "compute_dtype": compute.name + (" (bf16 autocast)" if compute.autocast else ""),
        "device": device,
        "activations": placement,  # where the run keeps the calibration activations: device, host or disk
        "output_bytes": output_bytes,
        "shard_bytes": shard_bytes,
        "source_bytes": source_bytes,
        "resume_state_bytes": 0 if spill else generation,
        "spill_bytes": 2 * generation if spill else 0,
        "disk": disk,
        "peak_rss_bytes": int(peak),
        "wall_seconds": round(wall, 2),
        "breakdown": {
            "setup_seconds": round(setup_seconds, 3),
            "capture_seconds": round(capture_seconds, 3),
            "layers_seconds": round(sum(layer_seconds), 3),
            "finish_seconds": round(finish_seconds, 3),
            "per_layer_fixed_seconds": round(fixed, 4),
            "per_sample_forward_seconds": round(per_sample_forward, 5),
            "per_sample_capped_statistics_seconds": round(capped_per_sample, 5),
            "statistics_samples": statistics_samples,
        },
        "trial": {"layer": 0, "samples": trial.samples, "capture_seconds": round(trial.capture_seconds, 4),
                  "materialize_seconds": round(trial.materialize_seconds, 4),
                  "forward_seconds": round(trial.forward_seconds, 4), "apply_seconds": round(trial.apply_seconds, 4),
                  "pack_seconds": round(trial.pack_seconds, 4), "rss_before_bytes": trial.rss_before,
                  "rss_peak_bytes": trial.rss_peak, **trial.extra},
        "tp_warnings": setup.tp_warnings,
        **({"precision": {k: v for k, v in setup.precision.items() if k != "linears"}} if setup.precision else {}),
        "plan_seconds": round(time.perf_counter() - t0, 2),
    }


def _hidden(setup) -> int:
    cfg = setup.handle.config
    return getattr(cfg, "hidden_size", None) or cfg.get_text_config().hidden_size


def _plan_stream(opts: PlanOptions, scheme, t0: float) -> dict:
    """The data-free FP8 path: no calibration; layer 0's linears are quantised for the timing."""
    from quantkit.formats.safetensors_writer import PlannedShardWriter
    from quantkit.pipeline.stream import _quantize_one, prepare_stream

    output = Path(opts.output)
    if output.exists() and not opts.overwrite:
        raise InputError(f"output {output} already exists; pass --overwrite to replace it")
    setup = prepare_stream(opts.recipe, scheme, opts.tp)
    setup_seconds = time.perf_counter() - t0
    layout = PlannedShardWriter(output, setup.specs, opts.max_shard_bytes or 5 * 10**9, create=False)
    index_text = layout.index_text()
    shard_bytes = sum(layout.sizes.values()) + (len(index_text.encode()) if index_text else 0)
    extras = _extras_bytes(setup.handle, setup.plans, scheme, opts.recipe, output, None)
    output_bytes = shard_bytes + extras
    disk = check_disk_space(output, output_bytes, resume=False)
    hwm = HighWaterMark()
    began = time.perf_counter()
    # As the run does it: the same worker threads (each thread's allocator arenas are part of the run's memory).
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=STREAM_THREADS) as pool:
        for fut in [pool.submit(_quantize_one, setup.handle, t, setup.weight_dtype) for t in setup.plans[0].targets]:
            fut.result()
    first = time.perf_counter() - began
    sizes = _layer_bytes(setup.handle, len(setup.plans))
    layer_seconds = sum(first * b / sizes[0] for b in sizes) if sizes[0] else first * len(sizes)
    source_bytes = setup.handle.index.total_bytes()
    # Two worker threads quantise while the main one writes: the measured single-thread time is an upper bound
    # of the layer work, and output writing rides along.
    finish_seconds = (source_bytes + output_bytes) / _sha256_rate()
    wall = setup_seconds + layer_seconds + finish_seconds
    return {
        "output": str(output), "model": setup.resolved.label, "method": "fp8", "scheme": scheme.name,
        "layers": len(setup.plans), "samples": 0, "seq_len": 0, "batch_size": 0, "compute_dtype": "float32",
        "output_bytes": output_bytes, "shard_bytes": shard_bytes, "source_bytes": source_bytes,
        "resume_state_bytes": 0, "spill_bytes": 0, "disk": disk,
        "peak_rss_bytes": int(max(opts.startup_peak, hwm.peak())),
        "wall_seconds": round(wall, 2),
        "breakdown": {"setup_seconds": round(setup_seconds, 3), "capture_seconds": 0.0,
                      "layers_seconds": round(layer_seconds, 3), "finish_seconds": round(finish_seconds, 3),
                      "per_layer_fixed_seconds": round(first, 4), "per_sample_forward_seconds": 0.0},
        "trial": {"layer": 0, "samples": 0, "quantize_seconds": round(first, 4)},
        "tp_warnings": setup.tp_warnings,
        "plan_seconds": round(time.perf_counter() - t0, 2),
    }
