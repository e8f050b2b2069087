"""How vLLM splits each linear across tensor-parallel ranks, and what a quantised weight needs for the split.

vLLM builds a decoder layer from a few parallel linear types (vllm/model_executor/layers/linear.py):
  * column-parallel (the output dimension N is split): q/k/v (one QKVParallelLinear, split by heads), gate/up
    (one MergedColumnParallelLinear), MLA's q_b_proj / q_proj (no q LoRA) and kv_b_proj, the MoE experts'
    gate/up (w13 of FusedMoE, the intermediate dimension split);
  * row-parallel (the input dimension K is split): o_proj, down_proj, MoE experts' down (w2);
  * replicated (every rank holds all of it): MLA's q_a_proj and kv_a_proj_with_mqa (one merged replicated
    linear when q LoRA is used), routers.
A split must be whole: N/tp or K/tp an integer, heads divisible (kv heads replicated when tp exceeds them).
A grouped weight split along K needs whole groups per rank (the scales are sharded with it); a 128x128 block
weight needs whole blocks along the split dimension, and, inside a merged linear, every part but the last
must hold whole blocks along N even unsplit (vLLM's validate_fp8_block_shape); dynamic 1x128 activation
groups need K/tp to be a multiple of 128.

Both `quantize --tp` (warnings while quantising) and `check-serving` use these rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROW = "row"
COLUMN = "column"
REPLICATED = "replicated"

_REPLICATED = re.compile(r"(^|\.)(q_a_proj|kv_a_proj_with_mqa|gate|router|shared_expert_gate)$")
_ROW = re.compile(r"(^|\.)(o_proj|down_proj|w2|out_proj|dense_4h_to_h|dense)$")
# Parts of a merged linear that another part follows (v_proj / up_proj / w3 close their merge).
_MERGED_NOT_LAST = re.compile(r"(^|\.)(q_proj|k_proj|gate_proj|w1|q_a_proj)$")
_MERGE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"),
                 ("q_a_proj", "kv_a_proj_with_mqa"))


def parallel_style(module: str) -> str:
    if _REPLICATED.search(module):
        return REPLICATED
    return ROW if _ROW.search(module) else COLUMN


def is_row_parallel(module: str) -> bool:
    return parallel_style(module) == ROW


def merge_key(module: str) -> tuple[str, int] | None:
    """(the merged linear's name, this part's position) when vLLM fuses `module` with its siblings."""
    prefix, _, leaf = module.rpartition(".")
    for group in _MERGE_GROUPS:
        if leaf in group:
            return f"{prefix}.{'+'.join(group)}" if prefix else "+".join(group), group.index(leaf)
    return None


@dataclass(frozen=True)
class QuantShape:
    """What the split rules need from a linear's quantisation."""

    strategy: str  # "group" | "channel" | "tensor" | "block"
    group_size: int | None = None
    block: tuple[int, int] | None = None
    act_group: int | None = None  # dynamic per-group activation quantisation (FP8_BLOCK: 128)

    @classmethod
    def from_scheme(cls, scheme) -> "QuantShape":
        w, a = scheme.weights, scheme.input_activations
        return cls(w.strategy, w.group_size, tuple(w.block) if w.block else None,
                   a.group_size if a is not None and a.strategy == "group" else None)

    @classmethod
    def from_format(cls, fmt) -> "QuantShape":
        """From a parsed compressed-tensors config group (quantkit.runtime.formats.LinearFormat)."""
        w, a = fmt.weights, fmt.input
        return cls(w.strategy, w.group_size, tuple(w.block) if w.block else None,
                   a.group_size if a is not None and a.strategy == "group" else None)


@dataclass(frozen=True)
class Heads:
    """Attention head counts that bound how q/k/v may be split (None: N alone decides)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


def shard_sizes(module: str, out_features: int, in_features: int, tp: int,
                heads: Heads | None = None) -> tuple[int, int] | str:
    """(N, K) one rank holds, or why the split is impossible."""
    style = parallel_style(module)
    if style == REPLICATED or tp == 1:
        return out_features, in_features
    if style == ROW:
        if in_features % tp:
            return f"K={in_features} is not divisible by tp={tp}"
        return out_features, in_features // tp
    leaf = module.rpartition(".")[2]
    if heads is not None and leaf in ("k_proj", "v_proj") and out_features == heads.num_kv_heads * heads.head_dim:
        kv = heads.num_kv_heads
        if tp >= kv:
            if tp % kv:
                return f"{kv} KV heads cannot be replicated over tp={tp} (tp must be a multiple of them)"
            return heads.head_dim, in_features  # one KV head per rank, replicated
        if kv % tp:
            return f"{kv} KV heads are not divisible by tp={tp}"
        return out_features // tp, in_features
    if heads is not None and leaf == "q_proj" and out_features == heads.num_heads * heads.head_dim:
        if heads.num_heads % tp:
            return f"{heads.num_heads} attention heads are not divisible by tp={tp}"
    if out_features % tp:
        return f"N={out_features} is not divisible by tp={tp}"
    return out_features // tp, in_features


def split_problem(module: str, out_features: int, in_features: int, quant: QuantShape, tp: int,
                  heads: Heads | None = None) -> str | None:
    """Why `module` cannot be split `tp` ways with this quantisation, or None."""
    style = parallel_style(module)
    if quant.strategy == "block" and _MERGED_NOT_LAST.search(module) and style != ROW:
        n = out_features if style == REPLICATED else out_features // max(tp, 1)
        if n % quant.block[0]:
            return f"N/tp = {n} is not a multiple of the block {quant.block[0]} inside vLLM's merged linear"
    sizes = shard_sizes(module, out_features, in_features, tp, heads)
    if isinstance(sizes, str):
        return sizes
    n_part, k_part = sizes
    if tp == 1 or style == REPLICATED:
        return None  # unsplit: a ragged last block or group is the quantiser's business, not the split's
    if quant.strategy == "block":
        if style == ROW and k_part % quant.block[1]:
            return f"K/tp = {k_part} is not a multiple of the {quant.block[0]}x{quant.block[1]} block"
        if style == COLUMN and n_part % quant.block[0]:
            return f"N/tp = {n_part} is not a multiple of the {quant.block[0]}x{quant.block[1]} block"
    if quant.strategy == "group" and style == ROW and k_part % quant.group_size:
        return f"K/tp = {k_part} is not a multiple of group size {quant.group_size}"
    if style == ROW and quant.act_group and k_part % quant.act_group:
        return f"K/tp = {k_part} is not a multiple of the activation group {quant.act_group}"
    return None
