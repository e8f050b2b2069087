"""Checks, at load, that a quantised linear's tensors agree with its config group and the model's shape.

A mismatch (a truncated or hand-edited checkpoint, a config that does not describe the tensors) would
otherwise surface as a wrong-shaped matmul deep inside a forward pass, or as silently wrong numbers. Each
check names the tensor and what it should have been; the error exits 1.
"""

from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.formats.compressors import scale_shape
from quantkit.runtime.formats import LinearFormat


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def expected_scale_shape(fmt: LinearFormat, n: int, k: int) -> tuple[int, ...] | None:
    """The stored weight_scale shape; None where only the element count is fixed (tensor: one scale)."""
    return None if fmt.weights.strategy == "tensor" else scale_shape(fmt.weights, n, k)


def check_linear_tensors(where: str, name: str, fmt: LinearFormat, tensors: dict[str, torch.Tensor],
                         in_features: int, out_features: int) -> None:
    n, k = out_features, in_features
    w = fmt.weights

    def bad(tensor: str, message: str) -> None:
        raise QuantkitError(f"{where}: {name}.{tensor} {message}", exit_code=1)

    compressor = fmt.compressor
    shape = tensors.get("weight_shape")
    if shape is not None:
        got = [int(v) for v in shape.flatten().tolist()]
        if got != [n, k]:
            bad("weight_shape", f"is {got} but the model config makes this linear [{n}, {k}]")
    values = compressor.values_tensor
    t = tensors[values]
    dtype, want = compressor.value_spec(w, n, k)
    if t.dtype != dtype or tuple(t.shape) != want:
        if values == "weight_packed":
            bad(values, f"is {_name(t.dtype)} {_shape(t)} but {n} x {k} {w.num_bits}-bit values pack into "
                f"{_name(dtype)} {list(want)}")
        elif tuple(t.shape) != want:
            bad(values, f"has shape {_shape(t)} but the model config makes this linear [{n}, {k}]")
        else:
            bad(values, f"is {_name(t.dtype)} but {fmt.format} {w.type} weights are {_name(dtype)}")
    scale = tensors["weight_scale"]
    want_scale = expected_scale_shape(fmt, n, k)
    if want_scale is None:
        if scale.numel() != 1:
            bad("weight_scale", f"has shape {_shape(scale)} but a tensor-wise scale is one value")
    elif tuple(scale.shape) != want_scale and not (w.strategy == "channel" and _shape(scale) == [n]):
        what = f"groups of {w.group_size}" if w.strategy == "group" else w.strategy
        bad("weight_scale", f"has shape {_shape(scale)} but {w.strategy} scales of a [{n}, {k}] weight ({what}) "
            f"are {list(want_scale)}")
    want_dtype = compressor.scale_dtype
    if want_dtype is not None and scale.dtype != want_dtype:
        bad("weight_scale", f"is {_name(scale.dtype)} but {fmt.format} stores {_name(want_dtype)} scales")
    if want_dtype is None and not scale.is_floating_point():
        bad("weight_scale", f"is {_name(scale.dtype)}, not a floating-point tensor")
    if w.fp4_global:
        gs = tensors.get("weight_global_scale")
        if gs is None or gs.numel() != 1:
            bad("weight_global_scale", "is missing or not one value, but NVFP4 weights need one global scale")
    if fmt.weights.is_fp4 and k % w.group_size:
        bad(compressor.values_tensor, f"covers {k} input columns, not a multiple of fp4's groups of {w.group_size}")
    zp = tensors.get("weight_zero_point")
    if not w.symmetric:
        if zp is None:
            bad("weight_zero_point", "is missing but the config says the weights are asymmetric")
        if want_scale is None:  # tensor-wise: one zero point, however it is stored
            ok, want_zp = zp.numel() == 1, [1]
        else:
            # As the format stores them (pack-quantized packs them along the output dimension).
            want_zp = list(compressor.zero_point_spec(w, tuple(scale.shape))[1])
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
