"""A KV-cache generation loop on the step API (`runtime/step.py`): one prefill pass over the (left-padded)
prompts, then one token per row per step, greedy or sampled.

Works on any transformers causal LM (quantkit's runtime model or a stock one), which is what lets the
throughput benchmark time both side by side with the same loop. Timings are wall-clock with device
synchronisation, so they can be reported as prefill / decode throughput and time to first token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from quantkit.runtime.step import KVCache, Prompts, _network, _step, prefill


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [B, new] generated ids (rows that stopped early are filled with EOS)
    prefill_seconds: float  # prompt pass up to the first sampled token (time to first token)
    decode_seconds: float  # all later steps
    decode_steps: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V]; temperature 0 = greedy (argmax)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(model, input_ids: Prompts, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, eos_token_id: int | None = None) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt: `input_ids` is a [B, L] tensor or token lists of any lengths.

    Rows that reach `eos_token_id` keep emitting it until every row has, then the loop stops early.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    net = _network(model)
    device = net.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    longest = input_ids.shape[1] if isinstance(input_ids, torch.Tensor) else max(map(len, input_ids), default=0)
    cache = KVCache(capacity=longest + max_new_tokens)  # sized once: no buffer grows inside the loop
    _sync(device)
    t0 = time.perf_counter()
    first = prefill(net, input_ids, cache)
    token = sample_next(first.logits, temperature, top_k, top_p, generator)
    _sync(device)
    t1 = time.perf_counter()
    # Every decode step's positions, built once; each step takes a column view.
    positions = first.next_positions[:, None] + torch.arange(max_new_tokens - 1, device=device)
    finished = torch.zeros_like(token, dtype=torch.bool)
    out_tokens = [token]
    steps = 0
    for i in range(max_new_tokens - 1):
        if eos_token_id is not None:
            finished |= token == eos_token_id
            if bool(finished.all()):
                break
        logits = _step(net, token[:, None], positions[:, i:i + 1], cache)[:, -1]
        token = sample_next(logits, temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            token = token.masked_fill(finished, eos_token_id)
        out_tokens.append(token)
        steps += 1
    _sync(device)
    t2 = time.perf_counter()
    return GenerationResult(torch.stack(out_tokens, dim=1), t1 - t0, t2 - t1, steps)
