"""The `quantkit` command: parse, call, print. Errors are one line on stderr with a non-zero exit."""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from quantkit.errors import InputError, QuantkitError
from quantkit.progress import OutputConsole, progress_enabled


class _Conventions:
    """Help in the command-line's usual shape, whatever typer's version renders by default: pure flags take no
    value, so they show no metavar (newer typer prints `<bool>`, which reads as `--resume yes`); positionals read
    as UPPERCASE names."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False):
                param.metavar = ""
            elif getattr(param, "param_type_name", "") == "argument" and param.name:
                param.metavar = param.name.upper() + ("..." if param.nargs != 1 else "")
        return params


class _Command(_Conventions, typer.core.TyperCommand):
    def collect_usage_pieces(self, ctx):
        # `quantkit eval [OPTIONS] CHECKPOINTS...`: the positionals by name, optional ones in brackets
        args = [p for p in self.get_params(ctx) if getattr(p, "param_type_name", "") == "argument"]
        return ["[OPTIONS]"] + [p.metavar if p.required else f"[{p.metavar}]" for p in args]


class _Group(_Conventions, typer.core.TyperGroup):
    pass


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Compress LLMs: layer-streaming quantisation to compressed-tensors, MLA conversion, evaluation.",
)
console = OutputConsole()
err_console = Console(stderr=True)


def _version_callback(value: bool) -> None:
    if value:
        import quantkit

        console.print(f"quantkit {quantkit.__version__}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Compress LLMs: layer-streaming quantisation to compressed-tensors, MLA conversion, evaluation."""


def _fail(message: str, code: int) -> None:
    from rich.markup import escape

    # Messages carry user text and pip extras ('quantkit-llm[eval]'): never let rich read them as markup.
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _guarded(debug: bool, fn, *args, **kwargs):
    """Run a command body: user errors become one line and an exit code; --debug shows tracebacks."""
    try:
        return fn(*args, **kwargs)
    except typer.Exit:
        raise
    except QuantkitError as exc:
        if debug:
            traceback.print_exc()
        from quantkit.distributed import is_worker, leave_worker

        if isinstance(exc, InputError) and is_worker():
            leave_worker(exc.exit_code)  # every rank refuses the same input: rank 0 says it once
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except MemoryError:
        _fail("out of memory; try --offload-dir, fewer --num-samples or a shorter --seq-len", 1)
    except OSError as exc:
        if debug:
            traceback.print_exc()
        if exc.errno == 28:
            _fail(f"disk full: {exc.filename or ''}".strip(), 1)
        _fail(f"{exc.strerror or exc}: {exc.filename or ''}".strip(), 1)
    except Exception as exc:  # anything unexpected still gets one line unless --debug
        if debug:
            traceback.print_exc()
        first = str(exc).splitlines()[0] if str(exc) else ""
        _fail(f"unexpected {type(exc).__name__}: {first} (rerun with --debug for the traceback)", 1)


def _compute_line(compute: dict) -> str:
    speeds = ", ".join(f"{k} {v:.1f}" for k, v in (compute.get("gflops") or {}).items())
    return (f"compute dtype {compute['dtype']}{' (bf16 autocast)' if compute.get('autocast') else ''}: "
            f"{compute['reason']}{' ' + speeds + ' GFLOP/s' if speeds else ''} on {compute.get('cpu', '?')}")


def _compute_choice(value: str) -> str:
    from quantkit.compute import CHOICES

    if value not in CHOICES:
        raise QuantkitError(f"unknown --compute-dtype {value!r}; valid: {', '.join(CHOICES)}")
    return value


def _print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


@app.command(cls=_Command)
def quantize(
    model: Optional[str] = typer.Option(None, "--model", help="HF folder, .gguf file or hub id (default: embedded SmolLM2-135M)."),
    method: Optional[str] = typer.Option(None, "--method", help="rtn, gptq, awq, smoothquant (= smoothquant+rtn), fp8 (data-free with FP8_DYNAMIC/FP8_BLOCK); compose with +, e.g. smoothquant+gptq, awq+gptq (default: the recipe's, else rtn)."),
    scheme: Optional[str] = typer.Option(None, "--scheme", help="W4A16, W4A16_ASYM, W8A16, W8A8, W8A8_STATIC, FP8, FP8_DYNAMIC, FP8_BLOCK, W4AFP8, NVFP4A16, NVFP4, MXFP4A16, MXFP4 (default: the recipe's, else W4A16)."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Weights per scale (default 128); -1 = per output channel."),
    ignore: Optional[list[str]] = typer.Option(None, "--ignore", help="Module name or re:pattern to leave unquantised (repeatable)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="kjv (built in), a .txt/.jsonl/.json/.parquet/.csv file, or an HF dataset."),
    text_column: Optional[str] = typer.Option(None, "--text-column", help="Column holding the text (auto-detected)."),
    num_samples: Optional[int] = typer.Option(None, "--num-samples", help="Calibration samples (default 128)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sample (default 512)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed (default 42)."),
    expert_tokens: Optional[str] = typer.Option(None, "--expert-tokens", help="MoE experts' calibration statistics: all (default; every expert also sees the tokens not routed to it) or routed (its own tokens only; an expert routed fewer than calibration.min_expert_tokens is quantised by RTN). The manifest lists the starved experts either way."),
    schedule: Optional[str] = typer.Option(None, "--schedule", help="auto (default: one-pass where its held activations fit in a quarter of free memory, else two-pass), one-pass (a layer's linears calibrate group by group in call order inside one forward) or two-pass (statistics from an unquantised pass, then a quantised pass)."),
    actorder: Optional[str] = typer.Option(None, "--actorder", help="GPTQ column order: static (default), group (writes g_idx) or none."),
    dampening: Optional[float] = typer.Option(None, "--dampening", help="GPTQ dampening relative to mean diag(H) (default 0.1)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Output folder (written atomically)."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="YAML recipe; flags override its fields."),
    resume: bool = typer.Option(False, "--resume", help="Continue a killed run from its journal."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output folder."),
    offload_dir: Optional[Path] = typer.Option(None, "--offload-dir", help="Spill calibration activations to this folder."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    compute_dtype: str = typer.Option("auto", "--compute-dtype", help="Calibration matmul dtype: auto (the faster of bf16 and fp32 on this machine, measured once), bfloat16 or float32."),
    strict: bool = typer.Option(False, "--strict", help="Refuse layers that cannot take the scheme instead of falling back."),
    kv_cache: Optional[str] = typer.Option(None, "--kv-cache", help="Also calibrate an fp8 KV cache: fp8 (one key and one value scale per layer) or fp8-head (per KV head); written as kv_cache_scheme with k_scale / v_scale, as vLLM loads them."),
    schemes: Optional[str] = typer.Option(None, "--schemes", help="Mixed precision: the schemes a linear may take, comma-separated NAME[:gSIZE|:ch] (e.g. W4A16:g128,W4A16:g64,W8A16:ch); each linear gets one, chosen by its estimated KL under --target-bits or --max-kl (plan in precision_plan.json)."),
    target_bits: Optional[float] = typer.Option(None, "--target-bits", help="Mixed precision: the bits per quantised weight (scales included) not to exceed; the plan with the least estimated KL within it."),
    max_kl: Optional[float] = typer.Option(None, "--max-kl", help="Mixed precision: the estimated output KL (nats per token) not to exceed; the smallest plan within it."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel size you will serve with: warn about linears vLLM could not split."),
    alpha: Optional[float] = typer.Option(None, "--alpha", help="SmoothQuant migration strength in [0, 1] (default 0.8)."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Allow model code from the checkpoint (off by default)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (peak memory, disk, estimated wall time from timing layer 0) and exit; same as `quantkit plan`."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Quantise a causal LM layer by layer and write a compressed-tensors checkpoint."""

    def body():
        from quantkit.pipeline.engine import quantize_model
        from quantkit.recipe import Recipe

        rec = Recipe.load(recipe) if recipe else Recipe()
        rec.override("model", source=model, trust_remote_code=trust_remote_code or None)
        rec.override("quantization", method=method, scheme=scheme, group_size=group_size, ignore=ignore or None,
                     strict=strict or None, kv_cache=kv_cache)
        gptq_flags = {k: v for k, v in (("actorder", actorder), ("dampening", dampening)) if v is not None}
        if gptq_flags:
            rec.quantization.options = {**rec.quantization.options,
                                        "gptq": {**rec.quantization.options.get("gptq", {}), **gptq_flags}}
        if alpha is not None:
            rec.quantization.options = {**rec.quantization.options,
                                        "smoothquant": {**rec.quantization.options.get("smoothquant", {}), "alpha": alpha}}
        if tp is not None and tp < 1:
            raise QuantkitError(f"--tp must be at least 1, got {tp}")
        if schemes is not None or target_bits is not None or max_kl is not None:
            from quantkit.recipe import MixedSpec

            before = rec.quantization.mixed
            given = [x.strip() for x in schemes.split(",") if x.strip()] if schemes is not None else None
            budget = {"target_bits": target_bits, "max_kl": None} if target_bits is not None else (
                {"target_bits": None, "max_kl": max_kl} if max_kl is not None else {})
            if target_bits is not None and max_kl is not None:
                raise QuantkitError("give one budget: --target-bits or --max-kl, not both")
            fields_ = dataclasses.asdict(before) if before else {}  # the recipe's other mixed fields stay
            fields_.update(budget)
            if given is not None:
                fields_["schemes"] = given
            rec.quantization.mixed = MixedSpec(**fields_)
        rec.override("calibration", dataset=dataset, num_samples=num_samples, seq_len=seq_len, seed=seed,
                     text_column=text_column, schedule=schedule, expert_tokens=expert_tokens)
        out = output or (Path(rec.output) if rec.output else None)
        if out is None:
            raise QuantkitError("--output is required (or an `output:` field in the recipe)")
        from quantkit.distributed import is_worker
        from quantkit.pipeline.options import ineffective_options

        given = {"--group-size": group_size, "--dataset": dataset, "--num-samples": num_samples, "--seq-len": seq_len,
                 "--text-column": text_column, "--actorder": actorder, "--dampening": dampening, "--alpha": alpha}
        warnings = [] if is_worker() else ineffective_options(rec, given)

        def warn() -> None:
            for warning in warnings:
                err_console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)

        # At the start where someone watches; otherwise after the run, so a refused input stays one line.
        if progress_enabled():
            warn()
        if dry_run:
            from quantkit.pipeline.plan import PlanOptions, plan_run

            report = plan_run(PlanOptions(rec, out, offload_dir=offload_dir, device=device,
                                          compute_dtype=_compute_choice(compute_dtype), tp=tp, overwrite=overwrite,
                                          resume=resume))
            if as_json:
                _print_json(report)
            else:
                _print_plan(report)
            if not progress_enabled():
                warn()
            return
        summary = quantize_model(rec, out, resume=resume, overwrite=overwrite, offload_dir=offload_dir, device=device,
                                 tp=tp, compute_dtype=_compute_choice(compute_dtype))
        if summary.get("rank"):  # a data-parallel worker (torchrun): rank 0 reports for the run
            from quantkit.distributed import leave_worker

            leave_worker(0)
        if not progress_enabled():
            warn()
        if as_json:
            _print_json(summary)
        else:
            console.print(
                f"[green]wrote[/] {summary['output']}  {summary['scheme']} via {summary['method']}  "
                f"{summary['bits_per_weight']} bits/weight  weights {summary['weights_bytes'] / 1e6:.1f} MB "
                f"(from {summary['original_bytes'] / 1e6:.1f} MB; folder {summary['output_bytes'] / 1e6:.1f} MB)  {summary['wall_seconds']:.1f} s  "
                f"peak RSS {summary['peak_rss_bytes'] / 1e6:.0f} MB"
            )
            if summary.get("compute") and not progress_enabled():
                console.print(_compute_line(summary["compute"]), highlight=False)
            errs = [layer["rel_error"] for layer in summary["layers"] if layer.get("rel_error") is not None]
            if errs:
                console.print(f"per-layer relative output error: mean {sum(errs) / len(errs):.4f}, max {max(errs):.4f}")
            mixed = summary.get("precision")
            if mixed:
                console.print(_precision_line(mixed) + f" (per linear: {summary['output']}/precision_plan.json)",
                              highlight=False)
            for name, modules in ({} if mixed else summary.get("scheme_overrides", {})).items():
                console.print(f"[yellow]note:[/] {len(modules)} linears use {name} instead (input size not a "
                              f"multiple of the block): {', '.join(modules[:4])}{' ...' if len(modules) > 4 else ''}")
            for event in summary["events"]:
                console.print(f"[yellow]warning:[/] layer {event['layer']} {event['module']}: {event['event']}")
            shards = summary.get("tp_warnings") or []
            if shards:
                console.print(f"[yellow]warning:[/] vLLM would refuse {len(shards)} linears at tp={shards[0]['tp']}: "
                              + "; ".join(f"{w['module']} ({w['problem']})" for w in shards[:4])
                              + (" ..." if len(shards) > 4 else "") + " (all listed in the manifest)")

    _guarded(debug, body)


def _plan_command(**kwargs) -> None:
    """Estimate a run's peak memory, output size and wall time before it starts; exit 2 when the disk is too small.

    The wall time comes from timing layer 0 on a few samples. Takes every `quantize` option."""
    quantize(**kwargs, dry_run=True)


def _as_plan_signature(fn) -> None:
    # `plan` takes exactly quantize's options (one definition, so the two can never drift apart).
    import inspect as pyinspect
    from typing import get_type_hints

    sig = pyinspect.signature(quantize, eval_str=True)
    fn.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "dry_run"])
    fn.__annotations__ = {k: v for k, v in get_type_hints(quantize).items() if k != "dry_run"}


_as_plan_signature(_plan_command)
app.command("plan", cls=_Command)(_plan_command)


def _print_plan(report: dict) -> None:
    from quantkit.pipeline.plan import fmt_bytes

    b = report["breakdown"]
    table = Table(title=f"plan: {report['model']} -> {report['output']} ({report['scheme']} via {report['method']})")
    table.add_column("")
    table.add_column("estimate", justify="right")
    table.add_column("from", justify="left")
    table.add_row("peak memory (RSS)", fmt_bytes(report["peak_rss_bytes"]),
                  f"layer 0 on {report['trial']['samples']} samples, activations scaled to {report['samples']}")
    table.add_row("output on disk", fmt_bytes(report["output_bytes"]), "planned tensors + config/tokenizer/recipe (exact)")
    if report["resume_state_bytes"]:
        table.add_row("resume state", fmt_bytes(report["resume_state_bytes"]), "one generation of activations")
    if report["spill_bytes"]:
        table.add_row("spilled activations", fmt_bytes(report["spill_bytes"]), "two generations under --offload-dir")
    for where, d in report["disk"].items():
        table.add_row(f"disk at {where}", f"{fmt_bytes(d['needed_bytes'])} of {fmt_bytes(d['free_bytes'])} free", "")
    table.add_row("wall time", f"{report['wall_seconds']:.0f} s",
                  f"setup {b['setup_seconds']:.1f} + capture {b['capture_seconds']:.1f} + {report['layers']} layers "
                  f"{b['layers_seconds']:.1f} + hashing {b['finish_seconds']:.1f}")
    console.print(table)
    console.print(f"per layer: {b['per_layer_fixed_seconds']:.3f} s fixed + {b['per_sample_forward_seconds']:.4f} s "
                  f"per sample x {report['samples']} samples; compute {report['compute_dtype']}", highlight=False)
    if report.get("precision"):
        console.print(_precision_line(report["precision"]), highlight=False)
    for w in report.get("tp_warnings") or []:
        console.print(f"[yellow]warning:[/] tp={w['tp']}: {w['module']} ({w['problem']})", highlight=False)


def _precision_line(p: dict) -> str:
    return (f"mixed precision: {p['bits_per_weight']} bits/weight planned, estimated KL {p['estimated_kl']:.4g}; "
            + ", ".join(f"{label} {v['linears']} linears" for label, v in p["schemes"].items()))


@app.command(cls=_Command)
def inspect(
    checkpoint: Path = typer.Argument(..., help="A quantkit output folder."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Show a checkpoint's scheme, size and per-layer errors; verify its manifest hashes (exit 1 on mismatch)."""

    def body():
        from quantkit.inspect import inspect_checkpoint

        report = inspect_checkpoint(checkpoint)
        if as_json:
            _print_json(report)
        else:
            _print_inspect(report)
        if report["hash_mismatches"]:
            if not as_json:
                err_console.print(f"[bold red]error:[/] manifest mismatch: {', '.join(report['hash_mismatches'])}")
            raise typer.Exit(1)

    _guarded(debug, body)


def _print_inspect(report: dict) -> None:
    console.print(f"[bold]{report['path']}[/]")
    console.print(
        f"scheme {report['scheme']}  format {report['format']}  method {report.get('method') or '?'}  "
        f"{report['bits_per_weight']} bits/weight (quantised linears)  "
        f"weights {report['size_bytes'] / 1e6:.1f} MB vs original {report['original_bytes'] / 1e6:.1f} MB "
        f"({report['size_ratio']:.3f}x; folder {report['folder_bytes'] / 1e6:.1f} MB)"
    )
    table = Table(title="per layer")
    for col in ("layer", "quantised linears", "rel. output error", "seconds"):
        table.add_column(col, justify="right")
    for row in report["layers"]:
        table.add_row(str(row["layer"]), str(row["linears"]), f"{row['rel_error']:.5f}" if row["rel_error"] is not None else "-",
                      f"{row['seconds']:.2f}" if row["seconds"] is not None else "-")
    console.print(table)
    status = "[green]all files match the manifest[/]" if not report["hash_mismatches"] else "[red]MISMATCH[/]"
    console.print(status)


@app.command("convert-mla", cls=_Command)
def convert_mla(
    model: Optional[str] = typer.Option(None, "--model", help="Llama/Mistral/Qwen2 HF folder, .gguf or hub id (default: embedded SmolLM2-135M)."),
    kv_lora_rank: Optional[str] = typer.Option(None, "--kv-lora-rank", help="Latent size per token and layer, or 'full' (exact maximum). Default: n_kv*head_dim/2, raised to the nearest size vLLM serves (latent + rope dim 320, 512 or 576) where one fits."),
    rope_dim: Optional[int] = typer.Option(None, "--rope-dim", help="Dims of the shared RoPE key (even, <= head_dim; default head_dim/2)."),
    dataset: str = typer.Option("kjv", "--dataset", help="Calibration text: kjv (built in) or a local .txt/.jsonl/.json/.parquet/.csv file."),
    num_samples: int = typer.Option(32, "--num-samples", help="Calibration samples."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per calibration sample."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Output folder (written atomically)."),
    sweep: Optional[str] = typer.Option(None, "--sweep", help="Comma-separated ranks: convert at each (into OUTPUT/rank-R) and plot KV size vs KL."),
    eval_samples: int = typer.Option(8, "--eval-samples", help="Held-out KJV samples for KL/perplexity (0 = skip)."),
    compute_dtype: str = typer.Option("auto", "--compute-dtype", help="Dtype of the source layers' forward passes: auto (the faster of bf16 and fp32 here, measured once), bfloat16 or float32; statistics and refinement keep their own precision."),
    refine_steps: int = typer.Option(100, "--refine-steps", help="Per-layer Adam steps (at most: it stops when the held-out error does) fitting the MLA attention output to the source's on the calibration tokens (0 = closed form only)."),
    refine_batch: int = typer.Option(2, "--refine-batch", help="Calibration sequences per refinement step (SmolLM2 with --refine-queries 128: 2 sequences ~3 min, held-out KL 0.039; 4: ~5 min, KL 0.036)."),
    refine_queries: int = typer.Option(128, "--refine-queries", help="Positions of each sequence a refinement step's loss reads, chosen at random (the keys of every position computed): 0 = every position."),
    refine_lr: Optional[float] = typer.Option(None, "--refine-lr", help="Refinement step size relative to each tensor's RMS (default: the measured one, see README)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output folder."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Convert a GQA/MHA model to Multi-head Latent Attention (DeepSeek-V3 layout, loads without custom code)."""

    def parse_rank(text):
        if text is None:
            return None
        if text.strip().lower() in ("full", "max"):
            return -1
        try:
            value = int(text)
        except ValueError:
            raise QuantkitError(f"--kv-lora-rank must be an integer or 'full'; got {text!r}") from None
        if value < 1:
            raise QuantkitError(f"--kv-lora-rank must be at least 1; got {value}")
        return value

    def body():
        from quantkit.convert.mla import MLAOptions, run_convert

        if output is None:
            raise QuantkitError("--output is required")
        if sweep:
            from quantkit.optional import require

            require("matplotlib", "convert-mla --sweep")  # its plot; checked before hours of conversion
        ranks = [parse_rank(r) for r in sweep.split(",") if r.strip()] if sweep else [parse_rank(kv_lora_rank)]
        if refine_steps < 0:
            raise QuantkitError(f"--refine-steps must be 0 or more; got {refine_steps}")
        if refine_batch < 1:
            raise QuantkitError(f"--refine-batch must be 1 or more; got {refine_batch}")
        if refine_queries < 0:
            raise QuantkitError(f"--refine-queries must be 0 (every position) or more; got {refine_queries}")
        if refine_lr is not None and not 0 < refine_lr < 1:
            raise QuantkitError(f"--refine-lr must be between 0 and 1; got {refine_lr}")
        lr = {} if refine_lr is None else {"refine_lr": refine_lr}
        report = run_convert(model, output, ranks, rope_dim, dataset, num_samples, seq_len, eval_samples,
                             overwrite, sweep=bool(sweep),
                             opts=MLAOptions(refine_steps=refine_steps, refine_batch=refine_batch,
                                             refine_queries=refine_queries,
                                             compute_dtype=_compute_choice(compute_dtype), **lr))
        if as_json:
            _print_json(report)
        else:
            _print_mla(report)
        for warning in report.get("warnings", []):
            err_console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)

    _guarded(debug, body)


def _print_mla(report: dict) -> None:
    table = Table(title=f"MLA conversion of {report['model']}")
    for col in ("output", "kv_lora_rank", "rope dim", "cached/token/layer", "KV bytes/token bf16", "fp8",
                "KL", "ppl (base)", "top-1"):
        table.add_column(col, justify="right")
    for run in report["runs"]:
        kv, ev = run["kv_cache"], run.get("eval") or {}
        table.add_row(
            run["output"], str(run["dims"]["kv_lora_rank"]), str(run["dims"]["rope_dim"]),
            f"{kv['values_per_token_per_layer']['before']} -> {kv['values_per_token_per_layer']['after']}",
            f"{kv['bytes_per_token_bf16']['before']} -> {kv['bytes_per_token_bf16']['after']}",
            f"{kv['bytes_per_token_fp8']['before']} -> {kv['bytes_per_token_fp8']['after']}",
            f"{ev['kl']:.4f}" if ev else "-",
            f"{ev['ppl']:.2f} ({ev['ppl_base']:.2f})" if ev else "-",
            f"{ev['top1_agreement']:.3f}" if ev else "-",
        )
    console.print(table)
    if report.get("plot"):
        console.print(f"plot: {report['plot']}")


@app.command("eval", cls=_Command)
def eval_cmd(
    checkpoints: list[Path] = typer.Argument(..., help="Checkpoint folders (compressed-tensors or plain HF)."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="Reference model (default: the model the checkpoint was made from)."),
    dataset: str = typer.Option("kjv", "--dataset", help="kjv (held-out split) or a .txt/.jsonl/.json/.parquet/.csv file."),
    text_column: Optional[str] = typer.Option(None, "--text-column", help="Column holding the text (auto-detected)."),
    num_samples: int = typer.Option(32, "--num-samples", help="Token blocks to score."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per block."),
    tasks: Optional[list[str]] = typer.Option(None, "--tasks", help="Multiple-choice JSONL file(s) or built-in set names ('builtin'); repeatable or comma-separated."),
    lm_eval: Optional[str] = typer.Option(None, "--lm-eval", help="lm-evaluation-harness tasks (comma-separated; needs lm-eval)."),
    throughput: bool = typer.Option(False, "--throughput", help="Measure prefill/decode tokens/s, time to first token, peak memory."),
    speculative: Optional[str] = typer.Option(None, "--speculative", help="Draft for speculative decoding: a checkpoint folder (same tokenizer), eagle:DIR or medusa:DIR (fitted by quantkit draft-heads), self:W4A8, self:W4A4 (QSPEC), self:skip:N (the first N decoder layers) or ngram."),
    draft_tokens: int = typer.Option(4, "--draft-tokens", help="Draft tokens per step (chain length; tree depth)."),
    draft_vocab: int = typer.Option(0, "--draft-vocab", help="A model draft scores only the N most frequent tokens of --dataset's calibration text (0 = the whole vocabulary; verification always uses all of it)."),
    tree: str = typer.Option("chain", "--tree", help="chain, static:WIDTHxDEPTH, dynamic:NODES[@FLOOR] (EAGLE-2; FLOOR: least confidence drafted) or opt:NODES (OPT-Tree)."),
    prompts: str = typer.Option("builtin", "--prompts", help="Prompts for --speculative: builtin (32 held-out KJV + 32 chat) or a .jsonl/.txt file."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Tokens generated per prompt (speculative decoding)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples (lossless rejection sampling)."),
    speculative_grid: bool = typer.Option(False, "--speculative-grid", help="Every checkpoint as draft of every other."),
    save_outputs: Optional[Path] = typer.Option(None, "--save-outputs", help="Write one JSON line per prompt (prompt_index, tokens)."),
    report: Optional[Path] = typer.Option(None, "--report", help="Write report.json, report.md and PNG plots to this folder."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    max_kl: Optional[float] = typer.Option(None, "--max-kl", help="Gate: fail (exit 3) if mean KL exceeds this."),
    max_ppl_increase: Optional[float] = typer.Option(None, "--max-ppl-increase", help="Gate: fail if perplexity rises by more than this percentage."),
    min_top1: Optional[float] = typer.Option(None, "--min-top1", help="Gate: fail if top-1 agreement (0..1) is below this."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    dtype: str = typer.Option("auto", "--compute-dtype", "--dtype", help="Compute dtype: auto (the checkpoint's, or fp32 where this machine runs it much faster), float32, bfloat16, float16."),
    kernels: str = typer.Option("auto", "--kernels", help="auto (the fastest kernel for each format and device), reference (the exact torch reference everywhere) or cuda-emulated (a slow developer check: the CUDA kernels of csrc/ on the CPU emulator, behind the same dispatch as on a GPU)."),
    batch_size: int = typer.Option(4, "--batch-size", help="Blocks per forward pass."),
    seed: int = typer.Option(42, "--seed", help="Sampling seed of the token blocks."),
    attribution: bool = typer.Option(False, "--attribution", help="Each decoder layer's share of the KL: every layer swapped back to the baseline's, one at a time (one extra pass over the eval blocks per layer); a table and a plot with --report."),
    kv_cache: bool = typer.Option(True, "--kv-cache/--no-kv-cache", help="Simulate a checkpoint's fp8 KV cache (its kv_cache_scheme) as vLLM serves it; --no-kv-cache keeps keys and values 16-bit, to measure what the cache costs."),
    moe: bool = typer.Option(False, "--moe", help="MoE routing analysis: load per expert, routing drift against the baseline, capacity-aware inference, bias balancing, expert offloading."),
    moe_samples: int = typer.Option(8, "--moe-samples", help="Token blocks (the first of the eval set) for the --moe drift, capacity, bias and offload runs."),
    offload_cache: Optional[list[int]] = typer.Option(None, "--offload-cache", help="With --moe: experts per layer kept resident in the offload runs (repeatable; k..E). Default: E/2."),
    offload_reads: Optional[list[str]] = typer.Option(None, "--offload-reads", help="With --moe: where the offload runs read experts from (repeatable): page-cache (the checkpoint in memory; the default) or storage (every read dropped from the page cache after it, as for a checkpoint larger than memory; Linux)."),
    offload_scratch: Optional[Path] = typer.Option(None, "--offload-scratch", help="With --moe: the folder where the offload runs keep quantised experts' prepared kernel tensors (about the quantised experts' size; default: the temporary folder)."),
    engine: str = typer.Option("quantkit", "--engine", help="quantkit (its own runtime) or vllm (score and time the checkpoints in vLLM; needs vLLM)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", help="With --engine vllm: vLLM's tensor-parallel size."),
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python", help="With --engine vllm: the Python that has vLLM (default $QUANTKIT_VLLM_PYTHON, else this one)."),
    top_logprobs: int = typer.Option(20, "--top-logprobs", help="With --engine vllm: log-probabilities per position for the KL (top-k)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Evaluate checkpoints against a baseline: perplexity, KL divergence, top-1, delta-p, tasks, throughput, gates."""

    def body():
        from quantkit.eval.report import print_table, write_report
        from quantkit.eval.runner import EvalOptions, run_eval
        from quantkit.eval.speculative import SpecOptions
        from quantkit.optional import require

        # Optional packages are checked before any model work, so a missing one costs a second, not a run.
        if report is not None:
            require("matplotlib", "eval --report")
        if lm_eval:
            require("lm_eval", "eval --lm-eval")

        opts = EvalOptions(
            checkpoints=list(checkpoints), baseline=baseline, dataset=dataset, num_samples=num_samples,
            seq_len=seq_len, seed=seed, text_column=text_column, tasks=list(tasks or []), lm_eval_tasks=lm_eval,
            throughput=throughput, device=device, dtype=dtype, batch_size=batch_size, max_kl=max_kl,
            max_ppl_increase=max_ppl_increase, min_top1=min_top1, kernels=kernels, kv_cache=kv_cache, moe=moe, engine=engine,
            attribution=attribution,
            tensor_parallel_size=tensor_parallel_size, vllm_python=vllm_python, top_logprobs=top_logprobs,
            speculative=SpecOptions(draft=speculative, draft_tokens=draft_tokens, tree=tree, prompts=prompts,
                                    max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                    grid=speculative_grid, save_outputs=save_outputs, draft_vocab=draft_vocab),
        )
        given = [flag for flag, v in (("--offload-cache", offload_cache), ("--offload-reads", offload_reads),
                                      ("--offload-scratch", offload_scratch)) if v]
        if given and not moe:
            raise QuantkitError(f"{given[0]} needs --moe")
        if moe:
            from quantkit.eval.moe import MoEEvalOptions

            opts.moe_options = MoEEvalOptions(samples=moe_samples, offload_cache=tuple(offload_cache or ()),
                                              offload_reads=tuple(offload_reads or ("page-cache",)),
                                              offload_scratch=None if offload_scratch is None else str(offload_scratch))
        run = run_eval(opts)
        if report is not None:
            files = write_report(report, run.report, run.token_kl)
            if not as_json:
                console.print(f"[green]wrote[/] {', '.join(str(report / f) for f in files)}")
        if as_json:
            _print_json(run.report)
        else:
            print_table(console, run.report)
        failed = [g for g in run.report["gates"] if not g["passed"]]
        for g in failed:
            err_console.print(
                f"[bold red]gate failed:[/] {g['checkpoint']}: {g['metric']} {g['value']} "
                f"{'<' if g['gate'] == 'min_top1' else '>'} {g['threshold']} ({g['gate']})", highlight=False, soft_wrap=True)
        if failed:
            raise typer.Exit(3)

    _guarded(debug, body)


@app.command("draft-heads", cls=_Command)
def draft_heads_cmd(
    checkpoint: Path = typer.Argument(..., help="The target: the checkpoint that will be served (quantised or not)."),
    kind: str = typer.Option("eagle", "--kind", help="eagle (one decoder layer drafting in the target's feature space) or medusa (residual heads on the target's last feature)."),
    heads: int = typer.Option(4, "--heads", help="Medusa heads (head k predicts the token k+1 ahead)."),
    dataset: str = typer.Option("kjv:0.5,self:0.5", "--dataset", help="Fit text: kjv (built in), self (written by the target itself, in quantkit's runtime), a mixture of them (the default) or a local .txt/.jsonl/.json/.parquet/.csv file."),
    num_samples: int = typer.Option(80, "--num-samples", help="Token blocks (one eighth held out for the loss shown)."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per block."),
    steps: int = typer.Option(400, "--steps", help="Optimiser steps (4 blocks each)."),
    draft_vocab: int = typer.Option(8192, "--draft-vocab", help="The drafter scores only the N tokens the target most often predicts on the fit text (0 = the whole vocabulary; verification always uses all of it)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the text sample and the fit."),
    compute_dtype: str = typer.Option("auto", "--compute-dtype", help="Dtype of the target's forward: auto, bfloat16 or float32."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Output folder (written atomically)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output folder."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Fit a drafter (EAGLE or Medusa) to a target checkpoint by distillation, for eval --speculative eagle:DIR."""

    def body():
        from quantkit.drafters import DraftHeadsOptions, run_draft_heads

        if output is None:
            raise QuantkitError("--output is required")
        report = run_draft_heads(DraftHeadsOptions(
            checkpoint=checkpoint, output=output, kind=kind, heads=heads, dataset=dataset, num_samples=num_samples,
            seq_len=seq_len, steps=steps, draft_vocab=draft_vocab, seed=seed,
            compute_dtype=_compute_choice(compute_dtype), overwrite=overwrite))
        if as_json:
            _print_json(report)
            return
        table = Table(title=f"{report['kind']} drafter for {report['checkpoint']}")
        for col in ("", "held-out loss", "top-1 agreement per depth"):
            table.add_column(col, justify="right")
        for name in ("untrained", "trained"):
            row = report[name]
            table.add_row(name, f"{row['heldout_loss']:.3f}", " ".join(f"{a:.3f}" for a in row["top1_agreement"]))
        console.print(table)
        console.print(f"{report['parameters']:,} parameters, draft vocabulary {report['draft_vocab'] or 'all'}, "
                      f"{report['seconds']['total']:.0f} s; wrote {report['output']}", highlight=False)

    _guarded(debug, body)


@app.command("moefy", cls=_Command)
def moefy_cmd(
    experts: int = typer.Option(..., "--experts", help="Routed experts per layer (the dense MLP's neurons split among them)."),
    top_k: int = typer.Option(..., "--top-k", help="Experts each token is routed to."),
    output: Path = typer.Option(..., "--output", "-o", help="Output folder (written atomically)."),
    model: Optional[str] = typer.Option(None, "--model", help="Dense HF folder or .gguf (default: embedded SmolLM2-135M)."),
    shared_experts: int = typer.Option(0, "--shared-experts", help="Always-on experts of the routed experts' size."),
    layout: Optional[str] = typer.Option(None, "--layout", help="qwen2_moe, qwen3_moe or deepseek_v3 (default: qwen3_moe, qwen2_moe with shared experts)."),
    router_fit: str = typer.Option("lstsq", "--router-fit", help="How the router is fitted to the clustering: lstsq or centroid."),
    num_samples: int = typer.Option(16, "--num-samples", help="Calibration samples for the clustering and the router fit."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per calibration sample."),
    eval_samples: int = typer.Option(8, "--eval-samples", help="Held-out KJV blocks for the KL report (0: skip)."),
    local_steps: int = typer.Option(100, "--local-steps", help="Distillation: steps of each layer's fit to its dense MLP (0 with --distill-steps 0: the exact low-temperature split)."),
    distill_steps: int = typer.Option(100, "--distill-steps", help="Distillation: end-to-end steps on KL(dense || MoE) of the next-token distributions."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output folder."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Make a real-weight MoE from a dense model (MoEfication, then distillation), e.g. to test MoE quantisation.

    With --local-steps 0 --distill-steps 0 the split is exact: the dense model at top-k = E."""

    def body():
        from quantkit.convert.moe_distill import DistillOptions
        from quantkit.convert.moefy import MoEfyOptions, evaluate_moe, moefy_model

        distill = (DistillOptions(local_steps=local_steps, steps=distill_steps)
                   if local_steps or distill_steps else None)
        opts = MoEfyOptions(experts=experts, top_k=top_k, shared_experts=shared_experts,
                            layout=layout or ("qwen2_moe" if shared_experts else "qwen3_moe"), router_fit=router_fit,
                            distill=distill)
        summary = moefy_model(model, output, opts, num_samples=num_samples, seq_len=seq_len, overwrite=overwrite)
        if eval_samples > 0:
            ks = sorted({1, max(1, top_k // 2), top_k, min(experts, 2 * top_k), experts})
            summary["eval"] = evaluate_moe(model, output, ks, num_samples=eval_samples)
        summary.pop("layers")
        if as_json:
            _print_json(summary)
            return
        console.print(f"[green]wrote[/] {output}: {experts} experts, top-{top_k}, layout {opts.layout}", highlight=False)
        for kind, fit in summary["router_fit_mean"].items():
            console.print(f"router fit {kind}: oracle overlap {fit['oracle_overlap']}, mass captured "
                          f"{fit['mass_captured']}", highlight=False)
        for name, run in (summary.get("eval") or {}).get("runs", {}).items():
            console.print(f"held-out KL(dense || MoE) routing {name}: {run['kl']:.4f}, top-1 agreement "
                          f"{run['top1_agree']:.3f}", highlight=False)
        overlap = (summary.get("eval") or {}).get("routing_overlap_bf16_fp32")
        if overlap is not None:
            console.print(f"routing top-k overlap, bf16 run against fp32 run: {overlap:.4f}", highlight=False)

    _guarded(debug, body)


@app.command("check-serving", cls=_Command)
def check_serving_cmd(
    checkpoint: Path = typer.Argument(..., help="A checkpoint folder (compressed-tensors or plain HF)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size vLLM will serve with."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel size."),
    gpu: str = typer.Option("sm_90", "--gpu", help="Target compute capability: sm_80, sm_86, sm_89, sm_90, ... or cpu (vLLM's CPU build)."),
    vllm_version: Optional[str] = typer.Option(None, "--vllm-version", help="vLLM version to check format features against (default: the version the kernel facts were read from)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Activation dtype vLLM serves in (bfloat16, float16; default: the checkpoint's)."),
    load: bool = typer.Option(False, "--load", help="After the rules, load the checkpoint in vLLM (the build --vllm-python runs; with a CPU build, check with --gpu cpu) and score 16 tokens: does vLLM agree with the rules? On by default where this Python imports vllm."),
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python", help="With --load: the Python that has vLLM (default $QUANTKIT_VLLM_PYTHON, else this one)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Will vLLM load this checkpoint (tp/pp split, GPU kernels, version features)? Exit 0 yes, 3 no."""

    def body():
        import importlib.util

        from quantkit.serving.check import ServingTarget, check_serving, load_in_vllm

        report = check_serving(checkpoint, ServingTarget(tp, pp, gpu, vllm_version, dtype))
        if load or vllm_python or importlib.util.find_spec("vllm") is not None:
            report["vllm_load"] = load_in_vllm(checkpoint, report, vllm_python)
            report["compatible"] = report["compatible"] and report["vllm_load"]["loaded"]
        if as_json:
            _print_json(report)
        else:
            _print_serving(report)
        if not report["compatible"]:
            raise typer.Exit(3)

    _guarded(debug, body)


def _print_serving(report: dict) -> None:
    t = report["target"]
    where = "vLLM CPU build" if t["platform"] == "cpu" else f"sm_{t['compute_capability']}"
    verdict = "[green]will load[/]" if report["compatible"] else "[bold red]will NOT load[/]"
    console.print(f"[bold]{report['checkpoint']}[/] on {where}, tp={t['tp']} pp={t['pp']}, vLLM {t['vllm_version']}, "
                  f"{t['dtype']}: {verdict} ({report['linears_checked']} linears checked)")
    if report["kernels"]:
        table = Table(title="kernels vLLM will pick")
        for col in ("kernel", "linears", "N per rank", "K per rank"):
            table.add_column(col, justify="right" if col != "kernel" else "left")
        for row in report["kernels"]:
            table.add_row(row["kernel"], str(row["linears"]), str(row["n_part"]), str(row["k_part"]))
        console.print(table)
    if report["problems"]:
        groups = report["problem_groups"]
        console.print(f"{len(report['problems'])} problem(s), {len(groups)} distinct:", highlight=False)
        for g in groups:
            console.print(f"- {g['reason']}\n  on {g['count']} tensor(s): {', '.join(g['tensors'])}", highlight=False,
                          soft_wrap=True)
        if report["fixes"]:
            console.print("would load after: " + "; or ".join(report["fixes"]), highlight=False, soft_wrap=True)
        else:
            console.print("no serving option or re-quantisation of the same tensors that quantkit checks would load it",
                          highlight=False)
    for w in report["warnings"]:
        console.print(f"[yellow]warning:[/] {w['tensor']}: {w['reason']}", highlight=False)
    if "vllm_load" in report:
        v = report["vllm_load"]
        said = "loaded and scored" if v["loaded"] else f"refused it: {v['error']}"
        console.print(f"vLLM {v.get('vllm_version') or ''} on this machine {said}; the rules "
                      f"{'agree' if v['agrees_with_rules'] else 'DISAGREE'}", highlight=False, soft_wrap=True)
    console.print(f"[dim]kernel facts: {report['facts']['source']}[/]", highlight=False)


@app.command(cls=_Command)
def release(
    recipe: Path = typer.Argument(..., help="Release recipe YAML (base model, variants, calibration, evaluation, gates); a built-in name works too."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Release folder (default: the recipe's `output`, else release-NAME)."),
    verify_determinism: bool = typer.Option(False, "--verify-determinism", help="Build each variant (or the recipe's determinism_variants) a second time and compare every tensor file's sha256."),
    force: bool = typer.Option(False, "--force", help="Rebuild variants even when their manifest says they are up to date."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    compute_dtype: str = typer.Option("auto", "--compute-dtype", help="Calibration matmul dtype: auto, bfloat16 or float32."),
    as_json: bool = typer.Option(False, "--json", help="Print release.json on stdout."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Quantise and evaluate every variant of a release recipe, gate them and write cards; exit 3 when a gate fails.

    The variants are evaluated against the base in one pass; each checkpoint gets a model card, the release
    release.md and release.json."""

    def body():
        from quantkit.release import ReleaseOptions, failed_gates, run_release

        summary = run_release(ReleaseOptions(recipe, output, verify_determinism, device,
                                             _compute_choice(compute_dtype), force))
        if as_json:
            _print_json(summary)
        else:
            _print_release(summary)
        failures = failed_gates(summary)
        for line in failures:
            err_console.print(f"[bold red]gate failed:[/] {escape_markup(line)}", highlight=False, soft_wrap=True)
        if failures:
            raise typer.Exit(3)

    _guarded(debug, body)


def escape_markup(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _print_release(summary: dict) -> None:
    table = Table(title=f"release {summary['name']} -> {summary['output']} (base ppl {summary['base']['ppl']})")
    for col in ("variant", "scheme", "method", "KL mean", "ppl", "size MB", "built", "gates", "passed"):
        table.add_column(col, justify="left" if col in ("variant", "scheme", "method", "gates") else "right")
    for v in summary["variants"]:
        gates = ", ".join(f"{g['gate']} {'ok' if g['passed'] else 'FAIL'}" for g in v["gates"]) or "-"
        table.add_row(v["name"], v["scheme"], v["method"], str(v["kl_mean"]), str(v["ppl"]),
                      f"{v['size_bytes'] / 1e6:.1f}", "yes" if v["built"] else "kept", gates,
                      "[green]yes[/]" if v["passed"] else "[red]no[/]")
    console.print(table)
    for d in summary.get("determinism") or []:
        console.print(f"determinism ({d['variant']} built twice): "
                      + ("[green]identical tensor files[/]" if d["identical"] else f"[red]differ: {d['mismatched']}[/]"))
    console.print(f"wrote {summary['output']}/release.md, release.json and a README.md model card in each variant")


def main() -> None:  # pragma: no cover - console entry point (tested through subprocesses)
    """The `quantkit` command and `python -m quantkit`: the command, then `_leave` with its exit code."""
    code: object = 0
    try:
        app()
    except SystemExit as exc:
        code = exc.code
    _leave(code)


def _leave(code: object) -> None:
    """Exit with `code` without the interpreter's teardown. Freeing torch's and transformers' objects one by one
    took 1.1-1.3 s after every command (measured after a SmolLM2 quantize: 0.2 s of it the final gc, the rest module
    teardown), 10% of `make demo`. The exit handlers (temporary folders, logging) still run and the standard streams
    are flushed first; every file quantkit writes is closed before its command returns."""
    import atexit
    import os

    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): the message, then 1
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
