"""Tensor-parallel shard checks while quantising (`quantize --tp N`): what vLLM would refuse to load.

The rules themselves (vLLM's column/row split per layer type, MLA and MoE included) live in
quantkit/serving/parallel.py, shared with `quantkit check-serving`.
"""

from __future__ import annotations

from quantkit.serving.parallel import QuantShape, is_row_parallel, split_problem

__all__ = ["is_row_parallel", "shard_problem", "tp_warnings"]


def shard_problem(module: str, out_features: int, in_features: int, scheme, tp: int) -> str | None:
    """Why `module` cannot be split `tp` ways under `scheme`, or None."""
    return split_problem(module, out_features, in_features, QuantShape.from_scheme(scheme), tp)


def tp_warnings(plans, tp: int | None) -> list[dict]:
    """One entry per linear that a `tp`-way vLLM deployment (tp None = 1) would refuse."""
    tp = tp or 1
    out = []
    for p in plans:
        for t in p.targets:
            why = shard_problem(t.checkpoint, t.out_features, t.in_features, t.scheme, tp)
            if why:
                out.append({"module": t.checkpoint, "scheme": t.scheme.name, "tp": tp, "problem": why})
    return out
