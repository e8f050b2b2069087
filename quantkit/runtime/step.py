"""Explicit model steps over a KV cache: prefill, decode, and tree-masked (speculative) steps.

`step(model, tokens, positions, cache, attention_mask)` runs T new tokens per row at the positions the caller
chooses and appends their keys and values to the cache; `KVCache.crop(n)` rolls it back. That is all a
speculative decoder needs: draft, verify a chain or a tree in one step (a 4-D mask says which slots each new
token may see), crop the rejected tail.

The cache keeps every token of every layer, sliding-window layers included, so any rollback is exact; windows
are applied by the masks instead. Slots are shared by the batch: a batch of unequal prompts is left-padded,
and the cache remembers which slots are padding so no later step attends to them.

Masks: with no padding and no explicit mask, transformers builds its own causal (and sliding-window) masks
from the cache's sizes, and skips them where SDPA's `is_causal` does the job. Otherwise this module builds
the boolean masks itself and hands them over already prepared, in the form the architecture's forward reads:
one tensor, or one per layer type (`full_attention` / `sliding_attention`) for models that mix them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

Prompts = torch.Tensor | Sequence[Sequence[int]]


class _LayerKV(CacheLayerMixin):
    """One layer's keys and values in buffers [B, H, capacity, D] written in place, grown by doubling.

    Writing in place (instead of concatenating, as transformers' DynamicLayer does) keeps a decode step from
    copying the whole cache, and makes a rollback a change of `length`.
    """

    is_sliding = False  # windows live in the masks; the layer keeps every token so crop can go back anywhere
    is_croppable = True

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        size = max(self.capacity, key_states.shape[-2])
        self.keys = key_states.new_empty(*key_states.shape[:-2], size, key_states.shape[-1])
        self.values = value_states.new_empty(*value_states.shape[:-2], size, value_states.shape[-1])
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        size = max(needed, 2 * self.keys.shape[-2])
        keys = self.keys.new_empty(*self.keys.shape[:-2], size, self.keys.shape[-1])
        values = self.values.new_empty(*self.values.shape[:-2], size, self.values.shape[-1])
        keys[..., : self.length, :] = self.keys[..., : self.length, :]
        values[..., : self.length, :] = self.values[..., : self.length, :]
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            self._grow(end)
        # narrow + copy_ rather than slice assignment: this runs once per layer per token, and indexing
        # through __setitem__ costs more than the copy itself at decode sizes.
        self.keys.narrow(-2, start, end - start).copy_(key_states)
        self.values.narrow(-2, start, end - start).copy_(value_states)
        self.length = end
        return self.keys.narrow(-2, 0, end), self.values.narrow(-2, 0, end)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0

    def crop(self, keep: int) -> None:
        self.length = min(self.length, keep)

    def keep(self, start: int, index: torch.Tensor) -> None:
        index = index.to(self.keys.device)
        # index_select copies first, so overlapping source and destination ranges are safe.
        self.keys[..., start : start + len(index), :] = self.keys.index_select(-2, index)
        self.values[..., start : start + len(index), :] = self.values.index_select(-2, index)
        self.length = start + len(index)


class _JointKV(_LayerKV):
    """An MLA layer's latent (as keys) and rope part (as values) of each slot in one row [B, 1, capacity, r + rope],
    so an absorbed decode kernel reads the layer's whole cache as one tensor; keys and values are views of it."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.split = key_states.shape[-1]
        size = max(self.capacity, key_states.shape[-2])
        self.rows = key_states.new_empty(*key_states.shape[:-2], size, self.split + value_states.shape[-1])
        self._views()
        self.is_initialized = True

    def _views(self) -> None:
        self.keys, self.values = self.rows[..., : self.split], self.rows[..., self.split :]

    def _grow(self, needed: int) -> None:
        rows = self.rows.new_empty(*self.rows.shape[:-2], max(needed, 2 * self.rows.shape[-2]), self.rows.shape[-1])
        rows[..., : self.length, :] = self.rows[..., : self.length, :]
        self.rows = rows
        self._views()


class KVCache(Cache):
    """Keys and values of every layer for a batch of rows that share slot indices; `crop(n)` rolls back.

    `capacity` (slots) sizes the buffers up front; they grow by doubling past it. One cache serves one model.
    """

    def __init__(self, capacity: int = 0):
        super().__init__(layers=[])  # one layer is added per attention layer at its first write
        self._capacity = capacity
        self._length = 0
        self._valid: torch.Tensor | None = None  # [B, slots] False at padding; None while no slot is padding
        self._pad_below = 0  # only slots below this can be flagged as padding
        self._positions: torch.Tensor | None = None  # [B, slots] position of each slot, for window masks
        self._layout: _MaskLayout | None = None
        self._config = None
        self.joint: set[int] = set()  # layers that keep keys and values in one row (`_JointKV`: absorbed MLA)

    @property
    def length(self) -> int:
        """Slots filled (including any left padding)."""
        return self._length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append((_JointKV if len(self.layers) in self.joint else _LayerKV)(self._capacity))
        return self.layers[layer_idx].update(key_states, value_states)

    def crop(self, n: int) -> None:
        """Keep the first `n` slots (a negative `n` drops the last -n, transformers' convention)."""
        keep = self._length + n if n < 0 else min(n, self._length)
        if keep < 0:
            raise ValueError(f"cannot crop {-n} slots from a cache of {self._length}")
        for layer in self.layers:
            layer.crop(keep)
        self._length = keep
        if keep == 0:  # a fresh start: unpadded steps go back to transformers' own masks
            self._valid, self._pad_below = None, 0

    def reset(self) -> None:
        self.crop(0)

    def keep(self, start: int, slots: Sequence[int]) -> None:
        """Keep slots `start + s` for s in `slots` (increasing), moved down to `start`, `start + 1`, ...; drop
        every slot after `start` otherwise. A verified draft tree keeps its accepted path this way."""
        index = torch.as_tensor([start + s for s in slots], dtype=torch.long)
        if len(index) and (index[0] < start or int(index[-1]) >= self._length or bool((index.diff() <= 0).any())):
            raise ValueError(f"slots {list(slots)} are not increasing slots after {start} of {self._length}")
        with torch.inference_mode():  # the buffers were written under inference mode
            for layer in self.layers:
                layer.keep(start, index)
            for name in ("_positions", "_valid"):
                buf = getattr(self, name)
                if buf is not None and buf.shape[1] >= self._length:
                    buf[:, start : start + len(index)] = buf[:, index.to(buf.device)]
        self._length = start + len(index)

    def _bind(self, net: nn.Module) -> _MaskLayout:
        if self._config is not net.config:
            self._layout, self._config = _mask_layout(net), net.config
        return self._layout

    def _record(self, start: int, positions: torch.Tensor, valid: torch.Tensor | None, track_positions: bool) -> None:
        """Note the new slots' positions (window masks need them) and padding flags before the forward writes them."""
        end = start + positions.shape[1]
        if track_positions:
            self._positions = _fit(self._positions, positions, end, self._capacity)
            self._positions[:, start:end] = positions
        if valid is not None:
            self._valid = _fit(self._valid, valid, end, self._capacity, fill=True)
            self._valid[:, start:end] = valid
            self._pad_below = max(self._pad_below, end)
        elif self._valid is not None:
            self._valid = _fit(self._valid, positions, end, self._capacity, fill=True)
            if start < self._pad_below:  # slots reused after a crop may still say "padding"
                self._valid[:, start:end] = True
                if end >= self._pad_below:
                    self._pad_below = start


def _fit(buf: torch.Tensor | None, like: torch.Tensor, end: int, capacity: int, fill: bool | int = 0) -> torch.Tensor:
    """`buf` [B, slots] with room for `end` slots (doubling), created shaped like `like`'s batch if missing."""
    if buf is not None and buf.shape[1] >= end:
        return buf
    size = max(end, capacity, 2 * buf.shape[1] if buf is not None else 0)
    dtype = torch.bool if isinstance(fill, bool) else like.dtype
    new = torch.full((like.shape[0], size), fill, dtype=dtype, device=like.device)
    if buf is not None:
        new[:, : buf.shape[1]] = buf
    return new


@dataclass(frozen=True)
class _MaskLayout:
    """How an architecture's forward takes prepared masks."""

    keys: tuple[str, ...] | None  # layer types of a per-type dict (qwen2, gemma2/3, ...); None: one tensor
    window: int | None  # sliding window of the sliding layers (all layers when `keys` is None)
    attention: str  # "sdpa" takes boolean masks, "eager" additive ones
    dtype: torch.dtype


_LAYER_TYPES = ("full_attention", "sliding_attention")


def _mask_layout(net: nn.Module) -> _MaskLayout:
    config = net.config.get_text_config() if hasattr(net.config, "get_text_config") else net.config
    window = getattr(config, "sliding_window", None) or None  # qwen2_moe writes 0 for "none"
    layer_types = getattr(config, "layer_types", None)
    keys = None
    if layer_types is not None:
        # Models with a `layer_types` list read a dict keyed by type; the others (mistral, mixtral, qwen3_moe)
        # one mask, sliding everywhere iff the config has a window. This mirrors their forward methods.
        keys = tuple(dict.fromkeys(layer_types))
        unknown = [k for k in keys if k not in _LAYER_TYPES]
        if unknown:
            raise NotImplementedError(f"step masks do not support {', '.join(unknown)} layers")
        if "sliding_attention" not in keys:
            window = None
    attention = getattr(net.config, "_attn_implementation", None) or "sdpa"
    return _MaskLayout(keys, window, attention, net.dtype)


def _network(model) -> nn.Module:
    from quantkit.runtime.model import RuntimeModel

    return model.model if isinstance(model, RuntimeModel) else model


@functools.cache
def _cache_keyword(forward) -> str:
    # transformers renamed `past_key_values` to `cache`; pass whichever this version's forward takes.
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _causal_block(past: int, count: int, device: torch.device) -> torch.Tensor:
    """[1, 1, count, past + count]: slot j is visible from new token i iff j <= past + i."""
    slots = torch.arange(past + count, device=device)
    return (slots[None, :] <= past + torch.arange(count, device=device)[:, None])[None, None]


def _build_masks(layout: _MaskLayout, cache: KVCache, past: int, positions: torch.Tensor,
                 pad: torch.Tensor | None, custom: torch.Tensor | None):
    """The prepared masks for this step, or None when transformers' own causal masks are right."""
    if custom is None and cache._valid is None:
        return None
    if layout.attention not in ("sdpa", "eager"):
        raise NotImplementedError(f"padded or tree-masked steps need sdpa or eager attention, not {layout.attention}")
    count = positions.shape[1]
    total = past + count
    if custom is not None:
        allowed = custom.to(device=positions.device, dtype=torch.bool)
    elif count > 1:
        allowed = _causal_block(past, count, positions.device)
    else:
        allowed = None  # one new token may see every earlier slot
    if cache._valid is not None:
        valid = cache._valid[:, None, None, :total]
        allowed = valid if allowed is None else allowed & valid
        if pad is not None:
            # A padding query would see no slot at all. CPU SDPA (torch >= 2.5) returns zeros for such a row,
            # but other backends return NaN, which reaches that slot's values in later layers and then every
            # real token through 0 * NaN; letting the pad see itself keeps it finite everywhere.
            eye = torch.eye(count, dtype=torch.bool, device=positions.device)
            allowed = allowed.clone()
            allowed[..., past:] |= eye & ~pad[:, None, :, None]
    full = windowed = allowed
    if layout.window is not None:
        # In positions, not slots: a tree node's window is counted along its own chain of ancestors.
        distance = positions[:, None, :, None] - cache._positions[:, None, None, :total]
        windowed = allowed & (distance < layout.window)
    if layout.attention == "eager":
        full, windowed = _additive(full, layout.dtype), _additive(windowed, layout.dtype)
    if layout.keys is None:
        return windowed if layout.window is not None else full
    return {k: windowed if k == "sliding_attention" else full for k in layout.keys}


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def _check_mask(mask: torch.Tensor, batch: int, count: int, total: int) -> None:
    if mask.dim() == 2:
        if tuple(mask.shape) != (batch, count):
            raise ValueError(f"a 2-D attention_mask marks the new tokens: expected [{batch}, {count}], "
                             f"got {list(mask.shape)}")
    elif mask.dim() == 4:
        if mask.shape[0] not in (1, batch) or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (count, total):
            raise ValueError(f"a 4-D attention_mask must be [{batch} or 1, 1, {count}, {total}], "
                             f"got {list(mask.shape)}")
    else:
        raise ValueError(f"attention_mask must be 2-D (padding) or 4-D, got {mask.dim()}-D")


def _step(net: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
          attention_mask: torch.Tensor | None = None, logits_to_keep: int = 0) -> torch.Tensor:
    """`step` without the argument normalisation and inference-mode entry (the decode loop's path)."""
    layout = cache._bind(net)
    past = cache.length
    pad = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    custom = attention_mask if attention_mask is not None and attention_mask.dim() == 4 else None
    cache._record(past, positions, pad, track_positions=layout.window is not None)
    masks = _build_masks(layout, cache, past, positions, pad, custom)
    try:
        out = net(input_ids=tokens, position_ids=positions, attention_mask=masks, use_cache=True,
                  logits_to_keep=logits_to_keep, **{_cache_keyword(type(net).forward): cache})
    except BaseException:
        cache.crop(past)  # layers that ran before the failure already wrote their slots
        raise
    cache._length = past + tokens.shape[1]
    if cache.layers and cache.layers[0].length != cache._length:
        raise RuntimeError("the model did not write its keys and values to the KVCache it was given")
    return out.logits


def step(model, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
         attention_mask: torch.Tensor | None = None, logits_to_keep: int = 0) -> torch.Tensor:
    """Run `tokens` [B, T] at `positions` [B, T], appending them to `cache`; logits [B, T, V].

    `attention_mask`: None = causal over the cache's slots (and never a padding slot); a 2-D boolean [B, T]
    marks which new tokens are real (False = padding, never attended by anyone later); a 4-D boolean
    [B or 1, 1, T, cache.length + T] (True = may attend) replaces the causal pattern, e.g. `tree_mask`.
    `logits_to_keep` > 0 returns only the last that many positions' logits.
    Accepts quantkit's RuntimeModel or a transformers causal LM.
    """
    net = _network(model)
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, T], got {list(tokens.shape)}")
    batch, count = tokens.shape
    positions = torch.as_tensor(positions, device=tokens.device).long().expand(batch, count)
    if attention_mask is not None:
        _check_mask(attention_mask, batch, count, cache.length + count)
        attention_mask = attention_mask.to(device=tokens.device, dtype=torch.bool)
    with torch.inference_mode():
        return _step(net, tokens, positions, cache, attention_mask, logits_to_keep)


class Prefilled(NamedTuple):
    logits: torch.Tensor  # [B, V] at each row's last prompt token
    next_positions: torch.Tensor  # [B] the position each row's next token takes (its prompt length)


def left_pad(prompts: Prompts, device: torch.device | str, pad_token_id: int = 0):
    """tokens [B, L], real-token mask [B, L] (None when no row is padded), positions [B, L] (0 at each row's
    first real token)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.shape[1] == 0:
            raise ValueError(f"prompts must be [B, L] with L > 0, got {list(prompts.shape)}")
        tokens = prompts.to(device)
        positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
        return tokens, None, positions
    rows = [list(p) for p in prompts]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("every prompt needs at least one token")
    width = max(len(r) for r in rows)
    tokens = torch.tensor([[pad_token_id] * (width - len(r)) + r for r in rows], dtype=torch.long, device=device)
    if all(len(r) == width for r in rows):
        return tokens, None, torch.arange(width, device=device).expand_as(tokens)
    valid = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows], device=device)
    positions = (valid.long().cumsum(dim=1) - 1).clamp_(min=0)
    return tokens, valid, positions


def prefill(model, prompts: Prompts, cache: KVCache) -> Prefilled:
    """Run a batch of prompts (a [B, L] tensor, or token lists of any lengths, left-padded) into an empty cache."""
    if cache.length:
        raise ValueError("prefill needs an empty cache (crop(0) it first)")
    net = _network(model)
    tokens, valid, positions = left_pad(prompts, net.device)
    with torch.inference_mode():
        logits = _step(net, tokens, positions, cache, valid, logits_to_keep=1)[:, -1]
    return Prefilled(logits, positions[:, -1] + 1)


def tree_mask(parents: Sequence[int], prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, N, prefix_len + N] boolean mask for a tree of N new tokens over `prefix_len` cached slots.

    `parents[i]` is node i's parent among the new tokens (-1: it follows the prefix's last token); parents
    come before children. Each node sees the whole prefix, its ancestors and itself. Run it with
    `tree_positions` so each node sits at the position it would have in its own chain.
    """
    n = len(parents)
    ancestors = torch.zeros(n, n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}: parents must be -1 or an earlier node")
        if parent >= 0:
            ancestors[i] = ancestors[parent]
        ancestors[i, i] = True
    prefix = torch.ones(n, prefix_len, dtype=torch.bool)
    return torch.cat([prefix, ancestors], dim=1)[None, None].to(device)


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (0 for a child of the prefix)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def tree_positions(parents: Sequence[int], start: int | torch.Tensor,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions [B, N] of the tree's nodes: `start` (the prefix's length in positions, int or [B]) + depth."""
    depths = torch.tensor(tree_depths(parents), dtype=torch.long, device=device)
    start = torch.as_tensor(start, dtype=torch.long, device=device).reshape(-1, 1)
    return start + depths[None, :]


__all__ = ["KVCache", "Prefilled", "left_pad", "prefill", "step", "tree_depths", "tree_mask", "tree_positions"]
