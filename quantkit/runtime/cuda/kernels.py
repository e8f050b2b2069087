"""CUDA kernels behind the kernel protocol: name, supports(fmt, device, shape), prepare(layer), run(x, prepared).

`shape` is the weight's (out_features, in_features). `prepare` is the one-time repack at load (scales to
fp32, zero points unpacked from their output-dim packing, the checkpoint's packed / int8 / e4m3 weight
kept as written); `run` launches on torch's current stream. Anything a kernel does not cover (fp32
activations, static or asymmetric activation scales, odd alignments, a device without the kernels)
answers False in `supports` and the dispatch point uses the next path down (the reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from quantkit.runtime import reference
from quantkit.runtime.cuda import runtime
from quantkit.runtime.formats import LinearFormat

ACT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
GEMV_MAX_M = 16


class Kernel(Protocol):  # the CPU branch's protocol, restated locally until the merge
    name: str

    def supports(self, fmt: LinearFormat, device: torch.device, shape: tuple[int, int]) -> bool: ...

    def prepare(self, layer) -> Any: ...

    def run(self, x: torch.Tensor, prepared: Any) -> torch.Tensor: ...


def _cuda_ready(device: torch.device) -> bool:
    if torch.device(device).type != "cuda":
        return False
    ok, line = runtime.availability()
    if not ok:
        runtime.notice(line)
    return ok


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x2 = x.reshape(-1, k)
    return x2 if x2.is_contiguous() and x2.data_ptr() % 16 == 0 else x2.contiguous()


def _bias(prepared, dtype):
    b = prepared.get("bias")
    return None if b is None else b.to(dtype).contiguous()


@dataclass
class WNA16Kernel:
    """pack-quantized int4 / int8 weights, bf16/fp16 activations: GEMV for M <= 16, mma.sync GEMM above."""

    bits: int

    @property
    def name(self) -> str:
        return f"cuda-w{self.bits}a16"

    def supports(self, fmt: LinearFormat, device, shape) -> bool:
        w = fmt.weights
        out_f, in_f = shape
        vpw = 32 // self.bits
        if fmt.format != "pack-quantized" or fmt.input is not None or w.type != "int" or w.num_bits != self.bits:
            return False
        if w.strategy not in ("group", "channel") or in_f % 8:
            return False
        if w.strategy == "group" and (w.group_size or 0) % vpw:  # one word never straddles two groups
            return False
        return _cuda_ready(device)

    def prepare(self, layer) -> dict:
        w = layer.fmt.weights
        n, k = layer.out_features, layer.in_features
        scale = layer.weight_scale.float().reshape(n, -1).contiguous()
        zp = reference.zero_point(layer)
        g_idx = getattr(layer, "weight_g_idx", None)
        if g_idx is not None and w.actorder is None and torch.equal(g_idx.long().cpu(), torch.arange(k) // (w.group_size or k)):
            g_idx = None  # a trivial g_idx (what compressed-tensors writes without act-order) costs loads for nothing
        return {
            "wq": layer.weight_packed.contiguous(), "scale": scale,
            "zp": None if zp is None else zp.to(torch.int8).reshape(n, -1).contiguous(),
            "gidx": None if g_idx is None else g_idx.to(torch.int32).contiguous(),
            "group": w.group_size if w.strategy == "group" else k,
            "bias": layer.bias, "n": n, "k": k,
        }

    def run(self, x: torch.Tensor, p: dict) -> torch.Tensor:
        suf = ACT_DTYPES[x.dtype]
        n, k = p["n"], p["k"]
        x2 = _rows(x, k)
        m = x2.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        args = (x2, p["wq"], p["scale"], p["zp"], p["gidx"], _bias(p, x.dtype), out,
                m, n, k, p["wq"].shape[1], p["scale"].shape[1], p["group"])
        if m <= GEMV_MAX_M:
            runtime.launch(f"qk_w{self.bits}a16_gemv_{suf}", (_cdiv(n, 4), 1, 1), (128, 1, 1), *args)
        else:
            runtime.launch(f"qk_w{self.bits}a16_gemm_{suf}", (_cdiv(n, 64), _cdiv(m, 64), 1), (128, 1, 1), *args)
        return out.reshape(*x.shape[:-1], n)


class Int8Kernel:
    """W8A8: int8 weights (channel / tensor scale, symmetric), dynamic symmetric per-token int8 activations."""

    name = "cuda-w8a8-int8"

    def supports(self, fmt: LinearFormat, device, shape) -> bool:
        w, a = fmt.weights, fmt.input
        if fmt.format not in ("int-quantized", "naive-quantized") or a is None or w.type != "int" or w.num_bits != 8:
            return False
        if not w.symmetric or w.strategy not in ("channel", "tensor"):
            return False
        if a.type != "int" or a.num_bits != 8 or not a.dynamic or a.strategy != "token" or not a.symmetric:
            return False
        return shape[1] % 16 == 0 and _cuda_ready(device)

    def prepare(self, layer) -> dict:
        n = layer.out_features
        ws = layer.weight_scale.float().reshape(-1).expand(n).contiguous()
        return {"w": layer.weight.to(torch.int8).contiguous(), "ws": ws, "bias": layer.bias, "n": n,
                "k": layer.in_features}

    def run(self, x: torch.Tensor, p: dict) -> torch.Tensor:
        suf = ACT_DTYPES[x.dtype]
        n, k = p["n"], p["k"]
        x2 = _rows(x, k)
        m = x2.shape[0]
        q = torch.empty(m, k, dtype=torch.int8, device=x.device)
        xs = torch.empty(m, dtype=torch.float32, device=x.device)
        runtime.launch(f"qk_int8_quant_token_{suf}", (m, 1, 1), (256, 1, 1), x2, q, xs, m, k)
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        runtime.launch(f"qk_int8_gemm_{suf}", (_cdiv(n, 64), _cdiv(m, 64), 1), (128, 1, 1),
                       q, xs, p["w"], p["ws"], _bias(p, x.dtype), out, m, n, k)
        return out.reshape(*x.shape[:-1], n)


class Fp8BlockKernel:
    """FP8 e4m3 weights with 128x128 block scales, dynamic 1x128-group e4m3 activations (DeepSeek-V3)."""

    name = "cuda-fp8-block"

    def supports(self, fmt: LinearFormat, device, shape) -> bool:
        w, a = fmt.weights, fmt.input
        if fmt.format != "float-quantized" or w.type != "float" or w.strategy != "block":
            return False
        if tuple(w.block or ()) != (128, 128) or a is None or a.type != "float":
            return False
        if not a.dynamic or a.strategy != "group" or a.group_size != 128:
            return False
        if not _cuda_ready(device):
            return False
        _, arch = runtime.availability()
        if arch in ("sm_80", "sm_86", "sm_87", "sm_88"):
            runtime.notice(f"FP8 block GEMM on {arch}: no FP8 tensor cores; the kernel widens e4m3 to bf16 for "
                           "mma.sync (same block-scale promotion)")
        return True

    def prepare(self, layer) -> dict:
        return {"w": layer.weight.view(torch.uint8).contiguous(), "ws": layer.weight_scale.float().contiguous(),
                "bias": layer.bias, "n": layer.out_features, "k": layer.in_features}

    def run(self, x: torch.Tensor, p: dict) -> torch.Tensor:
        suf = ACT_DTYPES[x.dtype]
        n, k = p["n"], p["k"]
        x2 = _rows(x, k)
        m, g = x2.shape[0], _cdiv(k, 128)
        q = torch.empty(m, k, dtype=torch.uint8, device=x.device)
        xs = torch.empty(m, g, dtype=torch.float32, device=x.device)
        runtime.launch(f"qk_fp8_quant_group_{suf}", (_cdiv(g, 4), m, 1), (128, 1, 1), x2, q, xs, m, k)
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        runtime.launch(f"qk_fp8_block_gemm_{suf}", (_cdiv(n, 64), _cdiv(m, 64), 1), (128, 1, 1),
                       q, xs, p["w"], p["ws"], _bias(p, x.dtype), out, m, n, k)
        return out.reshape(*x.shape[:-1], n)


# One kernel per op kind, in the order the dispatch point should try them.
KERNELS: dict[str, Kernel] = {"w4a16": WNA16Kernel(4), "w8a16": WNA16Kernel(8), "int8": Int8Kernel(),
                              "fp8": Fp8BlockKernel()}


def dispatch_fn(kernel: Kernel):
    """Adapter to today's dispatch.register_kernel(kind, "cuda", fn(x, layer)): prepare once per layer and
    device, use the reference when the kernel does not cover the call or the CUDA path is unavailable."""

    def fn(x: torch.Tensor, layer) -> torch.Tensor:
        shape = (layer.out_features, layer.in_features)
        if x.dtype not in ACT_DTYPES or not kernel.supports(layer.fmt, x.device, shape):
            return reference.linear(x, layer)
        cache = layer.__dict__.setdefault("_cuda_prepared", {})
        key = (kernel.name, str(x.device))
        try:
            prepared = cache.get(key)
            if prepared is None:
                prepared = cache[key] = kernel.prepare(layer)
            return kernel.run(x, prepared)
        except runtime.CudaUnavailable as e:
            runtime.notice(str(e))
            return reference.linear(x, layer)

    fn.__name__ = f"{kernel.name}_linear"
    return fn


# ---- ops outside the linear protocol: MoE, MLA decode, tree mask (with their torch references) ----

MOE_BLOCK = 64


def moe_align(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted [numel + E * 63], expert_ids [max_blocks], total [1]) for qk_moe_*_gemm; see wna16.cu."""
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    numel = ids.numel()
    if num_experts > 1024:
        raise ValueError("qk_moe_align handles at most 1024 experts")
    cap = numel + num_experts * (MOE_BLOCK - 1)
    max_blocks = _cdiv(cap, MOE_BLOCK)
    sorted_ids = torch.empty(max_blocks * MOE_BLOCK, dtype=torch.int32, device=ids.device)
    sorted_ids.fill_(numel)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    total = torch.empty(1, dtype=torch.int32, device=ids.device)
    runtime.launch("qk_moe_align", (1, 1, 1), (1024, 1, 1), ids, numel, num_experts, MOE_BLOCK, max_blocks,
                   sorted_ids, expert_ids, total)
    return sorted_ids, expert_ids, total


def prepare_moe_experts(layers: list, bits: int = 4) -> dict:
    """Stack E expert QuantLinears (same shape, pack-quantized, no act-order) for qk_moe_w{bits}a16_gemm."""
    preps = [WNA16Kernel(bits).prepare(l) for l in layers]
    if any(p["gidx"] is not None for p in preps):
        raise ValueError("the MoE grouped GEMM does not take act-order experts")
    zps = [p["zp"] for p in preps]
    return {"wq": torch.stack([p["wq"] for p in preps]).contiguous(),
            "scale": torch.stack([p["scale"] for p in preps]).contiguous(),
            # A symmetric expert among asymmetric ones gets zero zero points (one kernel argument for all).
            "zp": None if all(z is None for z in zps) else torch.stack(
                [z if z is not None else torch.zeros_like(p["scale"], dtype=torch.int8) for z, p in zip(zps, preps)]
            ).contiguous(),
            "group": preps[0]["group"], "n": preps[0]["n"], "k": preps[0]["k"], "bits": bits, "e": len(preps)}


def moe_gemm(x: torch.Tensor, experts: dict, topk_ids: torch.Tensor, row_weights: torch.Tensor | None = None,
             rows_per_token: int | None = None, align=None) -> torch.Tensor:
    """out[t * top_k + j] = x_row @ W[topk_ids[t, j]]^T (times row_weights[t * top_k + j]); x_row is x[t] when
    x has one row per token (gate/up) or x[t * top_k + j] when it has one per (token, choice) (down)."""
    suf = ACT_DTYPES[x.dtype]
    numel = topk_ids.numel()
    a_div = rows_per_token or (topk_ids.shape[-1] if x.reshape(-1, experts["k"]).shape[0] != numel else 1)
    sorted_ids, expert_ids, _ = align or moe_align(topk_ids, experts["e"])
    x2 = _rows(x, experts["k"])
    out = torch.empty(numel, experts["n"], dtype=x.dtype, device=x.device)
    rw = None if row_weights is None else row_weights.reshape(-1).float().contiguous()
    runtime.launch(f"qk_moe_w{experts['bits']}a16_gemm_{suf}", (_cdiv(experts["n"], 64), expert_ids.numel(), 1),
                   (128, 1, 1), x2, experts["wq"], experts["scale"], experts["zp"], out, sorted_ids, expert_ids, rw,
                   a_div, numel, experts["n"], experts["k"], experts["wq"].shape[2], experts["scale"].shape[2],
                   experts["group"])
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


def mla_decode(q: torch.Tensor, cache: torch.Tensor, seq_lens: torch.Tensor, kv_lora_rank: int,
               scale: float = 1.0, splits: int | None = None) -> torch.Tensor:
    """Absorbed MLA decode: q [B, H, D], cache [B, S, D] bf16 (latent then rope), seq_lens [B] -> [B, H, DV]."""
    b, h, d = q.shape
    if q.dtype != torch.bfloat16 or cache.dtype != torch.bfloat16 or d > 576 or d % 8 or kv_lora_rank > 512:
        raise ValueError("qk_mla_decode takes bf16, D <= 576 with D % 8 == 0 and kv_lora_rank <= 512")
    if cache.stride(2) != 1 or cache.stride(1) != d or cache.stride(0) % 8:
        raise ValueError("the cache must be [B, S, D] with contiguous rows")
    if splits is None:  # enough blocks to fill the GPU once, about 64 tokens per split at least
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        splits = max(1, min(_cdiv(cache.shape[1], 64), _cdiv(2 * sms, b * _cdiv(h, 16))))
    q = q.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    o_part = torch.empty(b, h, splits, kv_lora_rank, dtype=torch.float32, device=q.device)
    ml = torch.empty(b, h, splits, 2, dtype=torch.float32, device=q.device)
    runtime.launch("qk_mla_decode_split", (splits, _cdiv(h, 16), b), (256, 1, 1), q, cache, lens, o_part, ml,
                   h, d, kv_lora_rank, cache.stride(0), splits, float(scale))
    out = torch.empty(b, h, kv_lora_rank, dtype=torch.bfloat16, device=q.device)
    runtime.launch("qk_mla_decode_combine", (b * h, 1, 1), (128, 1, 1), o_part, ml, out, kv_lora_rank, splits)
    return out


def mla_decode_reference(q, cache, seq_lens, kv_lora_rank: int, scale: float = 1.0) -> torch.Tensor:
    outs = []
    for i, n in enumerate(seq_lens.tolist()):
        kv = cache[i, :n].float()
        p = torch.softmax((q[i].float() @ kv.t()) * scale, dim=-1)
        outs.append(p @ kv[:, :kv_lora_rank])
    return torch.stack(outs).to(q.dtype)


def tree_mask(parents: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """[T, P + T] uint8 verification mask of a draft tree (parents[i] < i, -1 = child of the prefix)."""
    t = parents.numel()
    if t > 1024:
        raise ValueError("qk_tree_mask handles at most 1024 draft tokens")
    par = parents.to(torch.int32).contiguous()
    mask = torch.empty(t, prefix_len + t, dtype=torch.uint8, device=parents.device)
    runtime.launch("qk_tree_mask", (t, 1, 1), (128, 1, 1), par, t, prefix_len, mask)
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
