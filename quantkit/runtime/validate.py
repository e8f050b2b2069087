"""Checks, at load, that a quantised linear's tensors agree with its config group and the model's shape.

A mismatch (a truncated or hand-edited checkpoint, a config that does not describe the tensors) would
otherwise surface as a wrong-shaped matmul deep inside a forward pass, or as silently wrong numbers. Each
check names the tensor and what it should have been; the error exits 1.
"""

from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.quant.packing import packed_columns
from quantkit.runtime.formats import LinearFormat


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def expected_scale_shape(fmt: LinearFormat, n: int, k: int) -> tuple[int, ...] | None:
    """The stored weight_scale shape; None where only the element count is fixed (tensor: one scale)."""
    w = fmt.weights
    if w.strategy == "group":
        return (n, -(-k // w.group_size))
    if w.strategy == "channel":
        return (n, 1)
    if w.strategy == "block":
        bh, bw = w.block_structure
        return (-(-n // bh), -(-k // bw))
    return None


def check_linear_tensors(where: str, name: str, fmt: LinearFormat, tensors: dict[str, torch.Tensor],
                         in_features: int, out_features: int) -> None:
    n, k = out_features, in_features
    w = fmt.weights

    def bad(tensor: str, message: str) -> None:
        raise QuantkitError(f"{where}: {name}.{tensor} {message}", exit_code=1)

    if w.strategy == "group" and not (w.group_size and w.group_size > 0):
        bad("weight_scale", "belongs to a group-quantised config without a positive group_size")
    if w.strategy == "block" and not (w.block_structure and len(w.block_structure) == 2 and min(w.block_structure) > 0):
        bad("weight_scale", "belongs to a block-quantised config without a [rows, cols] block_structure")
    shape = tensors.get("weight_shape")
    if shape is not None:
        got = [int(v) for v in shape.flatten().tolist()]
        if got != [n, k]:
            bad("weight_shape", f"is {got} but the model config makes this linear [{n}, {k}]")
    if fmt.format == "pack-quantized":
        p = tensors["weight_packed"]
        want = [n, packed_columns(k, w.num_bits)]
        if p.dtype != torch.int32 or _shape(p) != want:
            bad("weight_packed", f"is {str(p.dtype).replace('torch.', '')} {_shape(p)} but {n} x {k} {w.num_bits}-bit "
                f"values pack into int32 {want}")
    else:
        t = tensors["weight"]
        dtypes = (torch.float8_e4m3fn,) if w.type == "float" else (torch.int8,)
        if _shape(t) != [n, k]:
            bad("weight", f"has shape {_shape(t)} but the model config makes this linear [{n}, {k}]")
        if t.dtype not in dtypes:
            bad("weight", f"is {str(t.dtype).replace('torch.', '')} but {fmt.format} {w.type} weights are "
                f"{str(dtypes[0]).replace('torch.', '')}")
    scale = tensors["weight_scale"]
    want_scale = expected_scale_shape(fmt, n, k)
    if want_scale is None:
        if scale.numel() != 1:
            bad("weight_scale", f"has shape {_shape(scale)} but a tensor-wise scale is one value")
    elif tuple(scale.shape) != want_scale and not (w.strategy == "channel" and _shape(scale) == [n]):
        what = f"groups of {w.group_size}" if w.strategy == "group" else w.strategy
        bad("weight_scale", f"has shape {_shape(scale)} but {w.strategy} scales of a [{n}, {k}] weight ({what}) "
            f"are {list(want_scale)}")
    if not scale.is_floating_point():
        bad("weight_scale", f"is {str(scale.dtype).replace('torch.', '')}, not a floating-point tensor")
    zp = tensors.get("weight_zero_point")
    if not w.symmetric:
        if zp is None:
            bad("weight_zero_point", "is missing but the config says the weights are asymmetric")
        if want_scale is None:  # tensor-wise: one zero point, however it is stored
            ok, want_zp = zp.numel() == 1, [1]
        else:
            rows, cols = scale.shape[0], (scale.shape[1] if scale.dim() == 2 else 1)
            # pack-quantized packs zero points along the output dimension: ceil(rows * bits / 32) words per column.
            want_zp = [packed_columns(rows, w.num_bits), cols] if fmt.format == "pack-quantized" else _shape(scale)
            ok = _shape(zp) == want_zp
        if not ok:
            bad("weight_zero_point", f"has shape {_shape(zp)} but zero points for weight_scale {_shape(scale)} are "
                f"{want_zp}")
    g_idx = tensors.get("weight_g_idx")
    if g_idx is not None:
        if w.strategy != "group":
            bad("weight_g_idx", f"is present but the weights are {w.strategy}-quantised, not group-quantised")
        if _shape(g_idx) != [k]:
            bad("weight_g_idx", f"has shape {_shape(g_idx)} but this linear has {k} input columns")
        groups = -(-k // w.group_size)
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            bad("weight_g_idx", f"names groups {int(g_idx.min())}..{int(g_idx.max())} but there are {groups}")
    act = fmt.input
    if act is not None and not act.dynamic:
        s = tensors.get("input_scale")
        if s is not None and s.numel() != 1:
            bad("input_scale", f"has shape {_shape(s)} but a static activation scale is one value")
