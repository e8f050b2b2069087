"""Which kernel serves a linear where several can: measured, once per machine and layer shape.

A fixed priority list cannot be right everywhere (on AVX-512 torch's int4 matmul beats the C++ integer-dot GEMV
at batch 1; on AVX2-only CPUs the C++ one is up to 1.6x faster: benchmarks/results/int4_kernels.md). So where more
than one kernel supports a layer's format, shape and activation dtype, each candidate is prepared on the layer and
timed on a one-row activation (decode: where the kernels differ; prefill-sized batches all run the same dense
GEMM), and the fastest serves every layer of that signature. The timings are cached per machine (CPU, torch
version, candidates, format, shape, dtype) in `<quantkit cache>/kernel-choice.json` and taken again when they were
measured on a busy machine and this one is quieter, as the compute-dtype probe does, and when a kernel's `version`
(its source and build flags) changed.

QUANTKIT_KERNEL_CHOICE=priority keeps the registration order (the test suite's setting: tests that name a kernel
must not depend on a timing).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

PROBE_SECONDS = 0.02  # per candidate, after warm-up
BUSY = 1.0  # load per core above which a cached timing is retaken once the machine is quieter

Measure = Callable[[object, object, torch.Tensor], float]  # (kernel, prepared, x) -> seconds per call


@dataclass
class Choice:
    """The measured choice for one layer signature (what --json reports)."""

    signature: str  # format and shape
    chosen: str
    microseconds: dict[str, float]  # kernel -> best time of one decode row
    cached: bool = False


def mode() -> str:
    return "priority" if os.environ.get("QUANTKIT_KERNEL_CHOICE") == "priority" else "measure"


def time_call(kernel, prepared, x: torch.Tensor) -> float:
    """Best seconds of kernel.run(x, prepared) over PROBE_SECONDS, after warm-up calls."""
    with torch.inference_mode():
        for _ in range(2):
            kernel.run(x, prepared)
        best, spent = float("inf"), 0.0
        while spent < PROBE_SECONDS:
            t0 = time.perf_counter()
            kernel.run(x, prepared)
            dt = time.perf_counter() - t0
            best, spent = min(best, dt), spent + dt
    return best


def _cache_file() -> Path:
    from quantkit.models.source import cache_dir

    return cache_dir() / "kernel-choice.json"


def _key(signature: str, names: list[str], versions: list[str]) -> str:
    from quantkit.compute import cpu_info

    raw = json.dumps([asdict(cpu_info()), torch.__version__, signature, names, versions])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _load_per_core() -> float:
    from quantkit import compute

    return compute._load_per_core()


def choose(layer, candidates: list[tuple[object, object]], signature: str, measure: Measure = time_call,
           use_cache: bool = True) -> Choice:
    """The fastest of `candidates` [(kernel, prepared on `layer`)] on a one-row activation of the layer's dtype."""
    from quantkit.compute import read_cache, write_cache

    names = [k.name for k, _ in candidates]
    # A kernel's `version` (the C++ kernels: the hash of their source and build flags) keys the timing too: a changed
    # kernel is timed again instead of losing to its own old timing.
    versions = [str(getattr(k, "version", "")) for k, _ in candidates]
    key, path, load = _key(signature, names, versions), _cache_file(), _load_per_core()
    cached = read_cache(path) if use_cache else {}
    if use_cache:
        entry = cached.get(key)
        if isinstance(entry, dict) and (entry.get("load_per_core", 0.0) <= BUSY or load >= entry["load_per_core"] - 0.5):
            return Choice(signature, entry["chosen"], entry["microseconds"], cached=True)
    x = torch.randn(1, layer.in_features, generator=torch.Generator().manual_seed(0)).to(layer.compute_dtype)
    micro = {k.name: round(measure(k, p, x) * 1e6, 2) for k, p in candidates}
    chosen = min(names, key=lambda n: micro[n])  # ties: the earlier (registration order)
    if use_cache:
        cached[key] = {"chosen": chosen, "microseconds": micro, "load_per_core": round(load, 2), "signature": signature}
        write_cache(path, cached)
    return Choice(signature, chosen, micro)
