"""`--compute-dtype auto` against both forced dtypes, in one run on the machine at hand.

    .venv/bin/python benchmarks/bench_compute_dtype.py [--isa native|avx2] [--calib-samples 16] [--timeout 240]
    .venv/bin/python benchmarks/bench_compute_dtype.py --isa avx2      # what an AVX2-only CPU gets

For RTN, GPTQ and AWQ on SmolLM2 (W4A16 g64) and RTN + GPTQ on the random 0.7B fp32 Llama of
bench_memory_scaling.py: wall time and peak RSS with `--compute-dtype float32`, `bfloat16` and `auto`;
auto / the faster forced dtype as a ratio; and how much held-out KL (KJV and pydoc, by kl_plain.py) moves
between the fp32- and the bf16-calibrated SmolLM2 checkpoints. `--isa avx2` caps oneDNN and ATen at AVX2
(ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY), which reproduces an AVX2-only CPU's matmul speeds on a newer one.
`auto` runs first; a forced dtype is stopped at 1.5x auto's wall (or `--timeout`) and reported as "> T s":
past that it cannot be the faster one (bf16 on AVX2 can take half an hour).
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

from common import HELDOUT_KJV, HELDOUT_PYDOC, ROOT, heldout_sets, kl_plain, prepare_run, write_results

AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
DTYPES = ("float32", "bfloat16", "auto")
CUTOFF = 1.5


def timed(cmd: list[str], env: dict, timeout: float) -> dict:
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "QUANTKIT_NO_PROGRESS": "1", **env})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"wall_s": None, "timed_out": timeout}
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{err[-3000:]}")
    summary = json.loads(out)
    return {"wall_s": round(time.time() - start, 2), "quantize_s": summary["wall_seconds"],
            "peak_rss_bytes": summary["peak_rss_bytes"], "compute": summary["compute"]}


def cpu_line(env: dict) -> str:
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    cap = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, **env}).stdout.strip()
    sys.path.insert(0, str(ROOT))
    from quantkit.compute import cpu_info

    info = cpu_info()
    return f"torch CPU capability {cap}; {info.model}; flags {' '.join(info.flags)}; {info.threads} threads" + (
        f"; {' '.join(f'{k}={v}' for k, v in env.items())}" if env else "")


def fmt_wall(r: dict) -> str:
    return f"> {r['timed_out']:.0f}" if r["wall_s"] is None else f"{r['wall_s']:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", choices=("native", "avx2"), default="native")
    ap.add_argument("--calib-samples", type=int, default=16, help="GPTQ / AWQ calibration samples of 512 tokens")
    ap.add_argument("--heldout-samples", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds before a run is stopped")
    ap.add_argument("--skip-large", action="store_true", help="leave out the 0.7B model")
    ap.add_argument("--methods", default="rtn,gptq,awq", help="methods run on SmolLM2")
    ap.add_argument("--large-methods", default="rtn,gptq", help="methods run on the 0.7B model")
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "compute_dtype")
    args = ap.parse_args()
    env = AVX2_ENV if args.isa == "avx2" else {}
    model, tok = prepare_run(None, args.work)
    eval_files = heldout_sets(tok, args.work, args.heldout_samples, 512)
    quantkit = str(ROOT / ".venv" / "bin" / "quantkit")
    calib = {"rtn": [], "gptq": ["--num-samples", str(args.calib_samples)], "awq": ["--num-samples", str(args.calib_samples)]}
    jobs = [("SmolLM2", model, m, calib[m]) for m in args.methods.split(",") if m]
    if not args.skip_large:
        from bench_memory_scaling import build_model

        large = build_model(ROOT / "benchmarks" / ".work" / "memory" / "llama-0.7b-fp32")
        jobs += [("0.7B fp32", large, m, ["--num-samples", "8"] if m != "rtn" else [])
                 for m in args.large_methods.split(",") if m]
    # Measure the chooser's probe once outside the timed runs, as a user's second run would find it cached.
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import torch; "
                    "from quantkit.compute import choose_compute_dtype; "
                    "print(choose_compute_dtype('auto', torch.bfloat16).describe())", str(ROOT)],
                   env={**os.environ, **env}, check=True)
    rows, payload = [], {"cpu": cpu_line(env), "isa": args.isa, "load_average_before": os.getloadavg()}
    for label, src, method, extra in jobs:
        size = sum(p.stat().st_size for p in Path(src).glob("*.safetensors"))
        res = {}
        # auto first; a forced dtype is then stopped at CUTOFF x auto's wall: past that it cannot be the faster
        # one by the 10% the target allows, and the slow dtype on this machine (bf16 on AVX2, fp32 under AMX for
        # AWQ) would otherwise cost most of the benchmark's time.
        for dt in ("auto", "float32", "bfloat16"):
            out = args.work / f"{label.split()[0]}-{method}-{dt}"
            shutil.rmtree(out, ignore_errors=True)
            limit = args.timeout
            if dt != "auto" and res["auto"]["wall_s"] is not None:
                limit = min(args.timeout, CUTOFF * res["auto"]["wall_s"] + 5)
            res[dt] = timed([quantkit, "quantize", "--model", str(src), "--method", method, "--scheme", "W4A16",
                             "--group-size", "64", *extra, "--compute-dtype", dt, "--output", str(out), "--json"],
                            env, limit)
            res[dt]["out"] = str(out)
            print(label, method, dt, fmt_wall(res[dt]), flush=True)
        forced = [res[d]["wall_s"] for d in ("float32", "bfloat16") if res[d]["wall_s"] is not None]
        auto = res["auto"]["wall_s"]
        rows.append({"model": label, "method": method, "size": size, **{d: res[d] for d in DTYPES},
                     "auto_over_best": round(auto / min(forced), 3) if auto and forced else None})
    kl = {}
    for method in ("rtn", "gptq", "awq"):
        outs = {d: args.work / f"SmolLM2-{method}-{d}" for d in ("float32", "bfloat16")}
        if all((o / "config.json").is_file() for o in outs.values()):
            kl[method] = {d: {k: kl_plain(model, o, f)["kl_mean"] for k, f in eval_files.items()}
                          for d, o in outs.items()}
    payload.update({"rows": rows, "kl": kl, "load_average_after": os.getloadavg()})

    md = [f"# Compute dtype: auto vs forced ({args.isa})", "", payload["cpu"],
          f"load average before / after: {payload['load_average_before'][0]:.2f} / {payload['load_average_after'][0]:.2f}", "",
          "| model | method | fp32 wall (s) | bf16 wall (s) | auto wall (s) | auto picked | auto / faster forced | "
          "auto peak RSS / model |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        picked = r["auto"].get("compute", {}).get("dtype", "?") + (" (autocast)" if r["auto"].get("compute", {}).get("autocast") else "")
        rss = r["auto"].get("peak_rss_bytes")
        rss_txt = f"{rss / r['size']:.3f}" if rss else "n/a"
        md.append(f"| {r['model']} | {r['method']} | {fmt_wall(r['float32'])} | {fmt_wall(r['bfloat16'])} | "
                  f"{fmt_wall(r['auto'])} | {picked} | {r['auto_over_best'] or 'n/a'}x | {rss_txt} |")
    if kl:
        md += ["", "Held-out KL against the bf16 model, fp32- vs bf16-calibrated checkpoints (SmolLM2, kl_plain.py):", "",
               "| method | KJV fp32 | KJV bf16 | pydoc fp32 | pydoc bf16 |", "|---|---|---|---|---|"]
        for m, v in kl.items():
            md.append(f"| {m} | {v['float32'][HELDOUT_KJV]:.4f} | {v['bfloat16'][HELDOUT_KJV]:.4f} | "
                      f"{v['float32'][HELDOUT_PYDOC]:.4f} | {v['bfloat16'][HELDOUT_PYDOC]:.4f} |")
    for r in rows:
        for d in DTYPES:
            r[d].pop("out", None)
    write_results(f"compute_dtype_{args.isa}", payload, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
