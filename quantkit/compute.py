"""Which dtype the matmuls of a run compute in, chosen by what this machine does fast.

CPUs differ by orders of magnitude here: with AVX-512 BF16 or AMX a bf16 matmul is ~10x faster than fp32,
without them (AVX2 servers, most laptops, many CI runners) torch's bf16 matmul is emulated and ~30-100x
slower than fp32. So `auto` times the run's real matmul shapes in each candidate dtype (well under a second),
keeps the faster one, and caches the measurement per machine (CPU model, instruction-set flags, torch
version and capability, threads, and the environment variables that cap oneDNN's or ATen's instruction set).
On CUDA the model's own dtype is used (tensor cores run bf16 and fp16 natively).

Candidates: the model's dtype and fp32, plus bf16 for fp32 models (run under autocast, the fp32 master weights
stay exact for quantisation). A near tie (within `TIE`) goes to the model's own dtype: it is what deployment
computes in, and for fp32 models it is the exact one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHOICES = ("auto", "bfloat16", "float32")
BUSY = 1.0  # load average per core above which a probe is taken again once the machine is quieter
TIE = 1.10  # a candidate must be this much faster than the model's own dtype to replace it
FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8",
                     "avx512_vnni", "avx_vnni", "fma")
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
PROBE_ROWS = 256  # rows per probe matmul: the per-row cost is that of the real 2048-token batches
PROBE_SECONDS = 0.04  # per (dtype, shape): repeat the matmul until this much time has passed (best run counts)

Measure = Callable[[torch.dtype, tuple[tuple[int, int, int], ...]], float]


@dataclass(frozen=True)
class CpuInfo:
    model: str
    capability: str  # torch.backends.cpu.get_cpu_capability(): the kernels ATen dispatches to
    flags: tuple[str, ...]  # the instruction-set flags that decide matmul speed
    threads: int
    isa_env: tuple[tuple[str, str], ...] = ()  # ONEDNN_MAX_CPU_ISA and friends, when set

    def describe(self) -> str:
        env = "".join(f" {k}={v}" for k, v in self.isa_env)
        return f"{self.capability} ({' '.join(self.flags) or 'no avx2'}) {self.threads} threads{env}"


def cpu_info() -> CpuInfo:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                model = value.strip()
            elif key in ("flags", "Features"):
                flags.update(value.split())
                break
    except OSError:
        pass
    return CpuInfo(model=model, capability=torch.backends.cpu.get_cpu_capability(),
                   flags=tuple(f for f in FLAGS_OF_INTEREST if f in flags), threads=torch.get_num_threads(),
                   isa_env=tuple((k, os.environ[k]) for k in ISA_ENV if os.environ.get(k)))


@dataclass(frozen=True)
class ComputeChoice:
    dtype: torch.dtype  # what the matmuls compute in
    autocast: bool  # fp32 weights under bf16 autocast (fp32 model, bf16 chosen)
    reason: str  # forced | measured | cached | cuda | no-candidates | resumed (kept from the run's journal)
    gflops: dict[str, float] = field(default_factory=dict)  # measured speed per candidate dtype
    cpu: str = ""  # CpuInfo.describe() of the machine that measured

    @property
    def name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def layer_dtype(self) -> torch.dtype:
        """The dtype a layer is materialised in: fp32 master weights under autocast, else the compute dtype."""
        return torch.float32 if self.autocast else self.dtype

    def describe(self) -> str:
        speeds = ", ".join(f"{k} {v:.1f}" for k, v in self.gflops.items())
        how = f"{self.reason}: {speeds} GFLOP/s" if speeds else self.reason
        return f"compute dtype {self.name}{' (bf16 autocast over fp32 weights)' if self.autocast else ''} ({how}; {self.cpu})"

    def to_dict(self) -> dict:
        out = asdict(self)
        out["dtype"] = self.name
        return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def matmul_shapes(config, tokens: int = PROBE_ROWS) -> tuple[tuple[int, int, int], ...]:
    """(M, K, N) of a decoder layer's two main matmul kinds: attention-sized [H -> H] and MLP [H -> I]."""
    if isinstance(config, dict):  # a config.json read as data
        config = config.get("text_config") or config
        get = config.get
    else:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        get = lambda key: getattr(text, key, None)  # noqa: E731
    hidden = int(get("hidden_size") or 1024)
    inter = int(get("moe_intermediate_size") or get("intermediate_size") or 4 * hidden)
    return ((tokens, hidden, hidden), (tokens, hidden, inter))


def measure_gflops(dtype: torch.dtype, shapes: tuple[tuple[int, int, int], ...]) -> float:
    """Achieved GFLOP/s of x @ w over `shapes` in `dtype` (best of repeated runs per shape, summed)."""
    g = torch.Generator().manual_seed(0)
    flops = seconds = 0.0
    with torch.inference_mode():
        for m, k, n in shapes:
            x = torch.randn(m, k, generator=g).to(dtype)
            w = torch.randn(k, n, generator=g).to(dtype)
            t0 = time.perf_counter()
            for _ in range(3):  # warm-up: thread pool start, oneDNN primitive creation, allocator
                x @ w
                if time.perf_counter() - t0 > PROBE_SECONDS:
                    break  # one slow call is warm-up enough: the probe must stay well under a second
            best, spent = float("inf"), 0.0
            while spent < PROBE_SECONDS:
                t0 = time.perf_counter()
                x @ w
                dt = time.perf_counter() - t0
                best, spent = min(best, dt), spent + dt
            flops += 2.0 * m * k * n
            seconds += best
    return flops / seconds / 1e9


def _cache_file() -> Path:
    from quantkit.models.source import cache_dir

    return cache_dir() / "compute-dtype.json"


def _cache_key(info: CpuInfo, shapes, candidates) -> str:
    raw = json.dumps([asdict(info), torch.__version__, list(shapes), [dtype_name(c) for c in candidates]])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def read_cache(path: Path) -> dict:
    """A machine-measurement cache (JSON), empty when missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def write_cache(path: Path, cached: dict) -> None:
    """Replace the cache file atomically; a read-only cache only costs the next run another short probe."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError:
        pass


def _load_per_core() -> float:
    try:
        return os.getloadavg()[0] / max(os.cpu_count() or 1, 1)
    except OSError:
        return 0.0


def _usable(entry, load_now: float) -> bool:
    """A cached probe stands unless it was taken on a busy machine (more runnable threads than cores, which
    skews the dtypes' speeds unevenly) and this one is quieter now."""
    if not isinstance(entry, dict) or "gflops" not in entry:
        return False  # an entry without its load (an earlier layout): measure again, it is sub-second
    return entry.get("load_per_core", 0.0) <= BUSY or load_now >= entry["load_per_core"] - 0.5


def _measured(info: CpuInfo, shapes, candidates, measure: Measure, use_cache: bool) -> tuple[dict[str, float], bool]:
    key = _cache_key(info, shapes, candidates)
    path = _cache_file()
    load = _load_per_core()
    cached = read_cache(path) if use_cache else {}
    if use_cache:
        if _usable(cached.get(key), load):
            return cached[key]["gflops"], True
    if measure is measure_gflops:
        measure(torch.float32, ((PROBE_ROWS, 256, 256),))  # start the thread pool before any figure counts
    speeds = {dtype_name(c): round(measure(c, shapes), 2) for c in candidates}
    if use_cache:
        cached[key] = {"gflops": speeds, "load_per_core": round(load, 2)}
        write_cache(path, cached)
    return speeds, False


def choose_compute_dtype(requested: str, model_dtype: torch.dtype, device: str | torch.device = "cpu",
                         shapes: tuple[tuple[int, int, int], ...] = ((PROBE_ROWS, 1024, 1024),),
                         measure: Measure = measure_gflops, use_cache: bool = True,
                         narrower: bool = True) -> ComputeChoice:
    """The dtype a run's matmuls compute in. `requested` is auto, bfloat16 or float32 (float16 too, forced).
    `narrower=False` keeps `auto` from computing an fp32 model in bf16 (evaluation measures the model as it is)."""
    from quantkit.errors import InputError

    if requested not in (*CHOICES, "float16"):
        raise InputError(f"unknown compute dtype {requested!r}; valid: {', '.join(CHOICES)}")
    device_type = torch.device(device).type
    describe = cpu_info().describe() if device_type == "cpu" else str(device)
    if requested != "auto":
        dtype = DTYPE_NAMES[requested]
        return ComputeChoice(dtype, autocast=_autocast(dtype, model_dtype, device_type), reason="forced", cpu=describe)
    if device_type != "cpu":
        return ComputeChoice(model_dtype, autocast=False, reason=device_type, cpu=describe)
    candidates = [model_dtype] + [d for d in (torch.float32, torch.bfloat16) if d != model_dtype
                                  and (d == torch.float32 or (narrower and model_dtype == torch.float32))]
    if len(candidates) == 1:
        return ComputeChoice(model_dtype, autocast=False, reason="no-candidates", cpu=describe)
    info = cpu_info()
    speeds, hit = _measured(info, shapes, candidates, measure, use_cache)
    own = speeds[dtype_name(model_dtype)]
    best = max(candidates, key=lambda d: speeds[dtype_name(d)])
    dtype = best if speeds[dtype_name(best)] > own * TIE else model_dtype
    return ComputeChoice(dtype, autocast=_autocast(dtype, model_dtype, device_type),
                         reason="cached" if hit else "measured", gflops=speeds, cpu=info.describe())


def _autocast(dtype: torch.dtype, model_dtype: torch.dtype, device_type: str) -> bool:
    """bf16 compute over an fp32 model runs as autocast on CPU: the master weights stay fp32."""
    return device_type == "cpu" and model_dtype == torch.float32 and dtype == torch.bfloat16


@contextmanager
def one_thread(device: torch.device | str = "cpu", on: bool = True):
    """torch's CPU ops on one thread inside the block, restored after it: loops of many small or elementwise ops
    on weight-sized tensors, where OpenMP barriers cost more than the work and stall on a shared machine (measured
    13x on a 1536x576 fake-quantise, 16.6 s against 0.45 s for an eager 3072x576 GPTQ solve). The thread count
    is process-wide: this is the one place that changes it."""
    if not on or torch.device(device).type != "cpu":
        yield
        return
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
