"""Tensor-parallel shard checks: what vLLM would refuse to load at a given --tp.

vLLM splits column-parallel linears (q/k/v, gate/up, experts' gate/up) along the output dimension N and
row-parallel ones (o_proj, down_proj, experts' down) along the input dimension K. A block-quantised weight
needs every shard to hold whole blocks (N/tp and K/tp multiples of the block sides); a grouped weight needs
K/tp to hold whole groups when K is split. Either dimension must also divide by tp at all. vLLM also runs
q/k/v and gate/up as one merged linear, and with block scales every merged part but the last must hold
whole blocks along N, even at tp=1.
"""

from __future__ import annotations

import re

ROW_PARALLEL = re.compile(r"(^|\.)(o_proj|down_proj|w2|out_proj|dense_4h_to_h|dense)$")
MERGED_NOT_LAST = re.compile(r"(^|\.)(q_proj|k_proj|gate_proj|w1)$")  # v_proj / up_proj / w3 close their merge


def is_row_parallel(module: str) -> bool:
    return ROW_PARALLEL.search(module) is not None


def shard_problem(module: str, out_features: int, in_features: int, scheme, tp: int) -> str | None:
    """Why `module` cannot be split `tp` ways under `scheme`, or None."""
    w = scheme.weights
    row = is_row_parallel(module)
    if w.strategy == "block" and MERGED_NOT_LAST.search(module) and (out_features // tp) % w.block[0]:
        return f"N/tp = {out_features // tp} is not a multiple of the block {w.block[0]} inside vLLM's merged linear"
    dim_name, dim = ("K", in_features) if row else ("N", out_features)
    if tp == 1:
        return None  # unsplit: a ragged last block is fine
    if dim % tp:
        return f"{dim_name}={dim} is not divisible by tp={tp}"
    shard = dim // tp
    if w.strategy == "block":
        side = w.block[1] if row else w.block[0]
        if shard % side:
            return f"{dim_name}/tp = {shard} is not a multiple of the {w.block[0]}x{w.block[1]} block"
    if w.strategy == "group" and row and shard % w.group_size:
        return f"K/tp = {shard} is not a multiple of group size {w.group_size}"
    acts = getattr(scheme, "input_activations", None)
    if row and acts is not None and acts.strategy == "group" and acts.group_size and shard % acts.group_size:
        return f"K/tp = {shard} is not a multiple of the activation group {acts.group_size}"
    return None


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
