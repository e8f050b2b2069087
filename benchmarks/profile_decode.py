"""Where a batch-1 decode token's time goes in quantkit's runtime: inside the linears (quantised kernels, dense
layers, the head), in attention outside its linears, in the MLP outside its linears (activation, product), and
everything else (embedding, norms, rotary, masks, the step's Python and the cache). One process per checkpoint;
forward pre/post hooks time each module (the hooks' own overhead lands in "everything else").

    .venv/bin/python benchmarks/profile_decode.py CKPT [CKPT ...]   # default: SmolLM2 bf16 and the bench's W4A16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, write_results

CHILD = r'''
import json, sys, time
from collections import defaultdict
import torch
sys.path.insert(0, sys.argv[2])
from quantkit.runtime.model import load_model
from quantkit.runtime.linear import QuantLinear
from quantkit.runtime.step import KVCache, step
rt = load_model(sys.argv[1])
net = rt.model
spent = defaultdict(float)
stack = []

def pre(name):
    def fn(m, a):
        stack.append(time.perf_counter())
    return fn

def post(name):
    def fn(m, a, o):
        spent[name] += time.perf_counter() - stack.pop()
    return fn

kinds = {}
for name, m in net.named_modules():
    if isinstance(m, (QuantLinear, torch.nn.Linear)):
        kind = "linear"
    elif name.endswith("self_attn"):
        kind = "attention"
    elif name.endswith(".mlp"):
        kind = "mlp"
    else:
        continue
    kinds[name] = kind
    m.register_forward_pre_hook(pre(name))
    m.register_forward_hook(post(name))

prompt = torch.arange(1, 33)[None]
n_tokens = int(sys.argv[3])
best = None
for _ in range(3):
    spent.clear()
    cache = KVCache()
    with torch.inference_mode():
        logits = step(rt, prompt, torch.arange(32)[None], cache, logits_to_keep=1)
        spent.clear()
        tok = logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for i in range(n_tokens):
            logits = step(rt, tok, torch.tensor([[32 + i]]), cache, logits_to_keep=1)
            tok = logits[:, -1].argmax(-1, keepdim=True)
        total = time.perf_counter() - t0
    lin = sum(v for k, v in spent.items() if kinds[k] == "linear")
    lin_in = lambda parent: sum(v for k, v in spent.items() if kinds[k] == "linear" and k.startswith(parent + "."))
    attn = sum(v - lin_in(k) for k, v in spent.items() if kinds[k] == "attention")
    mlp = sum(v - lin_in(k) for k, v in spent.items() if kinds[k] == "mlp")
    row = {"total_ms_per_token": 1e3 * total / n_tokens, "linears": lin / total, "attention_outside_linears": attn / total,
           "mlp_outside_linears": mlp / total, "everything_else": 1 - (lin + attn + mlp) / total}
    if best is None or row["total_ms_per_token"] < best["total_ms_per_token"]:
        best = row
best["kernels"] = rt.kernels
print(json.dumps(best))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoints", nargs="*", type=Path)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    import torch

    from quantkit.models.source import resolve_model

    ckpts = args.checkpoints or [resolve_model(None).path, ROOT / "benchmarks" / ".work" / "runtime" / "smollm2-W4A16"]
    payload = {"cpu": f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs",
               "load_average_before": os.getloadavg(), "rows": []}
    print(payload["cpu"], "load", payload["load_average_before"], flush=True)
    for ckpt in ckpts:
        r = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), str(ROOT), str(args.tokens)], capture_output=True,
                           text=True, check=True)
        row = {"checkpoint": Path(ckpt).name, **json.loads(r.stdout.strip().splitlines()[-1])}
        payload["rows"].append(row)
        print(row, flush=True)
    payload["load_average_after"] = os.getloadavg()
    md = ["# Decode at batch 1: where a token's time goes", "", payload["cpu"],
          f"load average before / after: {payload['load_average_before'][0]:.2f} / {payload['load_average_after'][0]:.2f}",
          f"{args.tokens} greedy tokens after a 32-token prompt, best of 3; module hooks time each part", "",
          "| checkpoint | ms / token | linears (incl. head) | attention outside linears | MLP outside linears | everything else | kernels |",
          "|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        kern = "; ".join(f"{k}: " + ", ".join(by) for k, by in r["kernels"].items())
        md.append(f"| {r['checkpoint']} | {r['total_ms_per_token']:.2f} | {r['linears']:.0%} | "
                  f"{r['attention_outside_linears']:.0%} | {r['mlp_outside_linears']:.0%} | {r['everything_else']:.0%} | {kern} |")
    write_results("profile_decode", payload, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
