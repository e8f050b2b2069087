"""Every decoder family transformers knows, once: a tiny random model of each causal-LM model type transformers
registers (encoder, encoder-decoder, audio and image-generation types left out), built from its own config class
at the tests' tiny sizes, through `quantkit quantize` (GPTQ W4A16 g16, 8 x 64 KJV tokens), then loaded by
transformers and by quantkit's runtime.

    .venv/bin/python benchmarks/architecture_survey.py [--only FAMILY ...]

Where the config class refuses the tiny sizes, or transformers cannot run the unquantised model, that is reported
and the family skipped: neither is quantkit's verdict. Each family runs in a process of its own (a time and memory
limit each), and rows are appended to benchmarks/.work/survey/rows.jsonl as they come, so an interrupted survey
resumes. Results: benchmarks/results/architectures_survey.md and .json. `architecture_sweep.py` is the smaller,
hand-configured sweep that also runs AWQ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# Model types that are not decoder-only text models (encoders with an LM head, encoder-decoders, audio, image
# generation), or whose default config builds a multi-GB model before any override applies.
SKIP = ("bert", "bart", "roberta", "xlm", "electra", "marian", "pegasus", "prophetnet", "trocr", "whisper", "musicgen",
        "moshi", "git", "reformer", "rembert", "roformer", "xlnet", "xmod", "camembert", "data2vec", "megatron",
        "blenderbot", "mvp", "cpmant", "ctrl", "openai-gpt", "biogpt", "fuyu", "got_ocr2", "mllama", "emu3",
        "phi4_multimodal", "moss", "rwkv", "xlstm", "gpt-sw3", "blt", "big_bird", "bigbird", "ernie", "gemma3",
        "gemma4", "llama4", "qwen3_5", "qwen4_exp")
# Tiny overrides, applied where the family's config has the attribute.
TINY_MOE = dict(head_dim=16, num_experts=4, num_local_experts=4, num_experts_per_tok=2, n_routed_experts=4,
                moe_num_experts=4, moe_intermediate_size=32)
LIMIT_S, LIMIT_BYTES = 180, 8 * 2**30


def one(family: str, work: Path) -> dict:
    """The row of one family (runs in its own process)."""
    import resource
    import shutil

    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))
    os.environ["QUANTKIT_NO_PROGRESS"] = "1"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from typer.testing import CliRunner

    from quantkit.cli import app
    from tests.conftest import make_tiny_model

    def first_line(exc: BaseException) -> str:
        return f"{type(exc).__name__}: " + (str(exc).splitlines() or [""])[0][:140]

    row: dict = {"family": family}
    src, out = work / family, work / f"{family}-q"
    try:
        base = AutoConfig.for_model(family)
        extra = {k: v for k, v in TINY_MOE.items() if hasattr(base, k)}
        make_tiny_model(src, family, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    except Exception as exc:
        return {**row, "result": "not built", "why": first_line(exc)}
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(input_ids=ids).logits
    except Exception as exc:
        return {**row, "result": "transformers fails", "why": first_line(exc)}
    shutil.rmtree(out, ignore_errors=True)
    res = CliRunner().invoke(app, ["quantize", "--model", str(src), "--method", "gptq", "--scheme", "W4A16",
                                   "--group-size", "16", "--dataset", str(work / "calib.txt"), "--num-samples", "8",
                                   "--seq-len", "64", "--output", str(out)])
    if res.exit_code != 0:
        exc = res.exception
        if exc is not None and not isinstance(exc, SystemExit):
            return {**row, "result": "crash", "why": first_line(exc)}
        return {**row, "result": f"refused (exit {res.exit_code})",
                "why": ((res.stderr or "").strip().splitlines() or ["?"])[-1][:200]}
    from common import check_consumers

    return {**row, "result": "quantised", **check_consumers(out, ids, source)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="these families only (rows of others are kept)")
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "survey")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(one(args.worker, args.work)))
        return
    from transformers import __version__
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from common import consumer_cells, machine_line, write_results
    from quantkit.data.calibration import load_documents

    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "calib.txt").write_text("\n\n".join(load_documents("kjv")[:200]))
    rows_file = args.work / "rows.jsonl"
    rows = {r["family"]: r for r in map(json.loads, rows_file.read_text().splitlines())} if rows_file.exists() else {}
    families = [f for f in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if not any(s in f for s in SKIP)]
    todo = args.only or [f for f in families if f not in rows]
    load = {"before": os.getloadavg()[0]}
    for family in todo:
        try:
            proc = subprocess.run([sys.executable, __file__, "--worker", family, "--work", str(args.work)],
                                  capture_output=True, text=True, timeout=LIMIT_S)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if lines else {
                "family": family, "result": "survey process failed",
                "why": (proc.stderr.strip().splitlines() or ["?"])[-1][:160]}
        except subprocess.TimeoutExpired:
            row = {"family": family, "result": f"over {LIMIT_S} s"}
        rows[family] = row
        with rows_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(row, flush=True)
    load["after"] = os.getloadavg()[0]
    ordered = [rows[f] for f in families if f in rows]
    counts: dict[str, int] = {}
    for r in ordered:
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    lines = ["# Every decoder family transformers knows: tiny random models through quantize", "",
             machine_line(load), "", f"`benchmarks/architecture_survey.py`; transformers {__version__}; "
             f"{len(ordered)} model types. " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + ".", "",
             "| family | result | logits vs unquantised (rel. L2) | runtime vs transformers (max rel.) | why / note |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['result']} | {consumer_cells(r)} |" for r in ordered]
    write_results("architectures_survey", {"rows": ordered, "load": load}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
