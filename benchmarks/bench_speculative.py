"""Speculative decoding on this CPU: which compressed checkpoint drafts best, and what it buys, in one run.

    .venv/bin/python benchmarks/bench_speculative.py [--prompts 8] [--max-new-tokens 64] [--full]

Targets: SmolLM2 bf16 and its W4A16 GPTQ checkpoint. Drafts: its RTN / GPTQ / AWQ W4A16 checkpoints, `self:W4A8`,
`self:W4A4`, the early exits `self:skip:8/16/24`, `ngram` (`--drafts` picks some; `--draft-vocab` runs each model
draft at the given restricted vocabularies); chains K = 2, 4, 6, a static and a dynamic tree at the same verify
budget; greedy and temperature 0.7. `--full` runs every combination on the issue's 32 held-out + 32 chat prompts with 128 new
tokens (hours on 2 cores); the default is a subset (the first prompts of each kind, fewer tokens) that finishes in
minutes. Side by side: llama.cpp's prompt-lookup decoding (`llama-cpp-python`'s LlamaPromptLookupDecoding) on the
same prompts, against llama.cpp's own plain decoding (its bf16 GGUF of the model), when benchmarks/.venv-llama exists.
Every quantkit figure is from `quantkit eval --speculative --json` (plain decoding measured in the same process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import ROOT, prepare_run, write_results

QK = str(ROOT / ".venv" / "bin" / "quantkit")
LLAMA_PY = ROOT / "benchmarks" / ".venv-llama" / "bin" / "python"


def quantize(model: Path, method: str, out: Path, samples: int) -> Path:
    if not (out / "config.json").is_file():
        subprocess.run([QK, "quantize", "--model", str(model), "--method", method, "--scheme", "W4A16",
                        "--group-size", "64", "--num-samples", str(samples), "--output", str(out), "--overwrite",
                        "--json"], check=True, capture_output=True, env={**os.environ, "QUANTKIT_NO_PROGRESS": "1"})
    return out


def draft_heads(target: Path, kind: str, out: Path, steps: int, dataset: str) -> tuple[Path, dict]:
    """A drafter fitted to `target` by `quantkit draft-heads` (kept between runs: its report is saved beside it)."""
    report = out.with_name(out.name + ".json")
    if not (out / "config.json").is_file() or not report.is_file():
        proc = subprocess.run([QK, "draft-heads", str(target), "--kind", kind, "--steps", str(steps), "--dataset",
                               dataset, "--output", str(out), "--overwrite", "--json"], capture_output=True, text=True,
                              env={**os.environ, "QUANTKIT_NO_PROGRESS": "1"})
        if proc.returncode != 0:
            sys.exit(f"draft-heads {kind} on {target}: {proc.stderr.strip()[-300:]}")
        report.write_text(proc.stdout)
    return out, json.loads(report.read_text())


def spec_eval(target: Path, base: Path, draft: str, tree: str, k: int, temperature: float, prompts: Path,
              new_tokens: int, draft_vocab: int = 0, dtype: str = "auto") -> dict:
    cmd = [QK, "eval", str(target), "--baseline", str(base), "--num-samples", "1", "--seq-len", "32",
           "--speculative", draft, "--tree", tree, "--draft-tokens", str(k), "--prompts", str(prompts),
           "--max-new-tokens", str(new_tokens), "--temperature", str(temperature), "--compute-dtype", dtype, "--json"]
    if draft_vocab and draft != "ngram":
        cmd += ["--draft-vocab", str(draft_vocab)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "QUANTKIT_NO_PROGRESS": "1"})
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(proc.stdout)["results"][0]["speculative"]


LLAMA_LOOKUP = r'''
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
path, prompts_file, new, k = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompts = [json.loads(l)["ids"] for l in open(prompts_file)]
out = {}
for name, draft in (("plain", None), ("prompt lookup", LlamaPromptLookupDecoding(num_pred_tokens=k))):
    llm = Llama(model_path=path, n_ctx=1024, n_threads=2, verbose=False, draft_model=draft)
    n = 0; t0 = time.perf_counter()
    for p in prompts:
        llm.reset()
        for i, tok in enumerate(llm.generate(p, temp=0.0, reset=True)):
            n += 1
            if i + 1 >= new:
                break
    out[name] = n / (time.perf_counter() - t0)
print("RESULT " + json.dumps(out))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="prompts of each kind (held-out KJV, chat)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "speculative")
    ap.add_argument("--drafts", default=None, help="comma-separated draft labels to run (default: all)")
    ap.add_argument("--no-llama", action="store_true", help="leave out llama.cpp's prompt lookup")
    ap.add_argument("--draft-vocab", default="0",
                    help="comma-separated --draft-vocab values each model draft runs with (0 = whole vocabulary)")
    ap.add_argument("--results", default="speculative", help="results file name (benchmarks/results/NAME.md)")
    ap.add_argument("--fitted", action="store_true",
                    help="fitted drafters only (quantkit draft-heads): EAGLE and Medusa fitted to the W4A16 GPTQ "
                         "target, EAGLE fitted to the bf16 model, all driving the W4A16 target")
    ap.add_argument("--fit-steps", type=int, default=400)
    ap.add_argument("--fit-dataset", default="kjv:0.5,self:0.5")
    ap.add_argument("--trees", default="chain:4,dynamic:8:5",
                    help="with --fitted: TREE:K list (dynamic:NODES:DEPTH, opt:NODES:DEPTH)")
    ap.add_argument("--plot-from", type=Path, default=None,
                    help="only draw the plot of an earlier run's results JSON (benchmarks/results/NAME.json)")
    args = ap.parse_args()
    if args.plot_from:
        print(plot(json.loads(args.plot_from.read_text()), args.plot_from.with_suffix(".png")))
        return
    model, tok = prepare_run(None, args.work / "scratch")
    import torch

    sys.path.insert(0, str(ROOT))
    from quantkit.eval.speculative import load_prompts

    n = 32 if args.full else args.prompts
    new_tokens = 128 if args.full else args.max_new_tokens
    ids = load_prompts("builtin", tok)
    chosen = ids[:n] + ids[32:32 + n]
    ids_file = prompt_file = args.work / "prompt_ids.jsonl"  # token ids: both tools see the very same prompts
    ids_file.write_text("".join(json.dumps({"ids": p}) + "\n" for p in chosen))

    ckpts = {m: quantize(model, m, args.work / f"w4a16-{m}", args.calib_samples)
             for m in (("gptq",) if args.fitted else ("rtn", "gptq", "awq"))}
    targets = {"bf16": model, "W4A16 GPTQ": ckpts["gptq"]}
    drafts = {} if args.fitted else {
              "RTN W4A16": str(ckpts["rtn"]), "GPTQ W4A16": str(ckpts["gptq"]), "AWQ W4A16": str(ckpts["awq"]),
              "self:W4A8": "self:W4A8", "self:W4A4": "self:W4A4", "ngram": "ngram",
              # Early exits: the target's first 8 / 16 / 24 of SmolLM2's 30 layers, no training.
              "self:skip:8": "self:skip:8", "self:skip:16": "self:skip:16", "self:skip:24": "self:skip:24"}
    fits = {}
    if args.fitted:
        fit_work = ROOT / "benchmarks" / ".work" / "speculative-fitted"
        fit_work.mkdir(parents=True, exist_ok=True)
        tag = f"{args.fit_steps}-{args.fit_dataset.replace(':', '').replace(',', '_')}"
        for label, kind, on in (("EAGLE fit to W4A16", "eagle", ckpts["gptq"]), ("EAGLE fit to bf16", "eagle", model),
                                ("Medusa fit to W4A16", "medusa", ckpts["gptq"])):
            if args.drafts and label not in args.drafts.split(","):
                continue  # only the drafters asked for are fitted (10 minutes each)
            folder, rep = draft_heads(on, kind, fit_work / f"{kind}-{'bf16' if on == model else 'w4a16'}-{tag}",
                                      args.fit_steps, args.fit_dataset)
            fits[label] = {k: rep[k] for k in ("seconds", "trained", "untrained", "draft_vocab", "parameters")}
            print(label, fits[label], flush=True)
            drafts[label] = f"{kind}:{folder}"
    if args.drafts:
        wanted = args.drafts.split(",")
        unknown = [d for d in wanted if d not in drafts]
        if unknown:
            sys.exit(f"unknown draft label(s) {unknown}; choose from {list(drafts)}")
        drafts = {d: drafts[d] for d in wanted}
    configs = [("chain", 2), ("chain", 4), ("chain", 6), ("static:2x3", 3), ("dynamic:6", 6)]
    temps = (0.0, 0.7)
    if args.fitted:
        trees = []
        for item in args.trees.split(","):
            parts = item.split(":")
            trees.append((":".join(parts[:2]), int(parts[2])) if parts[0] in ("dynamic", "opt")
                         else (parts[0], int(parts[1])))
        plan = [("W4A16 GPTQ", d, tree, k, T) for d in fits for tree, k in trees for T in temps
                if not (T > 0 and d == "EAGLE fit to bf16")]
        # Lossless in exact arithmetic; measured in fp32, where verify and plain decoding round alike
        targets["W4A16 GPTQ fp32"] = ckpts["gptq"]
        plan.append(("W4A16 GPTQ fp32", "EAGLE fit to W4A16", *trees[-1], 0.0))
    elif not args.full:  # the subset: every draft on chain K=4; every tree shape with the best model draft
        plan = [(t, d, "chain", 4, 0.0) for t in targets for d in drafts]
        plan += [("bf16", "AWQ W4A16", tree, k, 0.0) for tree, k in configs if (tree, k) != ("chain", 4)]
        plan += [("bf16", "self:W4A8", "dynamic:6", 6, 0.0), ("bf16", "AWQ W4A16", "chain", 4, 0.7),
                 ("bf16", "ngram", "static:2x3", 3, 0.0)]
    else:
        plan = [(t, d, tree, k, T) for t in targets for d in drafts for tree, k in configs for T in temps
                if not (d == "ngram" and tree.startswith("dynamic"))]
    plan = [row for row in plan if row[1] in drafts]
    payload = {"cpu": f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs",
               "load_average_before": os.getloadavg(), "prompts": len(chosen), "new_tokens": new_tokens, "rows": [],
               "fits": fits}
    print(payload["cpu"], flush=True)
    vocabs = [int(v) for v in args.draft_vocab.split(",")]
    plan = [(*row, v) for row in plan for v in (vocabs if row[1] != "ngram" else [0])]
    for target, draft, tree, k, T, vocab in plan:
        if targets[target] == ckpts["gptq"] and draft == "GPTQ W4A16":
            continue  # a model drafting for itself says nothing
        r = spec_eval(targets[target], model, drafts[draft], tree, k, T, prompt_file, new_tokens, vocab,
                      "float32" if target.endswith("fp32") else "auto")
        payload["rows"].append({"target": target, "draft_label": draft, "tree_spec": tree, "k": k, **r})
        print(target, draft, vocab or "all", tree, k, T, {x: r.get(x) for x in ("mean_accepted_length", "speedup",
                                                                "identical_to_plain", "error")}, flush=True)
    gguf = ROOT / "benchmarks" / ".work" / "runtime" / "smollm2-bf16.gguf"
    if LLAMA_PY.exists() and gguf.is_file() and not args.no_llama:
        proc = subprocess.run([str(LLAMA_PY), "-c", LLAMA_LOOKUP, str(gguf), str(ids_file), str(new_tokens), "4"],
                              capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        payload["llama_cpp"] = json.loads(line[7:]) if line else {"error": proc.stderr[-300:]}
    payload["load_average_after"] = os.getloadavg()
    write_results(args.results, payload, markdown(payload))
    if args.fitted:
        print(plot(payload, ROOT / "benchmarks" / "results" / f"{args.results}.png"))


def plot(payload: dict, path: Path) -> Path:
    """Acceptance per draft position (left) and speed-up over plain decoding (right), one line / bar per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["rows"] if "error" not in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = []
    for r in rows:
        label = f"{r['draft_label']}, {r['tree']}, T={r['temperature']}" + (", fp32" if r["target"].endswith("fp32") else "")
        labels.append(label)
        acc = r["per_position_acceptance"]
        left.plot(range(1, len(acc) + 1), acc, marker="o", label=label)
    left.set_xlabel("draft position")
    left.set_ylabel("share of steps accepting it")
    left.set_title("acceptance per draft position")
    left.legend(fontsize=7)
    right.barh(range(len(rows)), [r["speedup"] for r in rows])
    right.set_yticks(range(len(rows)), labels, fontsize=7)
    right.axvline(1.0, color="k", lw=0.8)
    right.set_xlabel("tokens/s over plain decoding of the same target")
    right.set_title(f"speed-up ({payload['cpu']})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def markdown(payload: dict) -> str:
    md = ["# Speculative decoding (SmolLM2-135M, CPU)", "", payload["cpu"],
          f"load average before / after: {payload['load_average_before'][0]:.2f} / {payload['load_average_after'][0]:.2f}",
          f"{payload['prompts']} prompts (half held-out KJV, half chat), {payload['new_tokens']} new tokens", "",
          "| target | draft | draft vocabulary | draft / target bytes per step | tree | T | acceptance | "
          "mean accepted length | tok/s | plain tok/s | speed-up | identical to plain |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        if "error" in r:
            md.append(f"| {r['target']} | {r['draft_label']} | | | {r['tree_spec']} | | error: {r['error']} |||||")
            continue
        ratio = r.get("draft_bytes_ratio")
        md.append(f"| {r['target']} | {r['draft_label']} | {r.get('draft_vocab') or 'all'} | "
                  f"{'-' if ratio is None else f'{ratio:.2f}'} | {r['tree']} | "
                  f"{r['temperature']} | {r['acceptance_rate']:.3f} | "
                  f"{r['mean_accepted_length']:.2f} | {r['tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | "
                  f"{r['speedup']:.2f}x | {r['identical_to_plain']} |")
    if payload.get("fits"):
        md += ["", "Drafters (quantkit draft-heads; held-out top-1 agreement with the target's greedy token per depth):",
               "", "| drafter | parameters | draft vocabulary | fit s | held-out KL+reg untrained -> fitted | "
               "top-1 agreement fitted |", "|---|---|---|---|---|---|"]
        for label, f in payload["fits"].items():
            md.append(f"| {label} | {f['parameters']:,} | {f['draft_vocab'] or 'all'} | {f['seconds']['total']:.0f} | "
                      f"{f['untrained']['heldout_loss']:.3f} -> {f['trained']['heldout_loss']:.3f} | "
                      f"{' / '.join(f'{a:.3f}' for a in f['trained']['top1_agreement'])} |")
    if "llama_cpp" in payload:
        ll = payload["llama_cpp"]
        md += ["", f"llama.cpp (bf16 GGUF, same prompts, greedy): {ll}"]
        if "plain" in ll:
            md.append(f"llama.cpp prompt-lookup speed-up: {ll['prompt lookup'] / ll['plain']:.2f}x")
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()
