"""QSPEC's W4A8 draft on int8 codes: where the integer kernel wins and where it cannot, at batch 1, 8 and 32.

    .venv/bin/python benchmarks/bench_qspec.py [--prompts 4] [--max-new-tokens 64] [--repeats 15]

Target: SmolLM2's W4A16 g64 GPTQ checkpoint (made here, kept in the work folder). Its draft, `self:W4A8`, is the
same checkpoint with every decoder linear's input quantised per token to int8. Three ways to run a linear, timed in
one process, interleaved, median of `--repeats`:

- `w4a16`: the target's own kernel on bf16 x (the integer-dot GEMV takes x in 16-bit fixed point: two
  multiply-adds per weight byte; past 16 rows, dequantise + BLAS);
- `w4a8 fake`: the input fake-quantised (quantise, dequantise) in front of that same kernel (the draft before);
- `w4a8 codes`: `run_int8_tokens`, the integer-dot GEMV on the int8 codes (one multiply-add per weight byte, any
  number of rows).

1. Linears: each distinct decoder linear shape of the checkpoint at M = 1, 8, 32 rows.
2. Whole steps on the runtime: the target's decode step and the draft's, for B sequences of 48 held-out tokens at
   once (B = 1, 8, 32), and the target's verify step of B x (k + 1) tokens.
3. Speculative decoding at batch 1 (the runtime's speculative loop decodes one sequence): `self:W4A8` with the
   draft on codes and on fake-quant, chain k = 4, greedy, against plain decoding of the same target, held-out and
   chat prompts.
4. Batches 8 and 32 are projected from part 2's step times and part 3's accepted length L: speed-up =
   L x T_target / (k x T_draft + T_verify). The same formula at batch 1 is printed beside part 3's measured
   speed-up, so the projection's own error can be read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench_speculative import quantize
from common import ROOT, machine_line, prepare_run, write_results

BATCHES = (1, 8, 32)


def _median_us(fns: dict, repeats: int, around: dict | None = None) -> dict[str, float]:
    """Median microseconds per call of each function, the functions interleaved (one call each per round).
    `around[name]`: a context manager factory entered before that function's call and left after it, untimed."""
    from contextlib import nullcontext

    around = around or {}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for rnd in range(repeats + 1):
        for k, f in fns.items():
            with around.get(k, nullcontext)():
                t0 = time.perf_counter()
                f()
                dt = time.perf_counter() - t0
            if rnd:  # the first round warms up
                times[k].append(dt * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def linear_rows(rt, repeats: int) -> list[dict]:
    import torch

    from quantkit.quant.args import QuantArgs
    from quantkit.quant.activations import quantize_activation
    from quantkit.runtime.kernels.cpp import IntDotKernel
    from quantkit.runtime.linear import QuantLinear

    args = QuantArgs(num_bits=8, strategy="token", dynamic=True)
    shapes: dict[tuple, tuple] = {}
    counts: dict[tuple, int] = {}
    for name, m in rt.model.named_modules():
        if isinstance(m, QuantLinear) and ".layers." in name:
            key = (name.rsplit(".", 1)[-1], m.out_features, m.in_features, m.kernel_name)
            shapes.setdefault(key, m)
            counts[key] = counts.get(key, 0) + 1
    rows = []
    gen = torch.Generator().manual_seed(0)
    for key, m in shapes.items():
        for rows_m in BATCHES:
            x = torch.randn(rows_m, m.in_features, generator=gen).bfloat16()
            fns = {"w4a16": lambda: m(x), "w4a8 fake": lambda: m(quantize_activation(x, args))}
            if isinstance(m.kernel, IntDotKernel):
                fns["w4a8 codes"] = lambda: m.kernel.run_int8_tokens(x, m.prepared, args)
            with torch.inference_mode():
                t = _median_us(fns, repeats)
            rows.append({"linear": key[0], "out": key[1], "in": key[2], "kernel": key[3], "layers": counts[key],
                         "rows": rows_m, "us": t})
            print("linear", key, rows_m, {k: round(v, 1) for k, v in t.items()}, flush=True)
    return rows


def step_rows(rt, prompts: list[list[int]], k: int, repeats: int) -> list[dict]:
    import torch

    from quantkit.runtime.speculative.drafts import quantized_activations
    from quantkit.runtime.step import KVCache, prefill, step

    out = []
    for b in BATCHES:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        cache = KVCache()
        pre = prefill(rt, batch, cache)
        base = cache.length
        nxt = pre.logits.argmax(-1)[:, None]
        pos = pre.next_positions[:, None]
        chain = nxt.repeat(1, k + 1)
        chain_pos = pos + torch.arange(k + 1)[None]

        def run(tokens, positions):
            def f():
                step(rt, tokens, positions, cache)
                cache.crop(base)
            return f

        # The draft mode is entered once per drafted tree (ModelDraft.propose), not per step: outside the timing.
        t = _median_us({"target decode": run(nxt, pos), "draft codes": run(nxt, pos), "draft fake": run(nxt, pos),
                        f"target verify k+1={k + 1}": run(chain, chain_pos)}, repeats,
                       {"draft codes": lambda: quantized_activations(rt, 8, integer=True),
                        "draft fake": lambda: quantized_activations(rt, 8, integer=False)})
        out.append({"batch": b, "us": t})
        print("step", b, {n: round(v) for n, v in t.items()}, flush=True)
    return out


def spec_rows(rt, prompts: list[list[int]], new_tokens: int, k: int) -> dict:
    from quantkit.runtime.speculative import SpecConfig, parse_tree, self_draft, speculative_generate
    from quantkit.runtime.speculative.decode import plain_generate

    cfg = SpecConfig(tree=parse_tree("chain", k), max_new_tokens=new_tokens)
    res: dict[str, dict] = {}
    for rnd in range(2):  # two rounds, modes in turn; each mode's figure is its better round
        for mode in ("plain", "codes", "fake"):
            n, wall, accepted, steps, same = 0, 0.0, 0, 0, 0
            plain_out = res.get("plain", {}).get("outputs")
            outs = []
            for i, p in enumerate(prompts):
                if mode == "plain":
                    toks, s = plain_generate(rt, p, new_tokens)
                else:
                    d = self_draft(rt, "W4A8")
                    d.integer_activations = mode == "codes"
                    r = speculative_generate(rt, d, p, cfg)
                    toks, s = r.tokens, r.wall_seconds
                    accepted, steps = accepted + r.accepted, steps + r.steps
                    same += plain_out is not None and toks == plain_out[i]
                outs.append(toks)
                n, wall = n + len(toks), wall + s
            row = {"tokens_per_s": n / wall, "generated": n, "outputs": outs}
            if mode != "plain":
                row.update(mean_accepted_length=1 + accepted / steps, same_as_plain=same)
            if mode not in res or row["tokens_per_s"] > res[mode]["tokens_per_s"]:
                res[mode] = row
            print("spec", rnd, mode, round(row["tokens_per_s"], 2), row.get("mean_accepted_length"), flush=True)
    for mode in ("codes", "fake"):
        res[mode]["speedup"] = res[mode]["tokens_per_s"] / res["plain"]["tokens_per_s"]
    for r in res.values():
        r.pop("outputs")
    return res


def projection(step: dict, length: float, k: int, draft: str) -> float:
    t = step["us"]
    return length * t["target decode"] / (k * t[draft] + t[f"target verify k+1={k + 1}"])


def markdown(p: dict) -> str:
    k = p["k"]
    lines = ["# QSPEC: the W4A8 draft on int8 codes", "", f"{p['machine']}; SmolLM2-135M W4A16 g64 GPTQ; "
             f"microseconds, median of {p['repeats']} interleaved calls", "",
             "## Decoder linears (one call)", "",
             "| linear | out x in | served by | rows | w4a16 | w4a8 fake | w4a8 codes | codes vs w4a16 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in p["linears"]:
        u = r["us"]
        codes = u.get("w4a8 codes")
        lines.append(f"| {r['linear']} (x{r['layers']}) | {r['out']} x {r['in']} | {r['kernel']} | {r['rows']} | "
                     f"{u['w4a16']:.0f} | {u['w4a8 fake']:.0f} | " + ("-" if codes is None else f"{codes:.0f}")
                     + " | " + ("-" if codes is None else f"{u['w4a16'] / codes:.2f}x") + " |")
    lines += ["", "## Whole steps (B sequences, 48 cached tokens each)", "",
              f"| B | target decode | draft on codes | draft fake | target verify (k+1 = {k + 1}) | draft / target, "
              "codes | draft / target, fake |", "|---|---|---|---|---|---|---|"]
    for s in p["steps"]:
        t = s["us"]
        lines.append(f"| {s['batch']} | {t['target decode']:.0f} | {t['draft codes']:.0f} | {t['draft fake']:.0f} | "
                     f"{t[f'target verify k+1={k + 1}']:.0f} | {t['draft codes'] / t['target decode']:.3f} | "
                     f"{t['draft fake'] / t['target decode']:.3f} |")
    sp = p["speculative"]
    lines += ["", f"## Speculative decoding, batch 1 (chain k = {k}, greedy, {p['prompts']} prompts x "
              f"{p['new_tokens']} new tokens)", "",
              "| draft | tok/s | speed-up over plain | mean accepted length | outputs equal to plain (bf16) |",
              "|---|---|---|---|---|",
              f"| plain decoding | {sp['plain']['tokens_per_s']:.2f} | 1.000x | - | - |"]
    for mode in ("codes", "fake"):
        r = sp[mode]
        lines.append(f"| self:W4A8 on {mode} | {r['tokens_per_s']:.2f} | {r['speedup']:.3f}x | "
                     f"{r['mean_accepted_length']:.2f} | {r['same_as_plain']}/{p['prompts']} |")
    lines += ["", "## Projected speed-up at batch B (from the step times and batch 1's accepted length)", "",
              "| B | draft on codes | draft fake |", "|---|---|---|"]
    for s in p["steps"]:
        lines.append(f"| {s['batch']} | {s['projected']['codes']:.3f}x | {s['projected']['fake']:.3f}x |")
    b1 = p["steps"][0]["projected"]
    lines += ["", f"Check of the projection at batch 1: it gives {b1['codes']:.3f}x (codes) / {b1['fake']:.3f}x (fake) "
              f"where decoding measured {sp['codes']['speedup']:.3f}x / {sp['fake']['speedup']:.3f}x (it leaves out "
              "the loop's own work: sampling, cache crops, the draft's catch-up of the tokens verify accepted).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="prompts of each kind (held-out KJV, chat) for part 3")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "qspec")
    ap.add_argument("--results", default="qspec")
    args = ap.parse_args()
    model, tok = prepare_run(None, args.work / "scratch")
    import torch

    from quantkit.eval.speculative import load_prompts
    from quantkit.runtime import load_model

    load = {"before": os.getloadavg()[0]}
    ckpt = quantize(model, "gptq", args.work / "w4a16-gptq", args.calib_samples)
    rt = load_model(ckpt, torch.bfloat16, "cpu")
    prompts = load_prompts("builtin", tok)
    kjv = prompts[:32]
    chosen = prompts[: args.prompts] + prompts[32 : 32 + args.prompts]
    payload = {"k": args.k, "repeats": args.repeats, "prompts": len(chosen), "new_tokens": args.max_new_tokens,
               "kernels": rt.kernels}
    payload["linears"] = linear_rows(rt, args.repeats)
    payload["steps"] = step_rows(rt, kjv, args.k, args.repeats)
    payload["speculative"] = spec_rows(rt, chosen, args.max_new_tokens, args.k)
    for mode in ("codes", "fake"):
        length = payload["speculative"][mode]["mean_accepted_length"]
        for s in payload["steps"]:
            s.setdefault("projected", {})[mode] = projection(s, length, args.k, f"draft {mode}")
    load["after"] = os.getloadavg()[0]
    payload["machine"] = machine_line(load)
    payload["load_average"] = load
    write_results(args.results, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
