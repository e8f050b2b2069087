"""Which transformers architectures quantkit quantises, and whether two consumers agree on the result: a tiny random
model of each family (no hub access: built from transformers' own config class) through `quantkit quantize`
(GPTQ and AWQ W4A16 g16, 8 x 64 KJV tokens), then the checkpoint loaded by transformers and by quantkit's runtime.

    .venv/bin/python benchmarks/architecture_sweep.py [FAMILY ...]

Per family and method: the exit status (or the one-line refusal), the relative change of the logits against the
unquantised model in transformers (4-bit weights on a random model: tenths), and the largest difference between
the runtime's logits and transformers' on the same checkpoint, relative to the largest logit (in fp32 both
dequantise to the same weights and run the same torch ops, so 0 is what agreement looks like).
Results: benchmarks/results/architectures.md and .json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MOE = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2}
FAMILIES = {  # overrides on top of the tests' tiny sizes; unregistered families unless noted
    "gemma2": {"head_dim": 16},  # registered; softcapped attention
    "phi3": {}, "olmo2": {}, "granite": {}, "cohere": {}, "stablelm": {}, "starcoder2": {}, "gpt_neox": {},
    "opt": {}, "phi": {}, "glm4": {}, "exaone4": {}, "smollm3": {}, "helium": {"head_dim": 16}, "falcon": {},
    "gpt2": {}, "olmoe": MOE, "gpt_oss": MOE,
    # sparse MoE without a described router (their own routers route; experts inferred from the checkpoint)
    "glm4_moe": {**MOE, "n_routed_experts": 4, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
                 "topk_group": 1, "head_dim": 16},
    "hunyuan_v1_moe": {"num_experts": 4, "moe_topk": 2, "head_dim": 16},
    "exaone_moe": {**MOE, "moe_intermediate_size": 32, "head_dim": 16},
    "ernie4_5_moe": {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32, "moe_layer_start_index": 1},
    "phimoe": MOE, "minimax_m2": {**MOE, "head_dim": 16}, "cohere2_moe": {**MOE, "moe_intermediate_size": 32},
    "afmoe": {**MOE, "moe_intermediate_size": 32},
    "deepseek_v2": {**MOE, "n_routed_experts": 4, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                    "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                    "v_head_dim": 16, "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "num_key_value_heads": 4},
    "dots1": {**MOE, "n_routed_experts": 4, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
              "topk_group": 1, "head_dim": 16},
    "flex_olmo": MOE, "granitemoe": MOE, "jamba": MOE,
    # from a survey of every decoder family transformers 5.25 builds (2026-12-07): each needed a fix, or is refused
    "bloom": {}, "exaone": {}, "falcon_h1": {"head_dim": 16}, "dory": {},
    "laguna": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
    "mimo_v2_flash": {**MOE, "n_routed_experts": 4, "moe_intermediate_size": 32, "head_dim": 16, "n_group": 1,
                      "topk_group": 1},
    "nemotron_h": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
}
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
VLMS = {  # vision-language: config kwargs (text decoder quantised, vision tower kept)
    "gemma3": dict(text_config={**TEXT, "head_dim": 16}, vision_config=SIGLIP, mm_tokens_per_image=4),
    "qwen2_vl": dict(text_config={**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
                     vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)),
    "mistral3": dict(text_config={**TEXT, "model_type": "mistral", "head_dim": 16},
                     vision_config={**SIGLIP, "head_dim": 16}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", default=[*FAMILIES, *VLMS])
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "architectures")
    args = ap.parse_args()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from common import check_consumers, consumer_cells, machine_line, write_results
    from quantkit.data.calibration import load_documents
    from tests.conftest import _write_tokenizer, make_tiny_model

    args.work.mkdir(parents=True, exist_ok=True)
    text = args.work / "calib.txt"
    text.write_text("\n\n".join(load_documents("kjv")[:200]))
    env = {**os.environ, "QUANTKIT_NO_PROGRESS": "1", "QUANTKIT_CACHE": str(args.work / "cache")}
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    load = {"before": os.getloadavg()[0]}
    rows = []
    for family in args.families:
        src = args.work / family
        overrides = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **FAMILIES.get(family, {})}
        auto = AutoModelForImageTextToText if family in VLMS else AutoModelForCausalLM
        try:
            if family in VLMS:
                torch.manual_seed(0)
                auto.from_config(AutoConfig.for_model(family, **VLMS[family])).save_pretrained(src)
                _write_tokenizer(src, 256)
            else:
                make_tiny_model(src, family, **overrides)
        except Exception as exc:  # the config class refuses these sizes: not quantkit's verdict
            rows.append({"family": family, "method": "-", "result": f"not built: {str(exc).splitlines()[0][:120]}"})
            continue
        try:
            with torch.no_grad():
                source = auto.from_pretrained(src, dtype=torch.float32)(input_ids=ids).logits
        except Exception as exc:  # transformers itself cannot run the unquantised model at these sizes
            rows.append({"family": family, "method": "-",
                         "result": f"transformers fails: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"})
            continue
        for method in ("gptq", "awq"):
            out = args.work / f"{family}-{method}"
            proc = subprocess.run([str(ROOT / ".venv" / "bin" / "quantkit"), "quantize", "--model", str(src),
                                   "--method", method, "--scheme", "W4A16", "--group-size", "16", "--dataset",
                                   str(text), "--num-samples", "8", "--seq-len", "64", "--output", str(out),
                                   "--overwrite", "--json"], capture_output=True, text=True, env=env)
            row = {"family": family, "method": method}
            if proc.returncode != 0:
                row["result"] = f"exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:160]
                rows.append(row)
                continue
            row.update(result="quantised", **check_consumers(out, ids, source, auto))
            rows.append(row)
        print(rows[-1], flush=True)

    load["after"] = os.getloadavg()[0]
    lines = ["# Architectures: tiny random models through quantize, transformers and quantkit's runtime", "",
             machine_line(load), "", "`benchmarks/architecture_sweep.py`; transformers "
             + __import__("transformers").__version__ + ".", "",
             "| family | method | result | logits vs unquantised (rel. L2) | runtime vs transformers (max rel.) | "
             "note |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['method']} | {r['result']} | {consumer_cells(r)} |" for r in rows]
    write_results("architectures", {"rows": rows, "load": load}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
