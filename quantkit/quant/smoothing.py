"""Folding per-channel scales between a producer and its consumers (SmoothQuant, AWQ), as pure functions.

A smoothing mapping says: `source` produces the tensor X that every `target` linear reads. Dividing X's
channel j by s_j (in the source) and multiplying column j of every target weight by s_j leaves each
target's output unchanged in exact arithmetic, while moving range from the activations to the weights.

Sources are a norm (its weight, and bias if any, divided by s; Gemma's norms multiply by 1 + w, so the new
w is (1 + w) / s - 1) or a linear (its output rows and bias divided by s). When a linear source feeds a
grouped-query attention output projection (v_proj -> o_proj with fewer kv heads than query heads), each
v channel is read by several o_proj columns: s lives on v's channels and is repeated over the query heads
of each group (`expand_gqa`). Routers that read the same tensor (MoE gates) are targets too: their columns
are scaled like any other, so routing is unchanged (only the quantised targets set the weight range).

Adapter mappings name layer-local modules; a `*` matches one expert index, and a mapping whose source has
a `*` is expanded per expert with the same index substituted into its targets. Names that the layer lacks
are skipped (DeepSeek's dense first layers, models without q_lora_rank), so one mapping list serves every
layer of a family.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.models.adapters import Smoothing


@dataclass
class ResolvedSmoothing:
    source: str  # layer-local module name
    kind: str  # "norm" | "gemma_norm" | "linear"
    targets: list[str]  # layer-local module names, all present in the layer
    head_dim: int | None = None  # set when a linear source feeds a GQA o_proj (target in > source out)


def _pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(name).replace(r"\*", r"(\d+)") + r"\Z")


def resolve_mappings(layer: nn.Module, mappings: tuple[Smoothing, ...] | list[Smoothing]) -> list[ResolvedSmoothing]:
    """The adapter's mappings as they exist in this concrete layer (experts expanded, absent names dropped,
    linear pairs whose channels cannot be tied left out)."""
    modules = dict(layer.named_modules())
    out: list[ResolvedSmoothing] = []
    for m in mappings:
        if "*" in m.source:
            pat = _pattern(m.source)
            indices = [match.group(1) for name in modules if (match := pat.match(name))]
            instances = [(m.source.replace("*", i), tuple(t.replace("*", i) for t in m.targets)) for i in indices]
        else:
            instances = [(m.source, m.targets)]
        for source, targets in instances:
            if source not in modules:
                continue
            found: list[str] = []
            for t in targets:
                if "*" in t:
                    pat = _pattern(t)
                    found.extend(name for name in modules if pat.match(name))
                elif t in modules:
                    found.append(t)
            found = [t for t in found if getattr(modules[t], "weight", None) is not None]
            if not found:
                continue
            head_dim = None
            if m.kind == "linear":
                src_out = modules[source].weight.shape[0]
                tgt_in = modules[found[0]].weight.shape[1]
                if tgt_in != src_out:
                    head_dim = getattr(modules.get(found[0].rpartition(".")[0]), "head_dim", None)
                    if head_dim is None or tgt_in % src_out or src_out % head_dim:
                        continue
            out.append(ResolvedSmoothing(source, m.kind, found, head_dim))
    return out


def channel_absmax(x: torch.Tensor) -> torch.Tensor:
    """max |x| per channel (last dimension) over every other dimension, in fp32."""
    return x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()


def weight_column_absmax(weights: list[torch.Tensor]) -> torch.Tensor:
    """max |W[:, j]| over the rows of every weight (all read the same input channels)."""
    return torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0)


def group_max(v: torch.Tensor, source_out: int, head_dim: int) -> torch.Tensor:
    """[n_heads * head_dim] per-column values of a GQA o_proj -> [n_kv * head_dim], max over each group's heads."""
    n_kv = source_out // head_dim
    return v.reshape(n_kv, -1, head_dim).amax(dim=1).reshape(-1)


def expand_gqa(s: torch.Tensor, target_in: int, head_dim: int) -> torch.Tensor:
    """[n_kv * head_dim] scales on v's channels -> [n_heads * head_dim] on o_proj's columns (query head h
    reads kv head h // group)."""
    n_kv = s.numel() // head_dim
    group = target_in // s.numel()
    return s.reshape(n_kv, 1, head_dim).expand(n_kv, group, head_dim).reshape(-1)


def smoothquant_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float,
                       min_scale: float = 1e-5) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha); channels with no signal (zero activation or weight
    range) keep s = 1."""
    a = act_absmax.float()
    w = weight_absmax.float()
    s = a.pow(alpha) / w.pow(1 - alpha)
    ok = (a > 0) & (w > 0) & torch.isfinite(s)
    return torch.where(ok, s.clamp_min(min_scale), torch.ones_like(s))


def fold_into_norm(weight: torch.Tensor, s: torch.Tensor, gemma: bool = False) -> torch.Tensor:
    """The norm weight that divides the norm's output channel j by s_j."""
    w = weight.float()
    return ((1 + w) / s - 1) if gemma else w / s


def scale_columns(weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W[:, j] * s_j: the consumer's compensation for an input divided by s."""
    return weight.float() * s[None, :]


def scale_rows(weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W[i, :] / s_i: a producing linear whose output channel i is divided by s_i."""
    return weight.float() / s[:, None]


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data.copy_(value.to(param.dtype))


@torch.no_grad()
def apply_smoothing(layer: nn.Module, mapping: ResolvedSmoothing, s: torch.Tensor) -> None:
    """Fold `s` (one scale per channel of the source's output) into the layer in place, math in fp32:
    the source divides, every target (routers included) multiplies its columns."""
    source = layer.get_submodule(mapping.source)
    s = s.float().to(source.weight.device)
    if mapping.kind in ("norm", "gemma_norm"):
        _assign(source.weight, fold_into_norm(source.weight, s, gemma=mapping.kind == "gemma_norm"))
    else:
        _assign(source.weight, scale_rows(source.weight, s))
    if getattr(source, "bias", None) is not None:
        _assign(source.bias, source.bias.float() / s)
    for name in mapping.targets:
        target = layer.get_submodule(name)
        cols = expand_gqa(s, target.weight.shape[1], mapping.head_dim) if mapping.head_dim else s
        _assign(target.weight, scale_columns(target.weight, cols))


__all__ = [
    "ResolvedSmoothing", "apply_smoothing", "channel_absmax", "expand_gqa", "fold_into_norm", "group_max",
    "resolve_mappings", "scale_columns", "scale_rows", "smoothquant_scales", "weight_column_absmax",
]
