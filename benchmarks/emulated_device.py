"""The CUDA kernels on real checkpoints without a GPU: each checkpoint served by `--kernels cuda-emulated` (csrc/cuda
on the CPU emulator, behind the real dispatch) against the torch reference path, on KJV text.

Per checkpoint: which kernels and ops dispatch picked, the entries launched, and for a prefill of `--tokens` tokens
plus `--decode` single-token steps (GEMV shapes, MLA decode): the largest logit difference relative to the largest
logit, and top-1 agreement of every position. A correctness check of the GPU code path, not a speed figure (the
emulator runs one thread per CUDA thread: a whole 30-layer SmolLM2 forward takes many minutes on 2 cores, so
`--layers N` keeps the first N decoder layers of the real weights, through a config override in a folder of links).

    python benchmarks/emulated_device.py CKPT [CKPT ...] --out benchmarks/results/emulated_device.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.runtime.cuda.emulator import emulator  # noqa: E402
from quantkit.runtime.model import load_model  # noqa: E402
from quantkit.runtime.step import KVCache, step  # noqa: E402


def kjv_ids(path: Path, n: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    from quantkit.data.calibration import build_token_blocks

    tok = AutoTokenizer.from_pretrained(path)
    return build_token_blocks(tok, "kjv", 1, n, 42, split="heldout").input_ids[:1]


def run(model, ids: torch.Tensor, decode: int) -> torch.Tensor:
    t = ids.shape[1] - decode
    cache = KVCache()
    with torch.inference_mode():
        rows = [step(model, ids[:, :t], torch.arange(t)[None], cache)[0]]
        for i in range(decode):
            rows.append(step(model, ids[:, t + i: t + i + 1], torch.tensor([[t + i]]), cache)[0])
    return torch.cat(rows).float()


def label(ckpt: Path) -> str:
    return ckpt.parent.name if ckpt.name == "ckpt" else ckpt.name


def truncated(ckpt: Path, layers: int, work: Path) -> Path:
    """`ckpt` with config.json saying `layers` decoder layers: every other file linked (the later layers' tensors
    are left unread)."""
    out = work / label(ckpt)
    out.mkdir()
    for f in ckpt.iterdir():
        if f.name not in ("config.json", "quantkit_manifest.json"):
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((ckpt / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoints", nargs="+", type=Path)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--decode", type=int, default=3)
    ap.add_argument("--layers", type=int, default=0, help="keep the first N decoder layers (0: all)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    load = os.getloadavg()
    head = (f"machine: {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores, load average "
            f"{load[0]:.2f} at start; torch {torch.__version__}")
    print(head, flush=True)
    if args.layers:
        head += f"; first {args.layers} decoder layers of each checkpoint"
    rows = []
    work = Path(tempfile.mkdtemp(prefix="emulated-device-"))
    for ckpt in args.checkpoints:
        ckpt = truncated(ckpt, args.layers, work) if args.layers else ckpt
        emu = emulator()
        t0 = time.time()
        ref = load_model(ckpt, torch.bfloat16, kernels="reference")
        ids = kjv_ids(ckpt, args.tokens + args.decode)
        want = run(ref, ids, args.decode)
        del ref
        model = load_model(ckpt, torch.bfloat16, kernels="cuda-emulated")
        emu.launched.clear()
        t1 = time.time()
        got = run(model, ids, args.decode)
        row = {"checkpoint": label(ckpt), "kernels": model.kernels, "launched": dict(emu.launched),
               "rel_max_logit_diff": float((got - want).abs().max() / want.abs().max()),
               "top1_agree": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
               "positions": int(got.shape[0]), "emulated_seconds": round(time.time() - t1, 1),
               "wall_seconds": round(time.time() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            write(args.out, head, rows, os.getloadavg())


def write(out: Path, head: str, rows: list, load) -> None:
    lines = ["# CUDA kernels on the CPU emulator, real checkpoints", "",
             "`python benchmarks/emulated_device.py ...`: each checkpoint served with `--kernels cuda-emulated` against",
             "the torch reference path (bf16), a KJV prefill then single-token decode steps.", "",
             f"{head}; load average {load[0]:.2f} at the end", "",
             "| checkpoint | kernels and ops picked | entries launched | positions | max logit diff / max logit | top-1 agree | emulated s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        kern = "; ".join(f"{kind}: " + ", ".join(f"{n} x{c}" for n, c in by.items()) for kind, by in r["kernels"].items())
        ran = ", ".join(f"{e} x{c}" for e, c in sorted(r["launched"].items()))
        lines.append(f"| {r['checkpoint']} | {kern} | {ran} | {r['positions']} | {r['rel_max_logit_diff']:.2e} | "
                     f"{r['top1_agree']:.3f} | {r['emulated_seconds']} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    (out.with_suffix(".json")).write_text(json.dumps({"machine": head, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
