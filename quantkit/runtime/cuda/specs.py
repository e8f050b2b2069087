"""The launch contract of every `extern "C"` entry in csrc/cuda: its source file and argument kinds.

The Python side launches only through these specs (runtime.launch checks every call against them), and
tests/runtime/cuda/test_compile.py checks each spec against the `.entry` parameter list NVRTC emits, so a
kernel signature change that the Python side does not follow fails CI without a GPU.
Kinds: "ptr" (a device pointer: a tensor or None), "i32", "i64", "f32".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EntrySpec:
    name: str
    source: str
    args: tuple[str, ...]
    hot: bool = False  # a throughput-critical kernel: CI requires ptxas to report no register spills


def _specs() -> dict[str, EntrySpec]:
    out: dict[str, EntrySpec] = {}

    def add(name, source, args, hot=False):
        out[name] = EntrySpec(name, source, tuple(args), hot)

    for suf in ("bf16", "f16"):
        for bits in (4, 8):
            dense = ["ptr"] * 7 + ["i32"] * 6  # x wq scale zp gidx bias out | M N K KW G group
            add(f"qk_w{bits}a16_gemv_{suf}", "wna16.cu", dense, hot=True)
            add(f"qk_w{bits}a16_gemm_{suf}", "wna16.cu", dense, hot=True)
            # x wq scale zp out sorted expert_ids row_w | a_div n_valid N K KW G group
            add(f"qk_moe_w{bits}a16_gemm_{suf}", "wna16.cu", ["ptr"] * 8 + ["i32"] * 7, hot=True)
        add(f"qk_int8_quant_token_{suf}", "w8a8.cu", ["ptr"] * 3 + ["i32"] * 2)
        add(f"qk_int8_gemm_{suf}", "w8a8.cu", ["ptr"] * 6 + ["i32"] * 3, hot=True)
        add(f"qk_fp8_quant_group_{suf}", "fp8_block.cu", ["ptr"] * 3 + ["i32"] * 2)
        add(f"qk_fp8_block_gemm_{suf}", "fp8_block.cu", ["ptr"] * 6 + ["i32"] * 3, hot=True)
    # topk_ids | numel E block_m max_blocks | sorted expert_ids total
    add("qk_moe_align", "wna16.cu", ["ptr"] + ["i32"] * 4 + ["ptr"] * 3)
    # q cache seq_lens o_part ml | H D DV | cache_stride_b | splits | scale
    add("qk_mla_decode_split", "mla_decode.cu", ["ptr"] * 5 + ["i32"] * 3 + ["i64", "i32", "f32"], hot=True)
    add("qk_mla_decode_combine", "mla_decode.cu", ["ptr"] * 3 + ["i32"] * 2)
    add("qk_tree_mask", "mla_decode.cu", ["ptr", "i32", "i32", "ptr"])
    return out


ENTRIES: dict[str, EntrySpec] = _specs()
SOURCES: tuple[str, ...] = tuple(sorted({e.source for e in ENTRIES.values()}))
