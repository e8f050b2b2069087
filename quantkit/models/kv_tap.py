"""Reaching the keys and values an attention layer stores, in any architecture transformers runs.

transformers' attention modules hand their keys (after RoPE and any key norm) and values to `cache.update` before
attending; what that call returns is what they attend over. A tap replaces the cache argument of one attention
module with a thin wrapper whose `update` passes the states through a function first (observe them, or round them
through an fp8 cache) and then on to the real cache, or straight back when the call has none. Attention modules are
found by name, as compressed-tensors targets them (`self_attn` / `attention`).
"""

from __future__ import annotations

import inspect
import re
from typing import Callable

import torch
from torch import nn

ATTENTION_NAME = re.compile(r"(^|\.)(self_attn|attention)$")
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")  # transformers' names for it across versions

KVFunction = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def attention_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each attention module under `root` that stores keys and values through a cache."""
    out = []
    for name, module in root.named_modules():
        if ATTENTION_NAME.search(name) and _cache_kwarg(module) is not None:
            out.append((name, module))
    return out


def _cache_kwarg(module: nn.Module) -> str | None:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((k for k in _CACHE_KWARGS if k in params), None)


class _Tap:
    """Stands in for the cache during one attention call: states through `fn`, then to the real cache."""

    def __init__(self, fn: KVFunction, cache):
        self._fn, self._cache = fn, cache

    def update(self, key_states, value_states, *args, **kwargs):
        key_states, value_states = self._fn(key_states, value_states)
        if self._cache is None:
            return key_states, value_states
        return self._cache.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name):  # anything else an attention module reads of its cache
        cache = self.__dict__.get("_cache")
        if cache is None:
            raise AttributeError(name)
        return getattr(cache, name)


def tap_kv(module: nn.Module, fn: KVFunction) -> torch.utils.hooks.RemovableHandle:
    """Pass every key/value `module` stores through `fn` until the returned handle is removed."""
    name = _cache_kwarg(module)
    if name is None:
        raise ValueError(f"{type(module).__name__} takes no cache argument")

    def hook(mod, args, kwargs):
        kwargs[name] = _Tap(fn, kwargs.get(name))
        return args, kwargs

    return module.register_forward_pre_hook(hook, with_kwargs=True)
