"""A KV-cache generation loop: one prefill pass, then one token per step (greedy or sampled).

Works on any transformers causal LM (quantkit's runtime model or a stock one), which is what lets the
throughput benchmark time both side by side with the same loop. Timings are wall-clock with device
synchronisation, so they can be reported as prefill / decode throughput and time to first token.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [B, new] generated ids
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
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, eos_token_id: int | None = None) -> GenerationResult:
    """Generate up to `max_new_tokens` per row of `input_ids` [B, L] (equal-length prompts, no padding)."""
    from transformers import DynamicCache

    from quantkit.runtime.model import RuntimeModel

    net = model.model if isinstance(model, RuntimeModel) else model
    device = input_ids.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    cache = DynamicCache(config=net.config)
    # transformers renamed `past_key_values` to `cache`; pass whichever this version's forward takes.
    key = "cache" if "cache" in inspect.signature(net.forward).parameters else "past_key_values"
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)
    out_tokens = []
    _sync(device)
    t0 = time.perf_counter()
    logits = net(input_ids=input_ids, **{key: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
    token = sample_next(logits, temperature, top_k, top_p, generator)
    _sync(device)
    t1 = time.perf_counter()
    steps = 0
    for _ in range(max_new_tokens - 1):
        out_tokens.append(token)
        if eos_token_id is not None:
            finished |= token == eos_token_id
            if bool(finished.all()):
                break
        logits = net(input_ids=token[:, None], **{key: cache}, use_cache=True).logits[:, -1]
        token = sample_next(logits, temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            token = torch.where(finished, torch.full_like(token, eos_token_id), token)
        steps += 1
    else:
        out_tokens.append(token)
    _sync(device)
    t2 = time.perf_counter()
    return GenerationResult(torch.stack(out_tokens, dim=1), t1 - t0, t2 - t1, steps)
