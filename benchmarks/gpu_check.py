"""One prepared GPU check of csrc/ (issue #16): parity of every kernel and shape class with the torch
reference, timings, and decode tokens/s. Run through benchmarks/gpu_check.sh (< 8 minutes on an H200).

Needs CUDA torch and quantkit-llm[cuda] in the running environment. Timings: CUDA events around each run after
warm-up, median of 30; between runs a 2x-L2-sized buffer is written (L2 flush) and weight copies are rotated
so that the copies together exceed 2x the L2 (every run reads its weights from HBM). Bandwidth is reported in
GB/s and as % of a measured device-to-device copy; compute in TFLOPS and as % of the device's dense peak
(table below; unknown devices get the measured torch bf16 matmul as the yardstick instead).

`--dry-run` runs the whole script on the CPU with the reference standing in for every kernel: it checks the
script itself (layer construction, bookkeeping, JSON), not any kernel.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.runtime import reference  # noqa: E402
from quantkit.runtime.cuda.synthetic import make_layer  # noqa: E402

# Dense peaks (TFLOPS, no sparsity) from NVIDIA's datasheets: bf16, fp8, int8.
PEAKS = {"H200": {"bf16": 989.4, "fp8": 1978.9, "int8": 1978.9}, "H100 80GB HBM3": {"bf16": 989.4, "fp8": 1978.9, "int8": 1978.9},
         "A100": {"bf16": 312.0, "int8": 624.0}, "L40S": {"bf16": 362.1, "fp8": 733.0, "int8": 733.0}}
TOL = {"w4a16": 1e-2, "w8a16": 1e-2, "int8": 3e-2, "fp8": 3e-2}


class Ctx:
    def __init__(self, dry: bool):
        self.dry = dry
        self.dev = torch.device("cpu" if dry else "cuda")
        self.l2 = 0 if dry else getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
        self.flush = torch.empty(max(2 * self.l2, 1 << 20), dtype=torch.uint8, device=self.dev)
        self.reps = 3 if dry else 30
        self.results: dict = {"parity": [], "timing": [], "decode": [], "notes": []}

    def sync(self):
        if not self.dry:
            torch.cuda.synchronize()

    def time_ms(self, fn, copies: list) -> float:
        """Median ms of fn(copy) over rotating copies, L2 flushed before each timed run.

        Warm-up touches every copy (so one-time prepare/compile never lands in a timed run). Each timed run
        is queued behind a GPU spin (torch.cuda._sleep) so the host's launch overhead is hidden and the
        events bracket GPU time only."""
        for i in range(max(3 if self.dry else 5, len(copies))):
            fn(copies[i % len(copies)])
        if self.dry:
            times = []
            for i in range(self.reps):
                self.flush.zero_()
                t0 = time.perf_counter()
                fn(copies[i % len(copies)])
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        self.sync()
        events = []
        for i in range(self.reps):
            self.flush.zero_()
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU spin: the launches below are queued before it ends
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(copies[i % len(copies)])
            e.record()
            events.append((s, e))
        self.sync()
        return statistics.median(s.elapsed_time(e) for s, e in events)

    def save(self) -> None:
        """Write what is known so far to $OUT/gpu_check.json (a run cut by the time limit still leaves data)."""
        out_dir = os.environ.get("OUT")
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "gpu_check.json").write_text(json.dumps(self.results, indent=1, default=str))

    def n_copies(self, nbytes: int) -> int:
        return max(1, math.ceil(2 * self.l2 / max(nbytes, 1)) + 1) if not self.dry else 1


# ---------------------------------------------------------------- layers of every format and shape class

def kernel_call(ctx: Ctx, kind: str):
    """fn(x, layer) through the CUDA kernel (raises if it would fall back: parity must test the kernel)."""
    if ctx.dry:
        return reference.linear
    from quantkit.runtime.cuda.kernels import KERNELS, dispatch_fn

    kern = KERNELS[kind]
    fn = dispatch_fn(kern)

    def call(x, layer):
        if not kern.supports(layer.fmt, x.device, (layer.out_features, layer.in_features)):
            raise RuntimeError(f"{kern.name} does not support this case")
        return fn(x, layer)
    return call


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def parity(ctx: Ctx):
    cases = []
    for kind in ("w4a16", "w8a16"):
        for m in (1, 7, 16, 17, 64, 300):
            cases.append((kind, dict(), 4096 if m < 64 else 1024, 1024, m, torch.bfloat16))
        cases += [(kind, dict(sym=False), 1000, 2048, 5, torch.bfloat16), (kind, dict(sym=False), 1000, 2048, 80, torch.bfloat16),
                  (kind, dict(actorder=True), 512, 1024, 3, torch.bfloat16), (kind, dict(actorder=True, sym=False), 512, 1024, 70, torch.bfloat16),
                  (kind, dict(strategy="channel"), 200, 328, 9, torch.bfloat16), (kind, dict(strategy="channel"), 200, 328, 129, torch.bfloat16),
                  (kind, dict(group=32), 256, 512, 2, torch.float16), (kind, dict(group=64, scale_dtype=torch.float16), 256, 512, 65, torch.float16)]
    for m in (1, 33, 512):
        cases.append(("int8", dict(), 1000, 2048, m, torch.bfloat16))
    cases.append(("int8", dict(scale_dtype=torch.float16), 256, 512, 40, torch.float16))
    for m, n, k in ((1, 1024, 1024), (130, 1000, 2048), (64, 256, 300), (7, 200, 4000), (200, 384, 7168)):
        cases.append(("fp8", dict(), n, k, m, torch.bfloat16))
    cases.append(("fp8", dict(), 256, 512, 70, torch.float16))
    for i, (kind, kw, n, k, m, dtype) in enumerate(cases):
        layer = make_layer(kind, n, k, ctx.dev, seed=i, **kw)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + i)).to(dtype).to(ctx.dev)
        row = {"kind": kind, "m": m, "n": n, "k": k, "dtype": str(dtype).split(".")[-1], **{a: str(b) for a, b in kw.items()}}
        try:
            out = kernel_call(ctx, kind)(x, layer)
            ref = reference.linear(x, layer)
            row["rel_err"] = rel_err(out, ref)
            row["ok"] = row["rel_err"] <= TOL[kind]
        except Exception as e:  # report and go on: one broken case must not hide the others
            row.update(ok=False, error=f"{type(e).__name__}: {e}")
        ctx.results["parity"].append(row)
    parity_ops(ctx)


def parity_ops(ctx: Ctx):
    from quantkit.runtime.cuda import kernels as K

    res = ctx.results["parity"]
    # MoE: 8 W4A16 experts, top-2, gate/up (one row per token) and down (one row per choice, weighted).
    for t, sym in ((1, True), (37, False), (300, True)):
        row = {"kind": "moe-w4a16", "tokens": t, "sym": sym}
        try:
            experts = [make_layer("w4a16", 256, 512, ctx.dev, sym=sym, seed=50 + e) for e in range(8)]
            g = torch.Generator().manual_seed(t)
            ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)]).to(ctx.dev)
            x = torch.randn(t, 512, generator=g).to(torch.bfloat16).to(ctx.dev)
            w = torch.rand(t, 2, generator=g).to(ctx.dev)
            dense = [reference.dequantize_weight(l) for l in experts]
            ref = K.moe_gemm_reference(x, dense, ids)
            ref_down = K.moe_gemm_reference(ref[:, :256].contiguous().repeat(1, 2), dense, ids, w)
            if ctx.dry:
                out, out_down = ref, ref_down
            else:
                prep = K.prepare_moe_experts(experts, 4)
                out = K.moe_gemm(x, prep, ids)
                out_down = K.moe_gemm(ref[:, :256].contiguous().repeat(1, 2), prep, ids, w, rows_per_token=1)
            row["rel_err"] = max(rel_err(out, ref), rel_err(out_down, ref_down))
            row["ok"] = row["rel_err"] <= 1e-2
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {e}")
        res.append(row)
    # MLA decode: DeepSeek-V3 (576 / 512, 128 and 16 heads) and a convert-mla shape (96 + 32, 9 heads).
    for b, h, d, dv, lens in ((2, 16, 576, 512, [1, 1000]), (3, 128, 576, 512, [4096, 17, 333]), (2, 9, 128, 96, [50, 2048])):
        row = {"kind": "mla-decode", "b": b, "h": h, "d": d, "dv": dv, "lens": lens}
        try:
            g = torch.Generator().manual_seed(d + h)
            q = (torch.randn(b, h, d, generator=g) * 0.1).to(torch.bfloat16).to(ctx.dev)
            cache = torch.randn(b, max(lens), d, generator=g).to(torch.bfloat16).to(ctx.dev)
            sl = torch.tensor(lens, dtype=torch.int32, device=ctx.dev)
            ref = K.mla_decode_reference(q, cache, sl, dv, scale=d ** -0.5)
            out = ref if ctx.dry else K.mla_decode(q, cache, sl, dv, scale=d ** -0.5)
            row["rel_err"] = rel_err(out, ref)
            row["ok"] = row["rel_err"] <= 2e-2
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {e}")
        res.append(row)
    # Tree mask: exact.
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, -1, 6, 7, 3])
    row = {"kind": "tree-mask", "t": 10, "prefix": 7}
    try:
        ref = K.tree_mask_reference(parents, 7)
        out = ref if ctx.dry else K.tree_mask(parents.to(ctx.dev), 7).cpu()
        row["ok"] = bool(torch.equal(out, ref))
    except Exception as e:
        row.update(ok=False, error=f"{type(e).__name__}: {e}")
    res.append(row)


# ---------------------------------------------------------------- timings

def copy_bandwidth(ctx: Ctx) -> float:
    n = (1 << 30) if not ctx.dry else (1 << 24)
    a = torch.empty(n, dtype=torch.uint8, device=ctx.dev)
    b = torch.empty_like(a)
    ms = ctx.time_ms(lambda _: b.copy_(a), [None])
    gbs = 2 * n / ms / 1e6
    ctx.results["copy_GBps"] = gbs
    return gbs


def bf16_peak(ctx: Ctx) -> dict:
    name = "cpu" if ctx.dry else torch.cuda.get_device_name(0)
    for key, peaks in PEAKS.items():
        if key in name:
            return dict(peaks, source=f"datasheet ({key})")
    s = 8192 if not ctx.dry else 256
    a = torch.randn(s, s, dtype=torch.bfloat16, device=ctx.dev)
    ms = ctx.time_ms(lambda _: a @ a, [None])
    return {"bf16": 2 * s ** 3 / ms / 1e9, "source": "measured torch bf16 matmul (unknown device)"}


def weight_bytes(layer) -> int:
    return sum(t.numel() * t.element_size() for name in ("weight_packed", "weight", "weight_scale", "weight_zero_point")
               if (t := getattr(layer, name, None)) is not None)


def timings(ctx: Ctx, copy_gbs: float, peaks: dict):
    shapes = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]
    plan = [("w4a16", m, s) for s in shapes for m in (1, 16)] + [("w8a16", 1, s) for s in shapes[:2]]
    plan += [("w4a16", 4096, (4096, 4096)), ("int8", 1, (4096, 4096)), ("int8", 4096, (4096, 4096)),
             ("int8", 4096, (14336, 4096)), ("fp8", 1, (7168, 7168)), ("fp8", 4096, (7168, 7168)),
             ("fp8", 4096, (4096, 4096))]
    if ctx.dry:
        plan = [(k, min(m, 64), (256, 256)) for k, m, _ in plan[:3]]
    for kind, m, (n, k) in plan:
        row = {"kind": kind, "m": m, "n": n, "k": k}
        try:
            layer = make_layer(kind, n, k, ctx.dev)
            copies = [layer] + [make_layer(kind, n, k, ctx.dev, seed=s) for s in range(1, ctx.n_copies(weight_bytes(layer)))]
            x = torch.randn(m, k, dtype=torch.bfloat16, device=ctx.dev)
            call = kernel_call(ctx, kind)
            ms = ctx.time_ms(lambda l: call(x, l), copies)
            dense = [torch.randn(n, k, dtype=torch.bfloat16, device=ctx.dev) for _ in range(ctx.n_copies(2 * n * k))]
            ms_bf16 = ctx.time_ms(lambda w: F.linear(x, w), dense)
            nbytes = weight_bytes(layer) + 2 * m * (n + k)
            row.update(ms=ms, torch_bf16_ms=ms_bf16, speedup_vs_bf16=ms_bf16 / ms, GBps=nbytes / ms / 1e6,
                       pct_copy=100 * nbytes / ms / 1e6 / copy_gbs, TFLOPS=2 * m * n * k / ms / 1e9)
            peak = peaks.get("bf16" if kind in ("w4a16", "w8a16") else kind)
            if peak:
                row["pct_peak"] = 100 * row["TFLOPS"] / peak
            del copies, dense
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
        ctx.results["timing"].append(row)
        if not ctx.dry:
            torch.cuda.empty_cache()
    mla_timing(ctx, copy_gbs)


def mla_timing(ctx: Ctx, copy_gbs: float):
    from quantkit.runtime.cuda import kernels as K

    b, h, d, dv, s = (32, 128, 576, 512, 4096) if not ctx.dry else (2, 16, 576, 512, 64)
    row = {"kind": "mla-decode", "b": b, "h": h, "s": s}
    try:
        q = torch.randn(b, h, d, dtype=torch.bfloat16, device=ctx.dev) * 0.05
        caches = [torch.randn(b, s, d, dtype=torch.bfloat16, device=ctx.dev) for _ in range(ctx.n_copies(b * s * d * 2))]
        lens = torch.full((b,), s, dtype=torch.int32, device=ctx.dev)
        fn = (lambda c: K.mla_decode_reference(q, c, lens, dv)) if ctx.dry else (lambda c: K.mla_decode(q, c, lens, dv))
        ms = ctx.time_ms(fn, caches)
        nbytes = b * s * d * 2
        row.update(ms=ms, GBps=nbytes / ms / 1e6, pct_copy=100 * nbytes / ms / 1e6 / copy_gbs)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
    ctx.results["timing"].append(row)


# ---------------------------------------------------------------- decode tokens/s

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)


def quantise_linears(model, kind: str, dev):
    """Replace every decoder nn.Linear by a random QuantLinear of `kind` (decode speed depends on shapes only)."""
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear) and "lm_head" not in f"{name}.{child_name}":
                n, k = child.weight.shape
                group = 128 if k % 128 == 0 else 64
                setattr(mod, child_name, make_layer(kind, n, k, dev, group=group))
                del child


def decode_speed(ctx: Ctx):
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from quantkit.runtime.generate import generate

    models = []
    try:
        from quantkit.models.source import resolve_model

        models.append(("SmolLM2-135M", AutoConfig.from_pretrained(resolve_model(None).path)))
    except Exception as e:
        ctx.results["notes"].append(f"SmolLM2 config not found ({e}); using its published shape")
        models.append(("SmolLM2-135M", LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)))
    if not ctx.dry:
        models.append(("random Llama 8B shape", LlamaConfig(**LLAMA_8B)))
    steps = 32 if not ctx.dry else 3
    for name, cfg in models:
        for kind in ("bf16", "w4a16", "w8a16", "int8", "fp8"):
            row = {"model": name, "format": kind}
            try:
                torch.set_default_dtype(torch.bfloat16)  # build in bf16 directly (an fp32 8B would be 32 GB)
                try:
                    with torch.device(ctx.dev):
                        model = LlamaForCausalLM(cfg).eval()
                finally:
                    torch.set_default_dtype(torch.float32)
                if kind != "bf16":
                    quantise_linears(model, kind, ctx.dev)
                ids = torch.randint(0, cfg.vocab_size, (1, 16), device=ctx.dev)
                with torch.inference_mode():
                    generate(model, ids, 4)  # warm-up: compiles, loads modules, prepares
                    r = generate(model, ids, steps + 1)
                row.update(tokens_per_s=r.decode_steps / r.decode_seconds)
                del model
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
            ctx.results["decode"].append(row)
            if not ctx.dry:
                torch.cuda.empty_cache()
        base = next((r["tokens_per_s"] for r in ctx.results["decode"] if r["model"] == name and r["format"] == "bf16"
                     and "tokens_per_s" in r), None)
        for r in ctx.results["decode"]:
            if r["model"] == name and base and "tokens_per_s" in r:
                r["vs_bf16"] = r["tokens_per_s"] / base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke test of this script (reference stands in)")
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    if not args.dry_run:
        from quantkit.runtime.cuda import availability, register

        ok, line = availability()
        if not ok:
            print(f"gpu_check: {line}")
            return 2
        register()
    ctx = Ctx(args.dry_run)
    info = {"device": "cpu (dry run)" if ctx.dry else torch.cuda.get_device_name(0), "torch": torch.__version__}
    if not ctx.dry:
        from quantkit.runtime.cuda.nvrtc import nvrtc_version

        info.update(capability=list(torch.cuda.get_device_capability()), nvrtc=list(nvrtc_version()), l2_bytes=ctx.l2)
    ctx.results["info"] = info
    parity(ctx)
    ctx.save()
    copy_gbs = copy_bandwidth(ctx)
    peaks = bf16_peak(ctx)
    ctx.results["peaks_TFLOPS"] = peaks
    timings(ctx, copy_gbs, peaks)
    ctx.save()
    if not args.skip_decode:
        decode_speed(ctx)
    ctx.results["seconds"] = time.time() - t0
    bad = [r for r in ctx.results["parity"] if not r.get("ok")]
    ctx.results["parity_failures"] = len(bad)
    ctx.save()
    print(json.dumps(ctx.results, indent=1, default=str))
    print(f"gpu_check: {len(ctx.results['parity']) - len(bad)}/{len(ctx.results['parity'])} parity cases ok, "
          f"{ctx.results['seconds']:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
