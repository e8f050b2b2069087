"""`quantkit eval`: quality (perplexity, KL, top-1 agreement, delta-p), tasks, throughput and gates for
one or more checkpoints against one baseline, all on quantkit's own runtime."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit.errors import InputError, QuantkitError
from quantkit.eval.baseline import BaselineCache
from quantkit.eval.speculative import SpecOptions
from quantkit.eval.metrics import TOKEN_FIELDS, nll_only, perplexity, summarize, token_stats
from quantkit.formats.manifest import MANIFEST, package_versions, quantized_weight_stats, read_manifest, verify_manifest
from quantkit.compute import ComputeChoice, choose_compute_dtype, matmul_shapes
from quantkit.progress import announce, progress_bar
from quantkit.runtime.dispatch import KERNEL_MODES
from quantkit.runtime.model import RuntimeModel, check_model_folder, load_model, read_config, resolve_dtype


@dataclass
class EvalOptions:
    checkpoints: list[Path]
    baseline: str | None = None
    dataset: str = "kjv"
    num_samples: int = 32
    seq_len: int = 512
    seed: int = 42
    text_column: str | None = None
    tasks: list[str] = field(default_factory=list)
    lm_eval_tasks: str | None = None
    throughput: bool = False
    device: str = "auto"
    dtype: str = "auto"
    batch_size: int = 4
    max_kl: float | None = None
    max_ppl_increase: float | None = None
    min_top1: float | None = None
    cache_dir: Path | None = None
    speculative: SpecOptions = field(default_factory=SpecOptions)
    kernels: str = "auto"  # auto | reference | cuda-emulated (runtime/dispatch.py)
    kv_cache: bool = True  # simulate a checkpoint's fp8 KV cache (False: keys and values in the compute dtype)
    attribution: bool = False  # each decoder layer's share of the KL (quantkit/eval/attribution.py)
    moe: bool = False  # routing analysis (quantkit/eval/moe.py)
    moe_options: object | None = None  # MoEEvalOptions; None = the defaults
    engine: str = "quantkit"  # quantkit (its own runtime) | vllm (quantkit/eval/vllm_engine.py)
    tensor_parallel_size: int = 1  # --engine vllm
    vllm_python: str | None = None  # --engine vllm: the interpreter that has vLLM
    top_logprobs: int = 20  # --engine vllm: log-probabilities per position the KL is computed from


@dataclass
class EvalRun:
    report: dict
    token_kl: dict[str, torch.Tensor]  # checkpoint label -> per-token KL (for plots)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda given but no CUDA device is available")
    if device not in ("cpu", "cuda"):
        raise InputError(f"unknown device {device!r}: use auto, cpu or cuda")
    return torch.device(device)


def check_checkpoint(path: Path) -> Path:
    path = check_model_folder(path, "checkpoint")
    if (path / MANIFEST).is_file():
        bad = verify_manifest(path)
        if bad:
            raise QuantkitError(f"checkpoint {path} fails its manifest hashes: {', '.join(bad)}", exit_code=1)
    return path


def baseline_source(baseline: str | None, checkpoint: Path):
    """The baseline to evaluate against: the one given, else the model the checkpoint was made from (its
    manifest: read from where it was, named as the user named it, not by the cache folder it was converted
    into), else the embedded default."""
    from quantkit.models.source import ResolvedModel, resolve_model

    if baseline:
        return resolve_model(baseline)
    if (checkpoint / MANIFEST).is_file():
        src = read_manifest(checkpoint).get("source", {})
        if src.get("path") and Path(src["path"]).is_dir():
            return ResolvedModel(Path(src["path"]), src.get("model") or src["path"])
    return resolve_model(None)


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception:
        return None


def check_compatible(base_path: Path, base_tok, ckpt: Path) -> None:
    base_vocab = read_config(base_path).get("vocab_size")
    ckpt_vocab = read_config(ckpt).get("vocab_size")
    if base_vocab != ckpt_vocab:
        raise InputError(f"baseline {base_path} has vocabulary size {base_vocab} but {ckpt} has {ckpt_vocab}")
    tok = _tokenizer(ckpt)
    if tok is not None and base_tok is not None and tok.get_vocab() != base_tok.get_vocab():
        raise InputError(f"baseline {base_path} has a different tokenizer than {ckpt}; evaluate against the model it was made from")


def _batches(ids: torch.Tensor, batch_size: int):
    for s in range(0, ids.shape[0], batch_size):
        yield s, ids[s : s + batch_size]


@torch.inference_mode()
def _logits(rt: RuntimeModel, batch: torch.Tensor) -> torch.Tensor:
    return rt(input_ids=batch.to(rt.device), use_cache=False).logits.cpu()


def size_figures(folder: Path, dtype: torch.dtype) -> dict:
    size = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
    stats = quantized_weight_stats(folder)
    bits = stats["bits_per_weight"]
    if bits is None:  # unquantised: every linear weight costs its dtype
        bits = float(torch.finfo(dtype).bits)
    return {"size_bytes": size, "bits_per_weight": bits, "model_bits_per_param": stats["model_bits_per_param"]}


def _round(obj):
    """6 significant digits: the JSON and the Markdown print the very same numbers."""
    if isinstance(obj, float):
        return obj if not math.isfinite(obj) or obj == 0 else float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: _round(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_round(v) for v in obj]
    return obj


def evaluate_gates(results: list[dict], opts: EvalOptions) -> list[dict]:
    gates = []
    for r in results:
        checks = [("max_kl", "kl_mean", opts.max_kl, lambda v, t: v <= t),
                  ("max_ppl_increase", "ppl_increase_pct", opts.max_ppl_increase, lambda v, t: v <= t),
                  ("min_top1", "top1_agree", opts.min_top1, lambda v, t: v >= t)]
        for gate, key, threshold, ok in checks:
            if threshold is None:
                continue
            value = r[key]
            gates.append({"checkpoint": r["checkpoint"], "gate": gate, "metric": key, "threshold": threshold,
                          "value": value, "passed": bool(ok(value, threshold))})
    return gates


def validate_options(opts: EvalOptions) -> None:
    if not opts.checkpoints:
        raise InputError("give at least one checkpoint folder")
    if opts.num_samples < 1:
        raise InputError(f"--num-samples must be >= 1, got {opts.num_samples}")
    if opts.seq_len < 2:
        raise InputError(f"--seq-len must be >= 2, got {opts.seq_len}")
    if opts.min_top1 is not None and not 0 <= opts.min_top1 <= 1:
        raise InputError("--min-top1 is a fraction between 0 and 1")
    if opts.max_kl is not None and opts.max_kl < 0:
        raise InputError("--max-kl must be >= 0")
    if opts.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise InputError(f"unknown --compute-dtype {opts.dtype!r}: use auto, float32, bfloat16 or float16")
    if opts.kernels not in KERNEL_MODES:
        raise InputError(f"unknown --kernels {opts.kernels!r}: use {', '.join(KERNEL_MODES[:-1])} or {KERNEL_MODES[-1]}")


def compute_for(path: Path, requested: str, device: torch.device, kernels: str = "auto") -> ComputeChoice:
    """The dtype a model is evaluated in: `requested`, or under auto the checkpoint's own dtype unless this
    machine multiplies a narrower one much faster in fp32 (bf16 on AVX2-only CPUs). An fp32 checkpoint is
    never narrowed by auto: evaluation measures the model as it is. The emulated CUDA device computes as a GPU
    would: in the checkpoint's dtype."""
    model_dtype = resolve_dtype(path, None)
    if kernels == "cuda-emulated":
        device = torch.device("cuda")  # what the choice is made for; the tensors stay on the CPU
    return choose_compute_dtype(requested, model_dtype, device, matmul_shapes(read_config(path)), narrower=False)


def resolve_baseline(baseline: str | None, checkpoints: list[Path]):
    """(source, folder, tokenizer) of the baseline, every checkpoint checked to share its tokenizer."""
    base_src = baseline_source(baseline, checkpoints[0])
    base_path = check_model_folder(base_src.path, "baseline")
    base_tok = _tokenizer(base_path)
    if base_tok is None:
        raise InputError(f"baseline {base_path} has no tokenizer that transformers can load")
    for ckpt in checkpoints:
        check_compatible(base_path, base_tok, ckpt)
    return base_src, base_path, base_tok


def run_eval(opts: EvalOptions) -> EvalRun:
    from quantkit.data.calibration import build_token_blocks

    if opts.engine == "vllm":
        from quantkit.eval.vllm_engine import run_vllm_eval

        return run_vllm_eval(opts)
    if opts.engine != "quantkit":
        raise InputError(f"unknown --engine {opts.engine!r}: use quantkit or vllm")
    if opts.tensor_parallel_size != 1:
        raise InputError("--tensor-parallel-size needs --engine vllm (quantkit's runtime runs on one device)")
    validate_options(opts)
    device = resolve_device(opts.device)
    checkpoints = [check_checkpoint(Path(c)) for c in opts.checkpoints]
    # Tasks are read before any model work so a malformed file fails in a second, not after the baseline.
    from quantkit.eval.tasks import evaluate_task, resolve_tasks

    tasks = resolve_tasks(opts.tasks) if opts.tasks else {}
    spec = opts.speculative
    if spec.enabled or spec.save_outputs:
        from quantkit.eval import speculative as spec_eval

        spec_eval.validate(spec)
        if spec.grid and len(checkpoints) < 2:
            raise InputError("--speculative-grid needs at least two checkpoints (each drafts for every other)")
    moe_opts = None
    if opts.moe:
        from quantkit.eval.moe import MoEEvalOptions, check_moe_checkpoints, moe_spec_of

        check_moe_checkpoints(checkpoints)  # a dense checkpoint is refused before any model work
        moe_opts = opts.moe_options or MoEEvalOptions()
        for ckpt in checkpoints:
            mspec = moe_spec_of(ckpt)
            moe_opts.check(*((mspec.num_experts, mspec.top_k) if mspec else ()))
    base_src, base_path, base_tok = resolve_baseline(opts.baseline, checkpoints)
    prompts = None
    if spec.enabled or spec.save_outputs:
        prompts = spec_eval.load_prompts(spec.prompts, base_tok, spec.seed)
        spec_eval.check_context(prompts, spec, read_config_object(base_path))
    data = build_token_blocks(base_tok, opts.dataset, opts.num_samples, opts.seq_len, opts.seed, split="heldout",
                              text_column=opts.text_column)
    draft_vocab = None
    if spec.draft and spec.draft_vocab:
        draft_vocab = spec_eval.frequent_tokens(base_tok, opts.dataset, spec.draft_vocab, opts.seed, opts.text_column)
    ids = data.input_ids
    n_blocks, seq_len = ids.shape
    started = time.perf_counter()

    with progress_bar() as progress:
        base_compute = compute_for(base_path, opts.dtype, device, opts.kernels)
        announce(base_compute.describe())
        dtype = base_compute.dtype
        cache = BaselineCache(base_path, data.fingerprint, dtype, opts.cache_dir)
        base_cached = cache.complete
        needs_model = not base_cached or bool(tasks) or bool(opts.lm_eval_tasks) or opts.throughput
        base = load_model(base_path, dtype, device, kernels=opts.kernels) if needs_model else None
        if not base_cached:
            task = progress.add_task("baseline", total=n_blocks, info=base_src.label)

            def blocks(model):
                for s, batch in _batches(ids, opts.batch_size):
                    logits = _logits(model, batch)
                    for j in range(batch.shape[0]):
                        yield s + j, logits[j]
                    progress.advance(task, batch.shape[0])

            cache.write(n_blocks, (seq_len, base.vocab_size), dtype, blocks(base))
        nll_base = torch.cat([nll_only(cache.read(i)[:-1], ids[i, 1:]) for i in range(n_blocks)])
        baseline = {"model": base_src.label, "path": str(base_path), "ppl": perplexity(nll_base),
                    "dtype": str(dtype).replace("torch.", ""), "compute": base_compute.to_dict(),
                    "cached": base_cached, "cache_key": cache.key,
                    **size_figures(base_path, dtype)}
        if base is not None:
            baseline["resident_weight_bytes"] = base.resident_weight_bytes
            baseline.update(_extras(base, base_tok, tasks, opts, device, evaluate_task))
        del base

        results, token_kl, outputs = [], {}, []
        for ckpt in checkpoints:
            compute = compute_for(ckpt, opts.dtype, device, opts.kernels)
            rt = load_model(ckpt, compute.dtype, device, kernels=opts.kernels, kv_cache=opts.kv_cache)
            if rt.vocab_size != cache.read(0).shape[-1]:
                raise InputError(f"{ckpt} produces {rt.vocab_size} logits per token, the baseline {cache.read(0).shape[-1]}")
            task = progress.add_task("evaluate", total=n_blocks, info=ckpt.name)
            parts: dict[str, list] = {k: [] for k in TOKEN_FIELDS}
            recorder = None
            if moe_opts is not None:
                from quantkit.eval.moe import RoutingRecorder, check_moe_blocks
                from quantkit.runtime.moe import moe_blocks

                check_moe_blocks(rt, moe_opts)
                recorder = RoutingRecorder(moe_blocks(rt.model)[0].spec.num_experts)
                handles = [b.add_router_observer(recorder) for b in moe_blocks(rt.model)]
            for s, batch in _batches(ids, opts.batch_size):
                logits = _logits(rt, batch)
                for j in range(batch.shape[0]):
                    st = token_stats(cache.read(s + j)[:-1], logits[j, :-1], ids[s + j, 1:])
                    for k, v in st.items():
                        parts[k].append(v)
                progress.advance(task, batch.shape[0])
            stats = {k: torch.cat(v) for k, v in parts.items()}
            row = {"checkpoint": str(ckpt), **summarize(stats), **size_figures(ckpt, rt.dtype),
                   "resident_weight_bytes": rt.resident_weight_bytes, "formats": rt.formats, "kernels": rt.kernels,
                   "kernel_choice": rt.kernel_choice, "kv_cache": rt.kv_cache,
                   "compute": compute.to_dict()}
            row.update(_extras(rt, base_tok, tasks, opts, device, evaluate_task))
            if prompts is not None and not spec.grid:
                outputs.extend(_speculative_row(row, rt, str(ckpt), base_tok, prompts, spec, compute.dtype, device,
                                                progress, draft_vocab))
            if recorder is not None:
                from quantkit.eval.moe import analyze_moe

                for h in handles:
                    h.remove()
                row["moe"] = analyze_moe(rt, recorder, stats["kl"], ids, lambda i: cache.read(i), base_path,
                                         moe_opts, opts.batch_size, compute.dtype, device)
            if opts.attribution:
                row["attribution"] = _attribution(rt, base_path, ids, cache, opts, progress)
            results.append(row)
            token_kl[str(ckpt)] = stats["kl"].float()
            del rt

    grid = _speculative_grid(checkpoints, base_tok, prompts, spec, opts, device, progress) if spec.grid else None
    if spec.save_outputs:
        spec_eval.save_outputs(spec.save_outputs, outputs or (grid or {}).get("outputs", []))
    results = _round(results)
    report = {
        "results": results,
        "baseline": _round(baseline),
        "gates": evaluate_gates(results, opts),
        "data": {**data.describe(), "tokens_scored": n_blocks * (seq_len - 1)},
        "device": str(device),
        "versions": package_versions(),
        "wall_seconds": round(time.perf_counter() - started, 2),
    }
    if grid is not None:
        report["speculative_grid"] = _round(grid["rows"])
    return EvalRun(report, token_kl)


def read_config_object(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def _speculative_row(row: dict, rt: RuntimeModel, label: str, tokenizer, prompts, spec: SpecOptions, dtype, device,
                     progress, draft_vocab: torch.Tensor | None = None) -> list[dict]:
    """Plain decoding of the prompts (always: the reference and the speed baseline), then speculative decoding
    with --speculative when given; returns the outputs to save."""
    from quantkit.eval import speculative as spec_eval

    eos = tokenizer.eos_token_id
    task = progress.add_task("plain decode", total=1, info=Path(label).name)
    plain = spec_eval.plain_outputs(rt, prompts, spec, eos)
    progress.advance(task)
    if not spec.draft:
        return spec_eval.output_lines(label, plain["tokens"], speculative=False)
    draft = spec_eval.make_draft(spec.draft, rt, tokenizer, dtype, device, label)
    if draft_vocab is not None:
        draft.restrict_vocabulary(draft_vocab)
    task = progress.add_task("speculative", total=len(prompts), info=f"{Path(label).name} <- {spec.draft}")
    result = spec_eval.run_draft(rt, draft, prompts, spec, plain, eos, lambda: progress.advance(task))
    outs = result.pop("outputs")
    row["speculative"] = result
    return spec_eval.output_lines(label, outs, speculative=True)


def _speculative_grid(checkpoints, tokenizer, prompts, spec: SpecOptions, opts: EvalOptions, device, progress) -> dict:
    """Every checkpoint as the draft of every other: which quantisation drafts best for a target, and which target
    keeps the acceptance of a given draft."""
    from quantkit.eval import speculative as spec_eval
    from quantkit.runtime.speculative import ModelDraft

    eos = tokenizer.eos_token_id
    models = {str(c): load_model(c, compute_for(c, opts.dtype, device, opts.kernels).dtype, device, kernels=opts.kernels,
                                 kv_cache=opts.kv_cache)
              for c in checkpoints}
    rows, outputs = [], []
    for target, rt in models.items():
        plain = spec_eval.plain_outputs(rt, prompts, spec, eos)
        for name, other in models.items():
            if name == target:
                continue
            task = progress.add_task("speculative", total=len(prompts), info=f"{Path(target).name} <- {Path(name).name}")
            r = spec_eval.run_draft(rt, ModelDraft(other, name), prompts, spec, plain, eos,
                                    lambda: progress.advance(task))
            outputs += spec_eval.output_lines(target, r.pop("outputs"), speculative=True, draft=name)
            rows.append({"target": target, **r})
    return {"rows": rows, "outputs": outputs}


def _attribution(rt: RuntimeModel, base_path: Path, ids: torch.Tensor, cache, opts: EvalOptions, progress) -> dict:
    """Each decoder layer's share of the checkpoint's KL: the layer swapped for the baseline's, one at a time."""
    from quantkit.eval.attribution import layer_attribution
    from quantkit.runtime.model import _generic_adapter

    base = load_model(base_path, rt.dtype, rt.device, kernels=opts.kernels)
    layers_path = _generic_adapter(getattr(rt.config, "model_type", "?"), rt.model).layers_path

    def kl_of() -> float:
        total, n = 0.0, 0
        for s, batch in _batches(ids, opts.batch_size):
            logits = _logits(rt, batch)
            for j in range(batch.shape[0]):
                kl = token_stats(cache.read(s + j)[:-1], logits[j, :-1], ids[s + j, 1:])["kl"]
                total, n = total + float(kl.sum()), n + kl.numel()
        return total / n

    n_layers = getattr(rt.config, "num_hidden_layers", None)
    task = progress.add_task("attribution", total=n_layers, info=rt.path.name)
    return layer_attribution(rt.model, base.model, layers_path, kl_of, on_layer=lambda i: progress.advance(task))


def _extras(rt: RuntimeModel, tokenizer, tasks: dict, opts: EvalOptions, device, evaluate_task) -> dict:
    out: dict = {}
    if tasks:
        out["tasks"] = {name: evaluate_task(rt, tokenizer, items, device) for name, items in tasks.items()}
    if opts.lm_eval_tasks:
        from quantkit.eval.lm_eval_adapter import run_lm_eval

        out["lm_eval"] = run_lm_eval(rt, tokenizer, opts.lm_eval_tasks)
    if opts.throughput:
        from quantkit.eval.throughput import measure_throughput

        out["throughput"] = measure_throughput(rt, rt.vocab_size, device)
    return out
