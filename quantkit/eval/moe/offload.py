"""The offload driver of `eval --moe`: greedy decodes with experts offloaded (quantkit/runtime/offload.py) per
cache size, policy and prefetch mode, against the fully resident model's decode (speed, and the logits
exactly). Decoding runs on the runtime's step API (prefill, then one-token steps over its KV cache)."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from quantkit.eval.moe import MoEEvalOptions


@torch.inference_mode()
def greedy_decode(rt, prompt: torch.Tensor, steps: int, on_prefill=None) -> tuple[torch.Tensor, float]:
    """Logits [steps + 1, V] of a greedy decode over the runtime's KV cache, and the decode seconds (prefill
    excluded)."""
    from quantkit.runtime.step import KVCache, prefill, step

    cache = KVCache()
    first = prefill(rt, prompt[None].to(rt.device), cache)
    logits = [first.logits[0]]
    position = first.next_positions[:, None]
    if on_prefill:
        on_prefill()
    start = time.perf_counter()
    for _ in range(steps):
        token = logits[-1].argmax(-1).view(1, 1)
        logits.append(step(rt, token, position, cache, logits_to_keep=1)[0, -1])
        position = position + 1
    return torch.stack(logits).float().cpu(), time.perf_counter() - start


def offload_runs(path, prompt: torch.Tensor, sizes, opts: MoEEvalOptions, dtype, device) -> list[dict]:
    """Decode with experts offloaded (quantkit/runtime/offload.py) per cache size and policy; the fully
    resident model's decode is the reference for speed and, exactly, for the logits. Each row decodes
    `opts.decode_repeats` times from a fresh load, the rows in turn, and reports its median speed."""
    from quantkit.models.routing_profile import read_profile
    from quantkit.runtime import load_model
    from quantkit.runtime.offload import OffloadOptions, install_offload

    profile = read_profile(path)
    plan = [(size, policy, prefetch, reads) for size in sizes for reads in opts.offload_reads
            for policy, prefetch in opts.offload_runs]
    seconds: dict[int, list[float]] = {i: [] for i in range(-1, len(plan))}
    rows: dict[int, dict] = {}
    ref = None
    for _ in range(opts.decode_repeats):
        resident = load_model(path, dtype, device)
        logits, secs = greedy_decode(resident, prompt, opts.decode_tokens)
        ref = logits if ref is None else ref
        seconds[-1].append(secs)
        del resident
        for i, (size, policy, prefetch, reads) in enumerate(plan):
            rt = load_model(path, dtype, device)
            cache = install_offload(rt, OffloadOptions(size, policy, bool(prefetch), overlap=prefetch != "sync",
                                                       reads=reads, scratch_dir=opts.offload_scratch), profile)
            logits, secs = greedy_decode(rt, prompt, opts.decode_tokens, on_prefill=cache.reset_stats)
            seconds[i].append(secs)
            st = cache.stats.to_dict()
            name = policy + {"": "", "overlap": "+prefetch", "sync": "+prefetch-sync"}[prefetch]
            exact = bool(torch.equal(logits, ref)) and rows.get(i, {}).get("exact", True)
            rows[i] = {"policy": name, "prefetch": prefetch or None, "cache": size, "reads": reads,
                       "hit_rate": st["hit_rate"], "prefetch_fidelity": st["prefetch_fidelity"],
                       "bytes_moved": st["bytes_moved"], "demand_loads": st["demand_loads"],
                       "prefetch_loads": st["prefetch_loads"], "requests": st["requests"],
                       "profile": profile is not None, "exact": exact}
            cache.remove()
            del rt, cache

    def speed(i: int) -> float:
        return round(opts.decode_tokens / statistics.median(seconds[i]), 2)

    def each(i: int) -> list[float]:
        return [round(opts.decode_tokens / s, 2) for s in seconds[i]]

    out = [{"policy": "resident", "prefetch": None, "cache": None, "reads": None, "hit_rate": 1.0,
            "prefetch_fidelity": None, "bytes_moved": 0, "decode_tok_s": speed(-1), "decode_tok_s_each": each(-1),
            "exact": True}]
    return out + [{**rows[i], "decode_tok_s": speed(i), "decode_tok_s_each": each(i)} for i in range(len(plan))]
