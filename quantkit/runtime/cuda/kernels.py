"""The CUDA kernels of csrc/cuda behind the runtime's kernel protocol (`runtime.kernels.base.Kernel`).

Each kernel class is built over a launcher (`runtime.DRIVER` on a GPU, `emulator.EmulatorLauncher` for
`--kernels cuda-emulated` on CPU tensors) and is otherwise the same code: `supports` checks the format, the
activation dtype and the launcher's device; `prepare` compiles (or finds) the entries it will launch, so a
kernel that does not compile refuses the layer in one line and the next kernel or the reference takes it, then
repacks once (scales to fp32, zero points unpacked from their output-dim packing, the checkpoint's packed / int8 /
e4m3 weight kept as written, no copy); `run` launches. A launch that fails at run time names the kernel and its
error in one line and that layer runs the torch reference from then on, from the checkpoint tensors its
prepared weights still hold.

The ops outside the linear protocol (the MoE align/sort and grouped GEMM, absorbed MLA decode, the tree mask)
are functions over a launcher here, each with its torch reference; `runtime/cuda/ops.py` wires them into the
runtime's modules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from quantkit.runtime import reference
from quantkit.runtime.cuda.runtime import CudaUnavailable, LaunchError, notice
from quantkit.runtime.formats import LinearFormat
from quantkit.runtime.kernels.base import Prepared

ACT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
GEMV_MAX_M = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x2 = x.reshape(-1, k)
    return x2 if x2.is_contiguous() and x2.data_ptr() % 16 == 0 else x2.contiguous()


def _bias(p: Prepared, dtype):
    return None if p.bias is None else p.bias.to(dtype).contiguous()


@dataclass
class CudaPrepared(Prepared):
    """Common to every CUDA kernel's layout: the format and the layer's checkpoint tensors (the same storages
    the kernel reads, plus the original-dtype scales), so a layer whose launch fails can run the reference."""

    fmt: LinearFormat
    checkpoint: dict

    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + list(self.checkpoint.values())

    def apply(self, fn) -> None:
        super().apply(fn)
        self.checkpoint = {k: fn(v) for k, v in self.checkpoint.items()}

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        from quantkit.runtime.linear import QuantLinear

        layer = QuantLinear(self.fmt, self.checkpoint, self.in_features, self.out_features)
        layer.bias = self.bias
        return reference.linear(x, layer)


def _checkpoint(layer) -> dict:
    return {name: t for name, t in layer.named_buffers(recurse=False) if t is not None}


class CudaKernel:
    """Base of the CUDA linear kernels: the launcher, the protocol's checks and the run-time fallback."""

    op = ""

    def __init__(self, launcher):
        self.launcher = launcher
        self.broken: str | None = None  # the one line of a failed launch: every layer of this kernel falls back

    @property
    def name(self) -> str:
        return f"{self.launcher.name}-{self.op}"

    def supports(self, fmt: LinearFormat, device, shape: tuple[int, int], dtype: torch.dtype) -> bool:
        if dtype not in ACT_DTYPES or torch.device(device).type != self.launcher.device_type or self.broken:
            return False
        if not self.covers(fmt, shape):
            return False
        ok, line = self.launcher.ready()
        if not ok:
            notice(line)
        return ok

    def prepare(self, layer) -> CudaPrepared:
        for entry in self.entries(ACT_DTYPES[layer.compute_dtype]):
            self.launcher.load(entry)  # CudaUnavailable (one line) -> the dispatch point tries the next kernel
        return self.repack(layer)

    def run(self, x: torch.Tensor, p: CudaPrepared) -> torch.Tensor:
        if x.dtype not in ACT_DTYPES or self.broken:
            return p.reference(x)
        try:
            return self.launch(x, p)
        except (CudaUnavailable, LaunchError) as exc:
            self.broken = f"{self.name}: {str(exc).splitlines()[0]}; its layers run the torch reference"
            notice(self.broken)
            return p.reference(x)

    # Per kernel:
    def covers(self, fmt: LinearFormat, shape: tuple[int, int]) -> bool:
        raise NotImplementedError

    def entries(self, suffix: str) -> list[str]:
        raise NotImplementedError

    def repack(self, layer) -> CudaPrepared:
        raise NotImplementedError

    def launch(self, x: torch.Tensor, p: CudaPrepared) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class WNA16Prepared(CudaPrepared):
    wq: torch.Tensor  # the checkpoint's int32 words, [N, KW]
    scale: torch.Tensor  # fp32 [N, G]
    zp: torch.Tensor | None  # int8 [N, G]
    gidx: torch.Tensor | None  # int32 [K], act-order only
    group: int


class WNA16Kernel(CudaKernel):
    """pack-quantized int4 / int8 weights, bf16/fp16 activations: GEMV for M <= 16, mma.sync GEMM above."""

    def __init__(self, bits: int, launcher):
        super().__init__(launcher)
        self.bits = bits
        self.op = f"w{bits}a16"

    def covers(self, fmt: LinearFormat, shape) -> bool:
        w = fmt.weights
        vpw = 32 // self.bits
        if fmt.format != "pack-quantized" or fmt.input is not None or w.type != "int" or w.num_bits != self.bits:
            return False
        if w.strategy not in ("group", "channel") or shape[1] % 8:
            return False
        return not (w.strategy == "group" and (w.group_size or 0) % vpw)  # one word never straddles two groups

    def entries(self, suf: str) -> list[str]:
        return [f"qk_w{self.bits}a16_gemv_{suf}", f"qk_w{self.bits}a16_gemm_{suf}"]

    def repack(self, layer) -> WNA16Prepared:
        w = layer.fmt.weights
        n, k = layer.out_features, layer.in_features
        zp = reference.zero_point(layer)
        g_idx = getattr(layer, "weight_g_idx", None)
        if g_idx is not None and torch.equal(g_idx.long().cpu(), torch.arange(k) // (w.group_size or k)):
            g_idx = None  # a trivial g_idx (what compressed-tensors writes without act-order) costs loads for nothing
        return WNA16Prepared(
            k, n, layer.bias, layer.fmt, _checkpoint(layer), wq=layer.weight_packed.contiguous(),
            scale=layer.weight_scale.float().reshape(n, -1).contiguous(),
            zp=None if zp is None else zp.to(torch.int8).reshape(n, -1).contiguous(),
            gidx=None if g_idx is None else g_idx.to(torch.int32).contiguous(),
            group=w.group_size if w.strategy == "group" else k)

    def launch(self, x: torch.Tensor, p: WNA16Prepared) -> torch.Tensor:
        suf = ACT_DTYPES[x.dtype]
        n, k = p.out_features, p.in_features
        x2 = _rows(x, k)
        m = x2.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        args = (x2, p.wq, p.scale, p.zp, p.gidx, _bias(p, x.dtype), out, m, n, k, p.wq.shape[1], p.scale.shape[1],
                p.group)
        if m <= GEMV_MAX_M:
            self.launcher.launch(f"qk_w{self.bits}a16_gemv_{suf}", (_cdiv(n, 4), 1, 1), (128, 1, 1), *args)
        else:
            self.launcher.launch(f"qk_w{self.bits}a16_gemm_{suf}", (_cdiv(n, 64), _cdiv(m, 64), 1), (128, 1, 1), *args)
        return out.reshape(*x.shape[:-1], n)


@dataclass
class ScaledPrepared(CudaPrepared):
    w: torch.Tensor  # int8 [N, K] (W8A8) or e4m3 bytes [N, K] (FP8)
    ws: torch.Tensor  # fp32 weight scales: [N] per channel, or [ceil(N/128), ceil(K/128)] per block


class Int8Kernel(CudaKernel):
    """W8A8: int8 weights (channel / tensor scale, symmetric), dynamic symmetric per-token int8 activations."""

    op = "w8a8-int8"

    def covers(self, fmt: LinearFormat, shape) -> bool:
        w, a = fmt.weights, fmt.input
        if fmt.format not in ("int-quantized", "naive-quantized") or a is None or w.type != "int" or w.num_bits != 8:
            return False
        if not w.symmetric or w.strategy not in ("channel", "tensor"):
            return False
        if a.type != "int" or a.num_bits != 8 or not a.dynamic or a.strategy != "token" or not a.symmetric:
            return False
        return shape[1] % 16 == 0

    def entries(self, suf: str) -> list[str]:
        return [f"qk_int8_quant_token_{suf}", f"qk_int8_gemm_{suf}"]

    def repack(self, layer) -> ScaledPrepared:
        n = layer.out_features
        ws = layer.weight_scale.float().reshape(-1).expand(n).contiguous()
        return ScaledPrepared(layer.in_features, n, layer.bias, layer.fmt, _checkpoint(layer),
                              w=layer.weight.to(torch.int8).contiguous(), ws=ws)

    def launch(self, x: torch.Tensor, p: ScaledPrepared) -> torch.Tensor:
        suf = ACT_DTYPES[x.dtype]
        n, k = p.out_features, p.in_features
        x2 = _rows(x, k)
        m = x2.shape[0]
        q = torch.empty(m, k, dtype=torch.int8, device=x.device)
        xs = torch.empty(m, dtype=torch.float32, device=x.device)
        self.launcher.launch(f"qk_int8_quant_token_{suf}", (m, 1, 1), (256, 1, 1), x2, q, xs, m, k)
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        self.launcher.launch(f"qk_int8_gemm_{suf}", (_cdiv(n, 64), _cdiv(m, 64), 1), (128, 1, 1),
                             q, xs, p.w, p.ws, _bias(p, x.dtype), out, m, n, k)
        return out.reshape(*x.shape[:-1], n)


class Fp8BlockKernel(CudaKernel):
    """FP8 e4m3 weights with 128x128 block scales, dynamic 1x128-group e4m3 activations (DeepSeek-V3)."""

    op = "fp8-block"

    def covers(self, fmt: LinearFormat, shape) -> bool:
        w, a = fmt.weights, fmt.input
        if fmt.format != "float-quantized" or w.type != "float" or w.strategy != "block":
            return False
        if tuple(w.block or ()) != (128, 128) or a is None or a.type != "float":
            return False
        return bool(a.dynamic and a.strategy == "group" and a.group_size == 128)

    def entries(self, suf: str) -> list[str]:
        ok, arch = self.launcher.ready()
        if ok and arch in ("sm_80", "sm_86", "sm_87", "sm_88"):
            notice(f"FP8 block GEMM on {arch}: no FP8 tensor cores; the kernel widens e4m3 to bf16 for "
                   "mma.sync (same block-scale promotion)")
        return [f"qk_fp8_quant_group_{suf}", f"qk_fp8_block_gemm_{suf}"]

    def repack(self, layer) -> ScaledPrepared:
        return ScaledPrepared(layer.in_features, layer.out_features, layer.bias, layer.fmt, _checkpoint(layer),
                              w=layer.weight.view(torch.uint8).contiguous(), ws=layer.weight_scale.float().contiguous())

    def launch(self, x: torch.Tensor, p: ScaledPrepared) -> torch.Tensor:
        suf = ACT_DTYPES[x.dtype]
        n, k = p.out_features, p.in_features
        x2 = _rows(x, k)
        m, g = x2.shape[0], _cdiv(k, 128)
        q = torch.empty(m, k, dtype=torch.uint8, device=x.device)
        xs = torch.empty(m, g, dtype=torch.float32, device=x.device)
        self.launcher.launch(f"qk_fp8_quant_group_{suf}", (_cdiv(g, 4), m, 1), (128, 1, 1), x2, q, xs, m, k)
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        self.launcher.launch(f"qk_fp8_block_gemm_{suf}", (_cdiv(n, 64), _cdiv(m, 64), 1), (128, 1, 1),
                             q, xs, p.w, p.ws, _bias(p, x.dtype), out, m, n, k)
        return out.reshape(*x.shape[:-1], n)


def linear_kernels(launcher) -> list[CudaKernel]:
    """One kernel per op kind over `launcher`, in the order the dispatch point tries them."""
    return [WNA16Kernel(4, launcher), WNA16Kernel(8, launcher), Int8Kernel(launcher), Fp8BlockKernel(launcher)]


# ---- ops outside the linear protocol: MoE, MLA decode, tree mask (each with its torch reference) ----

MOE_BLOCK = 64


def moe_align(launcher, topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted [numel + E * 63], expert_ids [max_blocks], total [1]) for qk_moe_*_gemm; see wna16.cu.
    An id outside [0, E) (a dropped slot) lands in no expert's block: its output row stays unwritten."""
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    numel = ids.numel()
    if num_experts > 1024:
        raise ValueError("qk_moe_align handles at most 1024 experts")
    cap = numel + num_experts * (MOE_BLOCK - 1)
    max_blocks = _cdiv(cap, MOE_BLOCK)
    sorted_ids = torch.full((max_blocks * MOE_BLOCK,), numel, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    total = torch.empty(1, dtype=torch.int32, device=ids.device)
    launcher.launch("qk_moe_align", (1, 1, 1), (1024, 1, 1), ids, numel, num_experts, MOE_BLOCK, max_blocks,
                    sorted_ids, expert_ids, total)
    return sorted_ids, expert_ids, total


@dataclass
class StackedExperts:
    """E experts' weights of one projection stacked for qk_moe_w{bits}a16_gemm (same shape and format)."""

    wq: torch.Tensor  # [E, N, KW]
    scale: torch.Tensor  # [E, N, G] fp32
    zp: torch.Tensor | None  # [E, N, G] int8
    group: int
    n: int
    k: int
    bits: int

    @property
    def e(self) -> int:
        return self.wq.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return [t for f in dataclasses.fields(self) if isinstance(t := getattr(self, f.name), torch.Tensor)]


def stack_experts(preps: list[WNA16Prepared], bits: int) -> StackedExperts:
    """Stack E experts' prepared weights; each expert's own prepared tensors then become views of the stack, so
    the stack costs no memory beyond one copy (the per-expert views still serve the reference and per-expert runs)."""
    if any(p.gidx is not None for p in preps):
        raise ValueError("the MoE grouped GEMM does not take act-order experts")
    if len({(p.out_features, p.in_features, p.group, p.scale.shape[1]) for p in preps}) != 1:
        raise ValueError("the MoE grouped GEMM needs experts of one shape and group size")
    zps = [p.zp for p in preps]
    stacked = StackedExperts(
        wq=torch.stack([p.wq for p in preps]).contiguous(), scale=torch.stack([p.scale for p in preps]).contiguous(),
        # A symmetric expert among asymmetric ones gets zero zero points (one kernel argument for all).
        zp=None if all(z is None for z in zps) else torch.stack(
            [z if z is not None else torch.zeros_like(p.scale, dtype=torch.int8) for z, p in zip(zps, preps)]).contiguous(),
        group=preps[0].group, n=preps[0].out_features, k=preps[0].in_features, bits=bits)
    for e, p in enumerate(preps):
        p.wq, p.scale = stacked.wq[e], stacked.scale[e]
        if p.zp is not None:
            p.zp = stacked.zp[e]
    return stacked


def moe_gemm(launcher, x: torch.Tensor, experts: StackedExperts, topk_ids: torch.Tensor,
             row_weights: torch.Tensor | None = None, rows_per_token: int | None = None, align=None) -> torch.Tensor:
    """out[t * top_k + j] = x_row @ W[topk_ids[t, j]]^T (times row_weights[t * top_k + j]); x_row is x[t] when
    x has one row per token (gate/up) or x[t * top_k + j] when it has one per (token, choice) (down)."""
    suf = ACT_DTYPES[x.dtype]
    numel = topk_ids.numel()
    a_div = rows_per_token or (topk_ids.shape[-1] if x.reshape(-1, experts.k).shape[0] != numel else 1)
    sorted_ids, expert_ids, _ = align or moe_align(launcher, topk_ids, experts.e)
    x2 = _rows(x, experts.k)
    out = torch.zeros(numel, experts.n, dtype=x.dtype, device=x.device)  # dropped slots' rows stay zero
    rw = None if row_weights is None else row_weights.reshape(-1).float().contiguous()
    launcher.launch(f"qk_moe_w{experts.bits}a16_gemm_{suf}", (_cdiv(experts.n, 64), expert_ids.numel(), 1),
                    (128, 1, 1), x2, experts.wq, experts.scale, experts.zp, out, sorted_ids, expert_ids, rw,
                    a_div, numel, experts.n, experts.k, experts.wq.shape[2], experts.scale.shape[2], experts.group)
    return out


def moe_gemm_reference(x, dense_experts: list[torch.Tensor], topk_ids, row_weights=None, rows_per_token=None):
    """Torch reference of moe_gemm over dense [N, K] expert weights."""
    ids = topk_ids.reshape(-1)
    x2 = x.reshape(-1, dense_experts[0].shape[1])
    a_div = rows_per_token or (topk_ids.shape[-1] if x2.shape[0] != ids.numel() else 1)
    rows = x2[torch.arange(ids.numel(), device=x.device) // a_div]
    out = torch.stack([rows[i] @ dense_experts[int(e)].to(x.dtype).t() for i, e in enumerate(ids.tolist())])
    if row_weights is not None:
        out = (out.float() * row_weights.reshape(-1, 1).float()).to(x.dtype)
    return out


def mla_decode(launcher, q: torch.Tensor, cache: torch.Tensor, seq_lens: torch.Tensor, kv_lora_rank: int,
               scale: float = 1.0, splits: int | None = None) -> torch.Tensor:
    """Absorbed MLA decode: q [B, H, D], cache [B, S, D] bf16 (latent then rope), seq_lens [B] -> [B, H, DV]."""
    b, h, d = q.shape
    if q.dtype != torch.bfloat16 or cache.dtype != torch.bfloat16 or d > 576 or d % 8 or kv_lora_rank > 512:
        raise ValueError("qk_mla_decode takes bf16, D <= 576 with D % 8 == 0 and kv_lora_rank <= 512")
    if cache.stride(2) != 1 or cache.stride(1) != d or cache.stride(0) % 8:
        raise ValueError("the cache must be [B, S, D] with contiguous rows")
    if splits is None:  # enough blocks to fill the GPU once, about 64 tokens per split at least
        splits = max(1, min(_cdiv(int(seq_lens.max()), 64), _cdiv(2 * launcher.multiprocessors(q.device), b * _cdiv(h, 16))))
    q = q.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    o_part = torch.empty(b, h, splits, kv_lora_rank, dtype=torch.float32, device=q.device)
    ml = torch.empty(b, h, splits, 2, dtype=torch.float32, device=q.device)
    launcher.launch("qk_mla_decode_split", (splits, _cdiv(h, 16), b), (256, 1, 1), q, cache, lens, o_part, ml,
                    h, d, kv_lora_rank, cache.stride(0), splits, float(scale))
    out = torch.empty(b, h, kv_lora_rank, dtype=torch.bfloat16, device=q.device)
    launcher.launch("qk_mla_decode_combine", (b * h, 1, 1), (128, 1, 1), o_part, ml, out, kv_lora_rank, splits)
    return out


def mla_decode_reference(q, cache, seq_lens, kv_lora_rank: int, scale: float = 1.0) -> torch.Tensor:
    outs = []
    for i, n in enumerate(seq_lens.tolist()):
        kv = cache[i, :n].float()
        p = torch.softmax((q[i].float() @ kv.t()) * scale, dim=-1)
        outs.append(p @ kv[:, :kv_lora_rank])
    return torch.stack(outs).to(q.dtype)


def tree_mask(launcher, parents: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """[T, P + T] uint8 verification mask of a draft tree (parents[i] < i, -1 = child of the prefix)."""
    t = parents.numel()
    if t > 1024:
        raise ValueError("qk_tree_mask handles at most 1024 draft tokens")
    par = parents.to(torch.int32).contiguous()
    mask = torch.empty(t, prefix_len + t, dtype=torch.uint8, device=parents.device)
    launcher.launch("qk_tree_mask", (t, 1, 1), (128, 1, 1), par, t, prefix_len, mask)
    return mask


def tree_mask_reference(parents: torch.Tensor, prefix_len: int) -> torch.Tensor:
    t = parents.numel()
    mask = torch.zeros(t, prefix_len + t, dtype=torch.uint8)
    mask[:, :prefix_len] = 1
    for i in range(t):
        a = i
        while a >= 0:
            mask[i, prefix_len + a] = 1
            a = int(parents[a])
    return mask
