"""Where vLLM's CPU build and transformers part ways on MLA attention (the convert-mla row of vllm_agreement.md).

    QUANTKIT_VLLM_PYTHON=benchmarks/.venv-vllm/bin/python .venv/bin/python benchmarks/mla_rope_isolation.py

Random 2-layer DeepSeek-V3 models made by transformers itself (no quantkit conversion), weights N(0, 0.05), scored
on the same 2 x 128 held-out KJV tokens by both engines in bf16: the per-token log-probability of the real next
token is compared. Variants switch parts of the attention off: all of it (o_proj zero), the RoPE part of the scores
(the RoPE rows of q and of the shared key zero), or the no-RoPE part (the nope rows of q zero). Dims: convert-mla's
SmolLM2 output (latent 288 + rope 32, nope/v 64, 9 heads) and DeepSeek-V3's own (512 + 64, nope/v 128).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import write_results  # noqa: E402

CONVERTED = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=9, kv_lora_rank=288, qk_rope_head_dim=32,
                 qk_nope_head_dim=64, v_head_dim=64, head_dim=32)
DEEPSEEK = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, qk_rope_head_dim=64,
                qk_nope_head_dim=128, v_head_dim=128, head_dim=64)


def make(out: Path, dims: dict, mode: str) -> Path:
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    from quantkit.models.source import resolve_model

    cfg = DeepseekV3Config(vocab_size=49152, intermediate_size=1536, moe_intermediate_size=1536, num_hidden_layers=2,
                           first_k_dense_replace=2, n_routed_experts=1, n_shared_experts=1, num_experts_per_tok=1,
                           q_lora_rank=None, rms_norm_eps=1e-6, rope_interleave=True, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **dims)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    nope, rope, r, heads = dims["qk_nope_head_dim"], dims["qk_rope_head_dim"], dims["kv_lora_rank"], dims["num_attention_heads"]
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
        for layer in model.model.layers:
            a = layer.self_attn
            q = a.q_proj.weight.view(heads, nope + rope, -1)
            if mode == "no attention":
                a.o_proj.weight.zero_()
            elif mode == "no RoPE part":
                q[:, nope:].zero_()
                a.kv_a_proj_with_mqa.weight[r:].zero_()
            elif mode == "RoPE part only":
                q[:, :nope].zero_()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(resolve_model(None).path)).save_pretrained(out)
    return out


def compare(folder: Path, blocks) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.eval.vllm_engine import score, vllm_python

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    hf = []
    with torch.no_grad():
        for b in blocks:
            ids = torch.tensor([b])
            lp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            hf += lp.gather(-1, ids[0, 1:, None])[:, 0].tolist()
    res = score(vllm_python(None), folder, blocks,
                SimpleNamespace(top_logprobs=1, tensor_parallel_size=1, throughput=False), "bfloat16")
    vl = torch.tensor([v for b in res["blocks"] for v in b["actual"]])
    d = (torch.tensor(hf) - vl).abs()
    return {"mean_abs_diff": float(d.mean()), "max_abs_diff": float(d.max()), "vllm_version": res["vllm_version"]}


def main() -> None:
    import torch
    from transformers import AutoTokenizer

    from quantkit.data.calibration import build_token_blocks
    from quantkit.models.source import resolve_model

    work = ROOT / "benchmarks" / ".work" / "mla_rope"
    tok = AutoTokenizer.from_pretrained(str(resolve_model(None).path))
    blocks = build_token_blocks(tok, "kjv", 2, 128, 42, split="heldout").input_ids.tolist()
    payload = {"cpu": f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs",
               "load_average_before": os.getloadavg(), "rows": []}
    plan = [("convert-mla dims", CONVERTED, m) for m in ("full attention", "no attention", "no RoPE part",
                                                           "RoPE part only")]
    plan += [("DeepSeek-V3 dims", DEEPSEEK, "RoPE part only")]
    for label, dims, mode in plan:
        folder = make(work / f"{label}-{mode}".replace(" ", "_"), dims, mode)
        row = {"dims": label, "variant": mode, **compare(folder, blocks)}
        payload["rows"].append(row)
        print(json.dumps(row), flush=True)
    payload["load_average_after"] = os.getloadavg()
    lines = ["# MLA attention: vLLM's CPU build against transformers, part by part", "",
             f"{payload['cpu']}; load average before {payload['load_average_before'][0]:.2f}, after "
             f"{payload['load_average_after'][0]:.2f}; vLLM {payload['rows'][0]['vllm_version']}; random 2-layer "
             "DeepSeek-V3 models made by transformers; |log p(next token)| differences over 254 positions, bf16.", "",
             "| dims | variant | mean abs diff | max abs diff |", "|---|---|---|---|"]
    lines += [f"| {r['dims']} | {r['variant']} | {r['mean_abs_diff']:.4f} | {r['max_abs_diff']:.4f} |"
              for r in payload["rows"]]
    write_results("mla_rope_isolation", payload, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
