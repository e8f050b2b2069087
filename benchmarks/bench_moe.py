"""MoE end to end on real weights: SmolLM2 MoEfied and distilled (`quantkit moefy`), quantised five ways (GPTQ
also with routed-only expert statistics), then `quantkit eval --moe` against the MoE original: KL, routing
drift, capacity-aware inference, bias balancing and expert offloading with prefetch.

    python benchmarks/bench_moe.py [--experts 16 --top-k 4 --shared-experts 8] [--calib-samples 1024 --seq-len 256]
        [--local-steps 100 --distill-steps 300 --local-samples 96]

The MoE is made once into benchmarks/.work/moe/ and reused while its options match, as are finished quantised
checkpoints, so an interrupted run continues where it stopped. Results: benchmarks/results/moe.md, moe.json and
moe.png (capacity and bias: load cut against KL), with the CPU capability and load average.
Targets (issue #31), each reported as met or not: the MoE's KL to the dense model at its top-k <= 0.5 nats and
its bf16-vs-fp32 routing overlap >= 0.97; GPTQ's KL below RTN's and its routing overlap >= 0.9; prefetch at E/2
cached >= 10 points of hit rate above LRU with decode tok/s at least LRU's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# (name, method, scheme, calibration.expert_tokens)
METHODS = (("rtn", "rtn", "W4A16", "all"), ("gptq", "gptq", "W4A16", "all"), ("gptq_routed", "gptq", "W4A16", "routed"),
           ("awq", "awq", "W4A16", "all"), ("smoothquant_w8a8", "smoothquant", "W8A8", "all"),
           ("fp8_block", "fp8", "FP8_BLOCK", "all"))


def make_moe(work: Path, args) -> tuple[Path, dict]:
    from dataclasses import asdict

    from quantkit.convert.moe_distill import DistillOptions
    from quantkit.convert.moefy import MoEfyOptions, evaluate_moe, moefy_model

    e, k, s = args.experts, args.top_k, args.shared_experts
    out = work / f"smollm2-moe-e{e}k{k}s{s}"
    distill = DistillOptions(local_steps=args.local_steps, steps=args.distill_steps,
                             local_samples=args.local_samples) if (
        args.local_steps or args.distill_steps) else None
    opts = MoEfyOptions(experts=e, top_k=k, shared_experts=s, layout="qwen2_moe" if s else "qwen3_moe",
                        distill=distill)
    info = out / "moefy.json"
    summary = None
    if info.is_file():
        old = json.loads(info.read_text())
        if (old["options"] == json.loads(json.dumps(asdict(opts)))
                and old["calibration"]["num_samples"] == args.calib_samples):
            summary = old
    if summary is None:
        summary = moefy_model(None, out, opts, num_samples=args.calib_samples, seq_len=args.seq_len, overwrite=True)
        for name, *_ in METHODS:  # checkpoints of an earlier MoE in the same folder must not be reused
            shutil.rmtree(work / name, ignore_errors=True)
    if "eval" not in summary:
        ks = sorted({max(1, k // 2), k, min(e, 2 * k), e})
        summary["eval"] = evaluate_moe(None, out, ks, num_samples=args.eval_samples, seq_len=args.seq_len)
    info.write_text(json.dumps(summary, indent=2, default=str))
    return out, summary


def quantize(src: Path, out: Path, method: str, scheme: str, expert_tokens: str, calib: int, seq_len: int) -> dict:
    from quantkit.pipeline.engine import quantize_model
    from quantkit.recipe import Recipe

    r = Recipe()
    r.model.source = str(src)
    r.quantization.method, r.quantization.scheme = method, scheme
    if scheme == "W4A16":
        r.quantization.group_size = 32  # whole groups of every expert width the options above give (64, 96)
    r.calibration.num_samples, r.calibration.seq_len = calib, seq_len
    r.calibration.expert_tokens = expert_tokens
    manifest = out / "quantkit_manifest.json"
    if manifest.is_file():
        # A finished checkpoint of the same recipe from an earlier (interrupted) run of this script is reused.
        m = json.loads(manifest.read_text())
        want, have = r.to_dict()["calibration"], dict(m["recipe"]["calibration"])
        if method in ("rtn", "fp8"):
            # Data-free: the sample count only sizes the error measurement (at most error_samples blocks).
            have["num_samples"] = want["num_samples"] = min(want["num_samples"], want["error_samples"])
            m["recipe"]["calibration"]["num_samples"] = min(m["recipe"]["calibration"]["num_samples"],
                                                            have["error_samples"])
            have["num_samples"] = m["recipe"]["calibration"]["num_samples"]
        if m["recipe"]["quantization"] == r.to_dict()["quantization"] and have == want:
            return {"seconds": m["wall_seconds"], "bits_per_weight": m.get("bits_per_weight"),
                    "events": len(m.get("events", [])), "routing_profile": (out / "routing_profile.json").is_file(),
                    "starved": len((m.get("experts") or {}).get("starved", [])), "reused": True}
    s = quantize_model(r, out, overwrite=True)
    return {"seconds": round(s["wall_seconds"], 1), "bits_per_weight": s.get("bits_per_weight"),
            "events": len(s.get("events", [])), "routing_profile": bool(s.get("routing_profile")),
            "starved": len((s.get("experts") or {}).get("starved", []))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--shared-experts", type=int, default=8,
                    help="always-on experts of the routed size (qwen2_moe layout; 0: qwen3_moe, none)")
    ap.add_argument("--local-steps", type=int, default=100, help="moefy distillation: per-layer steps")
    ap.add_argument("--distill-steps", type=int, default=300, help="moefy distillation: end-to-end steps")
    ap.add_argument("--local-samples", type=int, default=96, help="moefy: blocks of the split and the local fits")
    ap.add_argument("--calib-samples", type=int, default=1024,
                    help="calibration blocks of the MoEfication's end-to-end distillation")
    ap.add_argument("--quant-samples", type=int, default=16, help="calibration blocks of the quantisers")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--moe-samples", type=int, default=2)
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "moe")
    ap.add_argument("--methods", default=",".join(n for n, *_ in METHODS),
                    help="comma-separated subset of: " + ", ".join(n for n, *_ in METHODS) + " (rtn and gptq always run)")
    args = ap.parse_args()
    wanted = set(args.methods.split(",")) | {"rtn", "gptq", "gptq_routed"}
    methods = tuple(m for m in METHODS if m[0] in wanted)
    args.method_rows = methods
    os.environ.setdefault("QUANTKIT_NO_PROGRESS", "1")
    import torch

    from quantkit.eval.moe import MoEEvalOptions
    from quantkit.eval.runner import EvalOptions, run_eval

    started = time.time()
    load_before = os.getloadavg()
    args.work.mkdir(parents=True, exist_ok=True)
    moe, made = make_moe(args.work, args)
    print(f"MoE: {json.dumps(made.get('eval'), default=str)}", flush=True)
    quant = {}
    for name, method, scheme, expert_tokens in methods:
        quant[name] = quantize(moe, args.work / name, method, scheme, expert_tokens, args.quant_samples,
                               args.seq_len)
        print(f"quantised {name}: {quant[name]}", flush=True)
    light = MoEEvalOptions(capacity_factors=(1.25,), policies=("drop",), samples=args.moe_samples, offload_runs=())
    run_q = run_eval(EvalOptions(checkpoints=[args.work / n for n, *_ in methods], baseline=str(moe),
                                 num_samples=args.eval_samples, seq_len=args.seq_len, moe=True, moe_options=light))
    half = args.experts // 2
    # 64 decoded tokens per offload row: 24 left the rows of one run 30% apart at the same cache size.
    full = MoEEvalOptions(samples=args.moe_samples, offload_cache=(args.top_k, half), decode_tokens=64)
    # The capacity, bias and offload study on the MoE original (its KL is against itself: capacity costs only).
    run_o = run_eval(EvalOptions(checkpoints=[moe], baseline=str(moe), num_samples=args.moe_samples,
                                 seq_len=args.seq_len, moe=True, moe_options=full))
    # The study repeated on the GPTQ checkpoint, whose routing profile seeds the trace policy.
    gptq_opts = MoEEvalOptions(samples=args.moe_samples, capacity_factors=(1.25,), policies=("drop",),
                               offload_cache=(half,), decode_tokens=64)
    run_g = run_eval(EvalOptions(checkpoints=[args.work / "gptq"], baseline=str(moe), num_samples=args.moe_samples,
                                 seq_len=args.seq_len, moe=True, moe_options=gptq_opts))
    load_after = os.getloadavg()
    payload = {"moe": {k: made[k] for k in ("options", "router_fit_mean", "eval", "distillation", "wall_seconds")
                       if k in made},
               "quantize": quant, "eval_quantised": run_q.report["results"], "study_original": run_o.report["results"][0],
               "study_gptq": run_g.report["results"][0], "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "load_average": {"before": load_before, "after": load_after},
               "wall_seconds": round(time.time() - started, 1)}
    from common import write_results

    write_results("moe", payload, render(payload, args))
    print(plot(payload, ROOT / "benchmarks" / "results" / "moe.png"))


def plot(p: dict, path: Path) -> Path:
    """Capacity factors and bias balancing on the MoE original: max-load cut against the KL they cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    o = p["study_original"]["moe"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, marker in (("drop", "o"), ("reroute", "s")):
        rows = [c for c in o["capacity"] if c["policy"] == policy]
        ax.plot([100 * c["max_load_reduction"] for c in rows], [c["kl"] for c in rows], marker=marker,
                label=f"capacity, {policy}")
        for c in rows:
            ax.annotate(f"γ={c['gamma']}", (100 * c["max_load_reduction"], c["kl"]), fontsize=8,
                        textcoords="offset points", xytext=(4, 4))
    b = o["bias_balancing"]
    cut = 1 - b["max_over_mean_load"]["with"] / b["max_over_mean_load"]["without"]
    ax.scatter([100 * cut], [b["kl"]["with"] - b["kl"]["without"]], marker="*", s=150, color="black",
               label="bias balancing")
    ax.set_xlabel("max expert load cut (%)")
    ax.set_ylabel("KL against the MoE without limits (nats)")
    ax.set_title("Load balancing at inference: what each setting costs")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _fmt(v, nd=4):
    return "-" if v is None else (f"{v:.{nd}g}" if isinstance(v, float) else str(v))


def render(p: dict, args) -> str:
    e, k, sh = args.experts, args.top_k, args.shared_experts
    layout = "qwen2_moe" if sh else "qwen3_moe"
    dist = p["moe"].get("distillation")
    lines = [f"# MoE benchmark: SmolLM2-135M MoEfied to {e} experts top-{k}"
             + (f" + {sh} shared" if sh else "") + f" ({layout} layout)", "",
             f"CPU capability `{p['cpu_capability']}`; load average before {p['load_average']['before'][0]:.1f}, "
             f"after {p['load_average']['after'][0]:.1f} (2 cores shared); wall {p['wall_seconds']} s; calibration "
             f"{args.calib_samples} x {args.seq_len} KJV tokens (MoEfication"
             + (f", {args.local_steps} local steps per layer on the first {args.local_samples} blocks, "
                f"{args.distill_steps} end-to-end steps of 4 blocks" if dist else "")
             + f"), {args.quant_samples} x {args.seq_len} (quantisers), eval {args.eval_samples} x {args.seq_len} "
             f"held-out, routing studies on the first {args.moe_samples}.", "",
             "## The MoE against the dense model", ""]
    ev = p["moe"].get("eval", {})
    lines += ["| routing | KL vs dense | top-1 agreement |", "|---|---|---|"]
    lines += [f"| {name} | {_fmt(r['kl'])} | {_fmt(r['top1_agree'])} |" for name, r in ev.get("runs", {}).items()]
    lines += ["", f"Routing top-{k} overlap between the MoE's own bf16 and fp32 runs: "
              f"{_fmt(ev.get('routing_overlap_bf16_fp32'))}. MoEfication + distillation took "
              f"{p['moe'].get('wall_seconds')} s."]
    if dist:
        lines += [f"Distillation: mean local relative error per layer {dist['local_relative_error_mean']}; held-out "
                  "KL(dense || MoE) during the end-to-end fit: "
                  + ", ".join(f"step {h['step']} {h['heldout_kl']}" for h in dist["heldout_kl"]) + "."]
    fit = p["moe"].get("router_fit_mean", {})
    lines += ["", "Router fit of the split, held-out calibration tokens (mean over layers): "
              + "; ".join(f"{kind}: oracle top-{k} overlap {v['oracle_overlap']}, activation mass captured "
                          f"{v['mass_captured']}" for kind, v in fit.items()), ""]
    lines += ["## Quantised checkpoints against the MoE original", "",
              "| method | expert statistics | bits/weight | quantise s | starved experts | KL | top-1 | "
              "routing top-k overlap | max/mean load | gamma 1.25 drop: max-load cut | KL change |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    rtn_kl = None
    by_name = {}
    for (name, _, _, tokens), r in zip(args.method_rows, p["eval_quantised"]):
        m = r["moe"]
        c = m["capacity"][0]
        by_name[name] = r
        if name == "rtn":
            rtn_kl = r["kl_mean"]
        q = p["quantize"][name]
        lines.append(f"| {name} | {tokens} | {_fmt(q['bits_per_weight'])} | {q['seconds']} | {q.get('starved', '-')} | "
                     f"{_fmt(r['kl_mean'])} | {_fmt(r['top1_agree'])} | {_fmt(m['routing_topk_overlap'])} | "
                     f"{_fmt(m['max_over_mean_load'])} | {_fmt(c['max_load_reduction'])} | {_fmt(c['kl_change'])} |")
    qa, qr = p["quantize"]["gptq"], p["quantize"]["gptq_routed"]
    lines += ["", f"Expert statistics from every token (each expert also runs on the tokens not routed to it, E/k = "
              f"{e / k:g} times the routed expert compute of the statistics pass) against routed tokens only "
              f"(starved experts, fewer than 64 routed tokens, get RTN): GPTQ {qa['seconds']} s vs {qr['seconds']} s "
              f"({float(qa['seconds']) / max(float(qr['seconds']), 1e-9):.2f}x), KL {_fmt(by_name['gptq']['kl_mean'])} "
              f"vs {_fmt(by_name['gptq_routed']['kl_mean'])}.", ""]
    o = p["study_original"]["moe"]
    lines += ["## Capacity-aware inference on the MoE original (KL against the MoE without capacity)", "",
              "Plot: `moe.png` (max-load cut against KL, per gamma and policy, and bias balancing).", "",
              "| gamma | policy | capacity/call | max load before | after | cut | dropped | rerouted | KL |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in o["capacity"]:
        lines.append(f"| {c['gamma']} | {c['policy']} | {c['capacity']} | {c['max_load_before']} | "
                     f"{c['max_load_after']} | {_fmt(c['max_load_reduction'])} | {_fmt(c['dropped_frac'])} | "
                     f"{_fmt(c['rerouted_frac'])} | {_fmt(c['kl'])} |")
    b = o["bias_balancing"]
    lines += ["", f"Bias balancing (u = {b['rate']} x decision margin, step {b['step_tokens']} tokens): max/mean load "
              f"{b['max_over_mean_load']['without']} -> {b['max_over_mean_load']['with']}, KL "
              f"{b['kl']['without']} -> {b['kl']['with']}, tokens re-routed {b['tokens_rerouted_frac']}.", ""]
    for title, study in (("MoE original (no routing profile)", o), ("GPTQ checkpoint (routing profile from "
                                                                    "calibration)", p["study_gptq"]["moe"])):
        lines += [f"## Expert offloading: {title}", "",
                  "prefetch: the next layer's router run ahead on the hidden state; `+prefetch` loads on a "
                  "background thread while the layer computes, `+prefetch-sync` in the hook before it.", "",
                  "| policy | cache | hit rate | prefetch fidelity | MB moved | decode tok/s | exact |",
                  "|---|---|---|---|---|---|---|"]
        for r in study["offload"]:
            lines.append(f"| {r['policy']} | {_fmt(r['cache'])} | {_fmt(r['hit_rate'])} | {_fmt(r['prefetch_fidelity'])} "
                         f"| {r['bytes_moved'] / 1e6:.1f} | {r['decode_tok_s']} | {r['exact']} |")
        lines.append("")
    # Targets.
    top = ev.get("runs", {}).get(f"top{k}", {}).get("kl")
    prec = ev.get("routing_overlap_bf16_fp32")
    g = by_name["gptq"]
    g_overlap = g["moe"]["routing_topk_overlap"]
    off = {r["policy"]: r for r in o["offload"] if r["cache"] == e // 2}
    lru, pre = off.get("lru", {}), off.get("lru+prefetch", {})
    gain = pre.get("hit_rate", 0) - lru.get("hit_rate", 0)
    faster = pre.get("decode_tok_s", 0) >= lru.get("decode_tok_s", float("inf"))
    lines += ["## Targets", "",
              f"- MoE KL to dense at top-{k} <= 0.5 nats: {_fmt(top)} -> "
              f"{'met' if top is not None and top <= 0.5 else 'NOT met'}",
              f"- bf16-vs-fp32 routing overlap >= 0.97: {_fmt(prec)} -> "
              f"{'met' if prec is not None and prec >= 0.97 else 'NOT met'}",
              f"- GPTQ KL below RTN's ({_fmt(rtn_kl)}): {_fmt(g['kl_mean'])} -> "
              f"{'met' if g['kl_mean'] < rtn_kl else 'NOT met'}",
              f"- GPTQ routing overlap >= 0.9: {_fmt(g_overlap)} -> "
              f"{'met' if g_overlap is not None and g_overlap >= 0.9 else 'NOT met'}",
              f"- prefetch at {e // 2} of {e} cached: hit rate LRU {lru.get('hit_rate')}, LRU+prefetch "
              f"{pre.get('hit_rate')} ({100 * gain:+.1f} points, target >= +10) -> {'met' if gain >= 0.1 else 'NOT met'}; "
              f"decode {pre.get('decode_tok_s')} vs {lru.get('decode_tok_s')} tok/s -> {'met' if faster else 'NOT met'}",
              ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
