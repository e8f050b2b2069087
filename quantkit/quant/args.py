"""QuantArgs: how one tensor is quantised, a linear's weights or its input activations alike.

The fields quantkit reads from and writes to a compressed-tensors `QuantizationArgs`. The quantisation
methods, the checkpoint writer, the config reader and the runtime all use this one type.
"""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group")
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP4_MAX = 6.0  # e2m1's largest value
# fp4 (e2m1) comes in two layouts: NVFP4, groups of 16 under e4m3 scales and a tensor-wide global scale
# (strategy "tensor_group"), and MXFP4, groups of 32 under power-of-two e8m0 scales (strategy "group").
FP4_GROUPS = {"tensor_group": 16, "group": 32}


@dataclass(frozen=True)
class QuantArgs:
    num_bits: int = 4
    symmetric: bool = True
    strategy: str = "group"  # tensor | channel | group | block (fp8 weights) | token (activations) | tensor_group
    # (NVFP4: e4m3 group scales under a global scale; for activations the group scales are dynamic, the global
    # one static, compressed-tensors' dynamic "local")
    group_size: int | None = 128  # the group strategy's; None for every other strategy
    type: str = "int"  # "int" | "float" (fp8 e4m3)
    block: tuple[int, int] | None = None  # [rows, cols] of a weight block, for strategy "block"
    dynamic: bool = False  # activations: scales computed at run time (False: a static `input_scale`)
    actorder: str | None = None  # weights: GPTQ activation order as stored ("group": a weight_g_idx tensor)

    def __post_init__(self) -> None:
        if self.type not in ("int", "float"):
            raise ValueError(f"unknown quantisation type {self.type!r}")
        if not 1 <= self.num_bits <= 8:
            raise ValueError(f"num_bits must be in 1..8, got {self.num_bits}")
        if self.type == "float" and self.num_bits not in (4, 8):
            raise ValueError(f"{self.num_bits}-bit float quantisation is not supported (fp8 e4m3 and fp4 e2m1 only)")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}")
        if self.is_fp4:
            want = FP4_GROUPS.get(self.strategy)
            if want is None or self.group_size != want or not self.symmetric:
                raise ValueError("fp4 is NVFP4 (symmetric, tensor_group of 16) or MXFP4 (symmetric, group of 32); got "
                                 f"{self.strategy} with group size {self.group_size}")
        elif self.strategy == "tensor_group":
            raise ValueError("the tensor_group strategy is fp4's (NVFP4) only")
        if self.strategy in ("group", "tensor_group"):
            if self.group_size is None or self.group_size <= 0:
                raise ValueError("group strategy needs a positive group_size")
        elif self.group_size is not None:
            object.__setattr__(self, "group_size", None)  # meaningless outside groups: one spelling per args
        if self.strategy == "block":
            if self.block is None or len(self.block) != 2 or min(self.block) <= 0:
                raise ValueError("block strategy needs a [rows, cols] block shape")
            object.__setattr__(self, "block", tuple(int(b) for b in self.block))
        elif self.block is not None:
            object.__setattr__(self, "block", None)

    @property
    def is_fp4(self) -> bool:
        return self.type == "float" and self.num_bits == 4

    @property
    def is_fp8(self) -> bool:
        return self.type == "float" and self.num_bits == 8

    @property
    def fp4_global(self) -> bool:
        """NVFP4's layout: a tensor-wide global scale over e4m3 group scales."""
        return self.is_fp4 and self.strategy == "tensor_group"

    @property
    def qmin(self) -> int | float:
        return -self.qmax if self.type == "float" else -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int | float:
        if self.type == "float":
            return FP4_MAX if self.num_bits == 4 else FP8_MAX
        return (1 << (self.num_bits - 1)) - 1

    @property
    def half_range(self) -> float:
        """(qmax - qmin) / 2, the symmetric scale divisor (int4: 7.5, int8: 127.5, fp8 e4m3: 448)."""
        return (self.qmax - self.qmin) / 2

    def num_groups(self, in_features: int) -> int:
        if self.strategy in ("group", "tensor_group"):
            return -(-in_features // self.group_size)
        return 1
