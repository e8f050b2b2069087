"""A MoE family whose routing quantkit does not describe, on real weights: the MoEfied SmolLM2 of bench_moe.py
rewritten in GLM-4.5's layout (`glm4_moe`: sigmoid router scores with a selection bias, shared experts without a
gate), then quantised with RTN and GPTQ W4A16 through the layout quantkit infers from transformers' model and the
checkpoint's names, and scored by `quantkit eval --moe` against the unquantised glm4_moe model (the routing studies
replay the rule the runtime finds on the loaded router). transformers loads each
checkpoint as the consumer; its KL on the same held-out tokens is set beside quantkit's runtime's.

    python benchmarks/bench_generic_moe.py [--quant-samples 16 --seq-len 256 --eval-samples 4]

The rewritten model is not the MoEfied one (its router now scores by sigmoid, and Qwen2-MoE's shared-expert gate
has no place in this layout): its KL to that model is reported for what it is. Results:
benchmarks/results/generic_moe.md and .json, with the CPU capability and the load average.
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


def to_glm4_moe(src: Path, out: Path) -> Path:
    """The qwen2_moe MoE of bench_moe.py as a glm4_moe checkpoint: the same attention (q/k/v biases, full
    rotary), router and experts; the shared expert as glm4_moe's shared experts (its sigmoid gate dropped); a zero
    selection bias."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    if cfg["model_type"] != "qwen2_moe":
        sys.exit(f"error: {src} is {cfg['model_type']}, not the qwen2_moe MoE bench_moe.py makes")
    out.mkdir(parents=True, exist_ok=True)
    shared, size = cfg["shared_expert_intermediate_size"], cfg["moe_intermediate_size"]
    if shared % size:
        sys.exit(f"error: the shared expert ({shared}) is not a whole number of experts of {size}")
    new = {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
                               "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "bos_token_id",
                               "eos_token_id", "pad_token_id", "head_dim", "moe_intermediate_size", "dtype")}
    new.update({"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "partial_rotary_factor": 1.0,
                "attention_bias": bool(cfg.get("qkv_bias", True)), "use_qk_norm": False,
                "n_routed_experts": cfg["num_experts"], "num_experts_per_tok": cfg["num_experts_per_tok"],
                "n_shared_experts": shared // size, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
                "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)), "routed_scaling_factor": 1.0})
    (out / "config.json").write_text(json.dumps(new, indent=2))
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith("mlp.shared_expert_gate.weight"):
            continue
        tensors[name.replace("mlp.shared_expert.", "mlp.shared_experts.")] = t
        if name.endswith("mlp.gate.weight"):
            tensors[name.replace("gate.weight", "gate.e_score_correction_bias")] = torch.zeros(t.shape[0])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


def consumer_kl(checkpoints: dict[str, Path], baseline: Path, ids) -> dict:
    """Each checkpoint's KL to the unquantised model on `ids`, in transformers (the consumer, which keeps the
    decompressed experts in bf16) and in quantkit's runtime (fp32), the unquantised model run by the same one."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.eval.metrics import token_stats
    from quantkit.runtime.model import load_model

    def kl(base, logits) -> float:
        return float(torch.cat([token_stats(base[j, :-1], logits[j, :-1], ids[j, 1:])["kl"]
                                for j in range(ids.shape[0])]).mean())

    with torch.no_grad():
        base_tf = AutoModelForCausalLM.from_pretrained(baseline, dtype=torch.float32)(ids).logits
        base_rt = load_model(baseline, dtype=torch.float32)(ids).logits.float()
        out = {}
        for name, path in checkpoints.items():
            tf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits
            rt = load_model(path, dtype=torch.float32)(ids).logits.float()
            out[name] = {"kl_transformers": round(kl(base_tf, tf), 4), "kl_runtime": round(kl(base_rt, rt), 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant-samples", type=int, default=16, help="calibration blocks of the quantisers")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "moe")
    args = ap.parse_args()
    os.environ.setdefault("QUANTKIT_NO_PROGRESS", "1")
    import torch

    from bench_moe import quantize
    from common import bench_moe_model, write_results

    from quantkit.eval.runner import EvalOptions, run_eval

    started, load_before = time.time(), os.getloadavg()[0]
    qwen = bench_moe_model(args.work)
    glm = to_glm4_moe(qwen, args.work / "generic-glm4_moe")
    quant = {}
    for name, method in (("rtn", "rtn"), ("gptq", "gptq")):
        out = args.work / f"generic-glm4_moe-{name}"
        quant[name] = quantize(glm, out, method, "W4A16", "all", args.quant_samples, args.seq_len)
        print(f"quantised {name}: {quant[name]}", flush=True)
    # --moe: the routing studies replay the rule the runtime finds on glm4_moe's loaded router.
    from quantkit.eval.moe import MoEEvalOptions

    moe_opts = MoEEvalOptions(samples=min(2, args.eval_samples), offload_runs=(("lru", ""), ("lru", "overlap")))
    run = run_eval(EvalOptions(checkpoints=[args.work / f"generic-glm4_moe-{n}" for n in quant], baseline=str(glm),
                               num_samples=args.eval_samples, seq_len=args.seq_len, moe=True, moe_options=moe_opts))
    against_qwen = run_eval(EvalOptions(checkpoints=[glm], baseline=str(qwen), num_samples=args.eval_samples,
                                        seq_len=args.seq_len))
    from transformers import AutoTokenizer

    from quantkit.data.calibration import build_token_blocks

    tok = AutoTokenizer.from_pretrained(glm)
    ids = build_token_blocks(tok, "kjv", args.eval_samples, args.seq_len, seed=1234, split="heldout").input_ids
    consumers = consumer_kl({n: args.work / f"generic-glm4_moe-{n}" for n in quant}, glm, ids)
    payload = {"model": str(glm), "from": str(qwen), "quantize": quant,
               "eval": {n: r for n, r in zip(quant, run.report["results"])},
               "glm4_moe_vs_qwen2_moe": against_qwen.report["results"][0], "consumer_kl": consumers,
               "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "load_average": {"before": load_before, "after": os.getloadavg()[0]},
               "wall_seconds": round(time.time() - started, 1)}
    write_results("generic_moe", payload, render(payload, args))


def render(p: dict, args) -> str:
    from common import machine_line

    lines = ["# A MoE family without a described router, on real weights (glm4_moe)", "",
             f"{machine_line(p['load_average'])}; wall {p['wall_seconds']} s. The MoEfied SmolLM2 of bench_moe.py "
             f"(`{Path(p['from']).name}`) rewritten as `glm4_moe`; calibration {args.quant_samples} x {args.seq_len} "
             f"KJV tokens, W4A16 g32; eval {args.eval_samples} x {args.seq_len} held-out tokens against the "
             "unquantised glm4_moe model.", "",
             "| checkpoint | quantise s | routing profile | KL (`quantkit eval`) | top-1 agreement | KL in "
             "transformers / in the runtime, same tokens |", "|---|---|---|---|---|---|"]
    for n, q in p["quantize"].items():
        r, c = p["eval"][n], p["consumer_kl"][n]
        lines.append(f"| {n} | {q['seconds']} | {q['routing_profile']} | {r['kl_mean']:.4f} | "
                     f"{r['top1_agree']:.4f} | {c['kl_transformers']} / {c['kl_runtime']} |")
    lines += ["", "`quantkit eval --moe` on the same run (the rule the runtime found on the loaded glm4_moe router: "
                  "sigmoid scores ranked with the selection bias, normalised, shared experts); routing studies on the "
                  "first 2 eval blocks, offload at E/2 experts per layer resident, 32 greedy tokens after a 32-token "
                  "prompt, median of 3 decodes:", "",
              "| checkpoint | routing top-k overlap vs unquantised | max/mean load | capacity 1.25 drop: KL change, "
              "load cut | bias balancing: max/mean load, KL | offload LRU hit rate, tok/s | LRU + prefetch hit rate, "
              "tok/s | offload exact |", "|---|---|---|---|---|---|---|---|"]
    for n in p["quantize"]:
        m = p["eval"][n]["moe"]
        cap = next(c for c in m["capacity"] if c["gamma"] == 1.25 and c["policy"] == "drop")
        bias = m["bias_balancing"]
        runs = {r["policy"]: r for r in m["offload"]}
        lru, pre = runs["lru"], runs["lru+prefetch"]
        lines.append(f"| {n} | {m['routing_topk_overlap']} | {m['max_over_mean_load']} | {cap['kl_change']:+.4f}, "
                     f"{cap['max_load_reduction']:.1%} | {bias['max_over_mean_load']['without']} -> "
                     f"{bias['max_over_mean_load']['with']}, {bias['kl']['without']} -> {bias['kl']['with']} | "
                     f"{lru['hit_rate']}, {lru['decode_tok_s']} | {pre['hit_rate']}, {pre['decode_tok_s']} | "
                     f"{all(r['exact'] for r in m['offload'])} |")
    q = p["glm4_moe_vs_qwen2_moe"]
    lines += ["", f"The glm4_moe model against the qwen2_moe one it was rewritten from: KL {q['kl_mean']:.4f}, "
                  f"top-1 agreement {q['top1_agree']:.4f} (sigmoid scores instead of softmax, no "
                  "shared-expert gate). transformers loads every checkpoint; it keeps the decompressed experts in "
                  "bf16 where the runtime computes in fp32, and one routing decision flipped by that rounding moves a "
                  "token's logits by whole units, so the two are compared by their KL on the same tokens.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
