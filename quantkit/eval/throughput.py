"""Prefill and decode throughput, time to first token and peak memory of a causal LM.

Prompts are random token ids (seeded), the same for every model, so runs compare like with like. Each
figure is the best of `repeats` runs after a warm-up (allocator, first-call kernel setup). Alongside: the bytes
of weights the model holds resident (`RuntimeModel.resident_weight_bytes`), which peak memory builds on.
Peak memory: CUDA's allocator peak on a GPU; on CPU the process's resident set, sampled every 5 ms while
the measurements run.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from quantkit.runtime.generate import generate


@dataclass(frozen=True)
class ThroughputConfig:
    prefill_len: int = 128
    prompt_len: int = 32
    decode_tokens: int = 16
    batch_sizes: tuple[int, ...] = (1, 8)
    repeats: int = 2
    seed: int = 0


@contextmanager
def peak_memory(device: torch.device):
    result = {"bytes": 0}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        result["bytes"] = int(torch.cuda.max_memory_allocated(device))
        return
    import psutil

    proc, stop = psutil.Process(), threading.Event()

    def sample():
        while not stop.is_set():
            result["bytes"] = max(result["bytes"], proc.memory_info().rss)
            stop.wait(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        result["bytes"] = max(result["bytes"], proc.memory_info().rss)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_throughput(model, vocab_size: int, device: torch.device, cfg: ThroughputConfig = ThroughputConfig()) -> dict:
    g = torch.Generator().manual_seed(cfg.seed)
    rand = lambda b, n: torch.randint(0, vocab_size, (b, n), generator=g).to(device)  # noqa: E731
    long_prompt = rand(1, cfg.prefill_len)
    prompts = {b: rand(b, cfg.prompt_len) for b in cfg.batch_sizes}
    generate(model, prompts[cfg.batch_sizes[0]], 2)  # warm-up: allocator, first-call kernel setup
    out: dict = {}
    with peak_memory(device) as peak:
        best = float("inf")
        for _ in range(cfg.repeats):
            _sync(device)
            t0 = time.perf_counter()
            model(input_ids=long_prompt, use_cache=False, logits_to_keep=1)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        out["prefill_tok_s"] = cfg.prefill_len / best
        for b in cfg.batch_sizes:
            runs = [generate(model, prompts[b], cfg.decode_tokens) for _ in range(cfg.repeats)]
            decode = min(r.decode_seconds / max(r.decode_steps, 1) for r in runs)
            out[f"decode_tok_s_b{b}"] = b / decode
            if b == cfg.batch_sizes[0]:
                out["ttft_ms"] = 1000 * min(r.prefill_seconds for r in runs)
    out["peak_memory_bytes"] = peak["bytes"]
    resident = getattr(model, "resident_weight_bytes", None)
    if resident is not None:
        out["resident_weight_bytes"] = resident
    # Figures depend on the machine and what else runs on it: both are recorded with them.
    out["config"] = {"prefill_len": cfg.prefill_len, "prompt_len": cfg.prompt_len, "decode_tokens": cfg.decode_tokens,
                     "repeats": cfg.repeats, "threads": torch.get_num_threads(), "device": str(device),
                     "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                     "load_average": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
    return out
