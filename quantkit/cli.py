"""The `quantkit` command: parse, call, print. Errors are one line on stderr with a non-zero exit."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from quantkit.errors import QuantkitError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Compress LLMs: layer-streaming quantisation to compressed-tensors, MLA conversion, evaluation.",
)
console = Console()
err_console = Console(stderr=True)


def _fail(message: str, code: int) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
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


def _print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


@app.command()
def quantize(
    model: Optional[str] = typer.Option(None, "--model", help="HF folder, .gguf file or hub id (default: embedded SmolLM2-135M)."),
    method: Optional[str] = typer.Option(None, "--method", help="rtn (compose with +, e.g. smoothquant+gptq)."),
    scheme: Optional[str] = typer.Option(None, "--scheme", help="W4A16, W4A16_ASYM, W8A16."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Weights per scale (default 128); -1 = per output channel."),
    ignore: Optional[list[str]] = typer.Option(None, "--ignore", help="Module name or re:pattern to leave unquantised (repeatable)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="kjv (built in), a .txt/.jsonl/.json/.parquet/.csv file, or an HF dataset."),
    text_column: Optional[str] = typer.Option(None, "--text-column", help="Column holding the text (auto-detected)."),
    num_samples: Optional[int] = typer.Option(None, "--num-samples", help="Calibration samples (default 128)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sample (default 512)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed (default 42)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Output folder (written atomically)."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="YAML recipe; flags override its fields."),
    resume: bool = typer.Option(False, "--resume", help="Continue a killed run from its journal."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output folder."),
    offload_dir: Optional[Path] = typer.Option(None, "--offload-dir", help="Spill calibration activations to this folder."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Allow model code from the checkpoint (off by default)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Quantise a causal LM layer by layer and write a compressed-tensors checkpoint."""

    def body():
        from quantkit.pipeline.engine import quantize_model
        from quantkit.recipe import Recipe

        rec = Recipe.load(recipe) if recipe else Recipe()
        rec.override("model", source=model, trust_remote_code=trust_remote_code or None)
        rec.override("quantization", method=method, scheme=scheme, group_size=group_size, ignore=ignore or None)
        rec.override("calibration", dataset=dataset, num_samples=num_samples, seq_len=seq_len, seed=seed,
                     text_column=text_column)
        out = output or (Path(rec.output) if rec.output else None)
        if out is None:
            raise QuantkitError("--output is required (or an `output:` field in the recipe)")
        summary = quantize_model(rec, out, resume=resume, overwrite=overwrite, offload_dir=offload_dir, device=device)
        if as_json:
            _print_json(summary)
        else:
            console.print(
                f"[green]wrote[/] {summary['output']}  {summary['scheme']} via {summary['method']}  "
                f"{summary['bits_per_weight']} bits/weight  {summary['output_bytes'] / 1e6:.1f} MB "
                f"(from {summary['original_bytes'] / 1e6:.1f} MB)  {summary['wall_seconds']:.1f} s  "
                f"peak RSS {summary['peak_rss_bytes'] / 1e6:.0f} MB"
            )
            errs = [layer["rel_error"] for layer in summary["layers"]]
            if errs:
                console.print(f"per-layer relative output error: mean {sum(errs) / len(errs):.4f}, max {max(errs):.4f}")
            for event in summary["events"]:
                console.print(f"[yellow]warning:[/] layer {event['layer']} {event['module']}: {event['event']}")

    _guarded(debug, body)


@app.command()
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
        f"size {report['size_bytes'] / 1e6:.1f} MB vs original {report['original_bytes'] / 1e6:.1f} MB "
        f"({report['size_ratio']:.3f}x)"
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


@app.command("convert-mla")
def convert_mla(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Convert a GQA/MHA model to Multi-Head Latent Attention (not implemented yet)."""
    _fail("convert-mla is not implemented yet", 2)


@app.command("eval")
def eval_cmd(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Evaluate checkpoints: perplexity, KL divergence, tasks, throughput (not implemented yet)."""
    _fail("eval is not implemented yet", 2)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
