"""The speculative decode loop (one prompt at a time) and its measurements.

Invariant: the target's cache holds every committed token but the last. A step feeds that last token (the
tree's root) and the draft tree's nodes in one forward, accepts a path plus one target token, and keeps the
root's and the path's keys and values (a crop for a chain, a compaction for a tree).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from quantkit.runtime.speculative.acceptance import accept_path
from quantkit.runtime.speculative.heads import FeatureTap
from quantkit.runtime.speculative.trees import AcceptanceRates, TreeSpec
from quantkit.runtime.cuda.ops import tree_mask as cuda_tree_mask
from quantkit.runtime.step import KVCache, step, tree_mask, tree_positions


@dataclass(frozen=True)
class SpecConfig:
    tree: TreeSpec
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    eos_token_id: int | None = None


@dataclass
class SpecResult:
    tokens: list[int]
    steps: int = 0
    accepted: int = 0  # draft tokens accepted, summed over steps
    drafted_depth: int = 0  # sum over steps of the tree's depth: the most a step could accept
    drafted_nodes: int = 0
    per_position_drafted: list[int] = field(default_factory=list)
    per_position_accepted: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    wall_seconds: float = 0.0


def _net(model) -> torch.nn.Module:
    from quantkit.runtime.model import RuntimeModel

    return model.model if isinstance(model, RuntimeModel) else model


def _device(model) -> torch.device:
    return _net(model).device


@torch.inference_mode()
def speculative_generate(target, draft, prompt: list[int], cfg: SpecConfig,
                         rates: AcceptanceRates | None = None) -> SpecResult:
    """Up to `cfg.max_new_tokens` tokens after `prompt`, drafted by `draft` and verified by `target`."""
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    generator = torch.Generator().manual_seed(cfg.seed)
    rates = rates if rates is not None else AcceptanceRates()
    # A draft that reads the target's features (EAGLE, Medusa) is given those of every committed position.
    tap = FeatureTap(target) if getattr(draft, "reads_features", False) else None
    try:
        return _decode(target, draft, list(prompt), cfg, rates, generator, tap)
    finally:
        if tap is not None:
            tap.close()


def _decode(target, draft, ctx: list[int], cfg: SpecConfig, rates: AcceptanceRates, generator,
            tap: FeatureTap | None) -> SpecResult:
    device = _device(target)
    net = _net(target)
    cache = KVCache()
    result = SpecResult(tokens=[])
    start = time.perf_counter()
    draft.reset(cache)
    if len(ctx) > 1:
        step(target, torch.tensor([ctx[:-1]], device=device), torch.arange(len(ctx) - 1, device=device)[None],
             cache, logits_to_keep=1)
        if tap is not None:
            draft.observe(0, tap.take()[0])
    while len(result.tokens) < cfg.max_new_tokens:
        t0 = time.perf_counter()
        tree = draft.propose(ctx, cfg.tree, cfg.temperature, generator, rates)
        t1 = time.perf_counter()
        parents = [-1] + [p + 1 for p in tree.parents]  # node 0 is the root: the last committed token
        tokens = torch.tensor([[ctx[-1], *tree.tokens]], device=device)
        base = cache.length
        positions = tree_positions(parents, len(ctx) - 1, device=device)
        mask = None
        if not tree.is_chain():  # the kernel's mask where CUDA ops are installed (None past its 1024 nodes)
            mask = cuda_tree_mask(net, parents, base, device)
            if mask is None:
                mask = tree_mask(parents, base, device=device)
        logits = step(target, tokens, positions, cache, mask)[0]
        path, token = accept_path(tree.parents, tree.tokens, tree.proposals, logits, cfg.temperature, generator)
        if tap is not None:  # the root's and the accepted nodes' features: committed positions from len(ctx) - 1
            draft.observe(len(ctx) - 1, tap.take()[0, [0] + [1 + i for i in path]])
        if tree.is_chain():
            cache.crop(base + 1 + len(path))
        else:
            cache.keep(base, [0] + [1 + i for i in path])
        result.verify_seconds += time.perf_counter() - t1
        result.draft_seconds += t1 - t0
        rates.record(tree, path)
        _count(result, tree, path)
        new = [tree.tokens[i] for i in path] + [token]
        if cfg.eos_token_id is not None and cfg.eos_token_id in new:
            new = new[: new.index(cfg.eos_token_id) + 1]
            result.tokens += new
            break
        ctx += new
        result.tokens += new
    result.tokens = result.tokens[: cfg.max_new_tokens]
    result.wall_seconds = time.perf_counter() - start
    return result


def _count(result: SpecResult, tree, path: list[int]) -> None:
    depth = max(tree.depths, default=-1) + 1
    result.steps += 1
    result.accepted += len(path)
    result.drafted_depth += depth
    result.drafted_nodes += len(tree)
    while len(result.per_position_drafted) < depth:
        result.per_position_drafted.append(0)
        result.per_position_accepted.append(0)
    for d in range(depth):
        result.per_position_drafted[d] += 1
        result.per_position_accepted[d] += len(path) > d


@torch.inference_mode()
def plain_generate(target, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                   eos_token_id: int | None = None) -> tuple[list[int], float]:
    """The target alone, one token per step on the same cache and sampling code: the reference the speculative
    output is compared with, and the speed its speed-up is measured against. Returns (tokens, seconds)."""
    from quantkit.runtime.speculative.acceptance import node_distribution

    device = _device(target)
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache()
    start = time.perf_counter()
    logits = step(target, torch.tensor([prompt], device=device), torch.arange(len(prompt), device=device)[None],
                  cache, logits_to_keep=1)[0, -1]
    out: list[int] = []
    pos = len(prompt)
    while True:
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(node_distribution(logits, temperature), 1, generator=generator))
        out.append(token)
        if len(out) >= max_new_tokens or token == eos_token_id:
            break
        logits = step(target, torch.tensor([[token]], device=device), torch.tensor([[pos]], device=device), cache)[0, -1]
        pos += 1
    return out, time.perf_counter() - start
