"""Run one llm-compressor recipe as the reference side of quantkit's benchmarks.

Run with the interpreter of benchmarks/.venv-llmc (see setup_llmcompressor.sh).
Prints one JSON object (tool, version, recipe, wall time, peak RSS) on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

# llm-compressor logs to stdout, from import time on. Point fd 1 at stderr before the
# imports below, and keep a copy of the real stdout for the single JSON result line.
RESULT_STREAM = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

import psutil  # noqa: E402
import torch  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationScheme,
    QuantizationStrategy,
    preset_name_to_scheme,
)
from datasets import Dataset  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import llmcompressor  # noqa: E402
from llmcompressor import oneshot  # noqa: E402
from llmcompressor.modifiers.gptq import GPTQModifier  # noqa: E402
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402
from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier  # noqa: E402

RECIPES = ("rtn", "gptq", "awq", "smoothquant_gptq_w8a8", "fp8_block", "fp8_dynamic")
IGNORE = ["lm_head"]


def weight_scheme(preset: str, group_size: int) -> dict[str, QuantizationScheme]:
    """A preset with its weight group size replaced, as llm-compressor config_groups.

    The presets fix group_size=128 and a preset name cannot carry another one. Rather
    than re-spell the whole scheme by hand (and risk drifting from the preset's other
    fields), expand the preset and override only the weights' group_size.
    """
    scheme = preset_name_to_scheme(preset, targets=["Linear"])
    # Integer groups only: fp4's group sizes are the format (MXFP4 is groups of 32 by definition).
    if scheme.weights is not None and scheme.weights.strategy == QuantizationStrategy.GROUP \
            and scheme.weights.type == "int":
        fields = scheme.weights.model_dump()
        fields["group_size"] = group_size
        scheme.weights = QuantizationArgs(**fields)
    return {"group_0": scheme}


def build_recipe(name: str, grouped: dict[str, QuantizationScheme]) -> list[Any]:
    if name == "rtn":
        return [QuantizationModifier(config_groups=grouped, ignore=IGNORE)]
    if name == "gptq":
        return [GPTQModifier(config_groups=grouped, ignore=IGNORE)]
    if name == "awq":
        # In 0.14 AWQ only rescales; the quantisation itself is a separate modifier
        # whose scheme the AWQ grid search reads.
        return [AWQModifier(), QuantizationModifier(config_groups=grouped, ignore=IGNORE)]
    if name == "smoothquant_gptq_w8a8":
        return [
            SmoothQuantModifier(smoothing_strength=0.8),
            GPTQModifier(scheme="W8A8", targets=["Linear"], ignore=IGNORE),
        ]
    if name == "fp8_block":
        return [QuantizationModifier(scheme="FP8_BLOCK", targets=["Linear"], ignore=IGNORE)]
    if name == "fp8_dynamic":
        return [QuantizationModifier(scheme="FP8_DYNAMIC", targets=["Linear"], ignore=IGNORE)]
    raise ValueError(f"unknown recipe {name}")


def disable_pinning_without_accelerator() -> None:
    """AWQ pins its cached activations before the grid search
    (llmcompressor/modifiers/transform/awq/base.py, _apply_smoothing, calling
    IntermediatesCache.pin_memory in llmcompressor/pipelines/cache.py). Pinned memory
    only speeds host-to-device copies, and torch raises "Cannot access accelerator
    device" when there is no device, so on a CPU-only host the call is made a no-op.
    """
    if torch.accelerator.is_available():
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None  # type: ignore[method-assign]
    print(
        "llmc_runner: no accelerator, patched IntermediatesCache.pin_memory to a no-op "
        "(llm-compressor AWQ pins memory unconditionally)",
        file=sys.stderr,
    )


def calibration_dataset(tokens_path: Path) -> tuple[Dataset, int, int]:
    ids = load_file(str(tokens_path))["input_ids"]
    if ids.dtype != torch.int64 or ids.dim() != 2:
        raise ValueError(f"{tokens_path}: expected int64 input_ids [N, L], got {ids.dtype} {list(ids.shape)}")
    n, length = ids.shape
    # A dataset that already has input_ids is used as-is by llm-compressor (no re-tokenising).
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    return data, n, length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="HF model folder")
    parser.add_argument("--tokens", type=Path, required=True, help="safetensors with int64 input_ids [N, L]")
    parser.add_argument("--recipe", choices=RECIPES, required=True)
    parser.add_argument("--scheme", default="W4A16", help="preset for rtn/gptq/awq; the other recipes fix their own")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    if args.recipe == "awq":
        disable_pinning_without_accelerator()
    grouped = weight_scheme(args.scheme, args.group_size)
    recipe = build_recipe(args.recipe, grouped)
    weights = grouped["group_0"].weights if args.recipe in ("rtn", "gptq", "awq") else None
    # rtn and the fp8 schemes are data-free (fp8 activations are dynamic), so passing
    # data would only add calibration passes the reference tool would not normally run.
    data_free = args.recipe in ("rtn", "fp8_block", "fp8_dynamic")

    # Interpreter + imports (torch, datasets, ...) already hold this much before any work.
    rss_before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    dtype = AutoConfig.from_pretrained(args.model).dtype or "auto"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    dataset_kwargs: dict[str, Any] = {}
    if not data_free:
        data, n, length = calibration_dataset(args.tokens)
        dataset_kwargs = dict(
            dataset=data,
            num_calibration_samples=n,
            max_seq_length=length,
            # Keep the file's order so both tools see the blocks identically.
            shuffle_calibration_samples=False,
        )
    oneshot(
        model=model,
        tokenizer=str(args.model),  # only so the tokenizer files are saved with the checkpoint
        recipe=recipe,
        output_dir=str(args.output),
        save_compressed=True,
        **dataset_kwargs,
    )
    wall_s = time.perf_counter() - start

    # ru_maxrss is KiB on Linux. psutil has no peak RSS on Linux, so it only gives the
    # RSS at the end, and /proc's VmHWM serves as an independent check of the peak.
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {
        "tool": "llm-compressor",
        "version": llmcompressor.__version__,
        "recipe": args.recipe,
        "scheme": args.scheme if weights is not None else None,
        "group_size": weights.group_size if weights is not None else None,
        "wall_s": round(wall_s, 3),
        "peak_rss_bytes": peak_rss,
        "peak_rss_bytes_vmhwm": _vmhwm_bytes(),
        "rss_bytes_before_load_psutil": rss_before,
        "rss_bytes_at_end_psutil": psutil.Process().memory_info().rss,
        "torch": torch.__version__,
        "output": str(args.output.resolve()),
    }
    line = json.dumps(result)
    print(line, file=RESULT_STREAM, flush=True)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(line + "\n")


def _vmhwm_bytes() -> int | None:
    try:
        for row in Path("/proc/self/status").read_text().splitlines():
            if row.startswith("VmHWM:"):
                return int(row.split()[1]) * 1024
    except OSError:
        pass
    return None


if __name__ == "__main__":
    main()
