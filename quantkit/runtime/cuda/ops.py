"""The CUDA ops outside the linear protocol, wired into the runtime's modules at load (`install`).

- MoE: a `RuntimeMoE` whose experts' projections are all served by one CUDA weight-only kernel (same shape and
  format, no act-order) runs them as three grouped GEMMs plus one align/sort per layer (`GroupedExperts`),
  instead of one GEMM per expert per projection. The experts' own prepared weights become views of the stack.
- MLA (DeepSeek-V2/V3 attention): the runtime's KVCache keeps each layer's latent and its rope part in one row
  (`step._JointKV`), and a decode step (one new token per row, no padding) runs absorbed: W_UK folded into the
  query, the latent attention in `mla_decode.cu`, W_UV applied to its output. Prefill, trees and padded batches
  keep transformers' own forward over the same cache.
- Tree mask: speculative verification builds its mask with `qk_tree_mask` (`tree_mask`).

Each op falls back to its torch path where the kernel does not apply, and `install` returns what it wired
(reported with the linears' kernels).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import nn

from quantkit.runtime.cuda import kernels as K

MLA_CLASSES: dict[type, type] = {}


def launcher_for(device: torch.device, mode: str):
    """The launcher the model's ops use: the emulator under kernels="cuda-emulated", the driver on a usable GPU
    under "auto", else None (torch everywhere)."""
    if mode == "cuda-emulated":
        from quantkit.runtime.cuda.emulator import emulator

        return emulator()
    if mode == "auto" and torch.device(device).type == "cuda":
        from quantkit.runtime.cuda.runtime import DRIVER, availability

        return DRIVER if availability()[0] else None
    return None


# ---- MoE ----

class GroupedExperts:
    """gate, up and down of E experts as stacked weights for qk_moe_w{bits}a16_gemm."""

    def __init__(self, launcher, gate: K.StackedExperts, up: K.StackedExperts, down: K.StackedExperts, act_fn):
        self.launcher, self.gate, self.up, self.down, self.act_fn = launcher, gate, up, down, act_fn

    def __call__(self, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        t, k = selected.shape
        align = K.moe_align(self.launcher, selected, self.gate.e)
        g = K.moe_gemm(self.launcher, x, self.gate, selected, align=align)  # [T * k, I], row t * k + j
        u = K.moe_gemm(self.launcher, x, self.up, selected, align=align)
        h = self.act_fn(g) * u
        d = K.moe_gemm(self.launcher, h, self.down, selected, row_weights=weights, rows_per_token=1, align=align)
        return d.view(t, k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


def _grouped(block, launcher) -> GroupedExperts | None:
    experts = getattr(block, block.spec.experts)
    mlps = [experts[e] for e in range(block.spec.num_experts)]
    names = getattr(mlps[0], "_names", None)
    if names is None:
        return None
    stacks = []
    for name in names:  # gate, up, down
        layers = [getattr(m, name) for m in mlps]
        kernel = getattr(layers[0], "kernel", None)
        if not isinstance(kernel, K.WNA16Kernel) or kernel.launcher is not launcher:
            return None
        if any(getattr(l, "kernel", None) is not kernel for l in layers):
            return None
        try:
            stacks.append(K.stack_experts([l.prepared for l in layers], kernel.bits))
        except ValueError:
            return None
    return GroupedExperts(launcher, *stacks, mlps[0].act_fn)


# ---- MLA ----

def _is_mla(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("kv_a_proj_with_mqa", "kv_b_proj", "kv_lora_rank", "qk_rope_head_dim"))


def _rope(module: nn.Module):
    """The architecture's own rotary function for (q_rot, k_rot, position_embeddings)."""
    mod = sys.modules[type(module).__module__]
    if hasattr(mod, "apply_rotary_pos_emb_interleave") and hasattr(mod, "apply_rotary_pos_emb"):  # DeepSeek-V3
        fn = mod.apply_rotary_pos_emb_interleave if module.config.rope_interleave else mod.apply_rotary_pos_emb
        return lambda q, k, pe: fn(q, k, *pe)
    if hasattr(mod, "apply_rotary_emb"):  # DeepSeek-V2: complex frequencies
        return lambda q, k, pe: mod.apply_rotary_emb(q, k, pe.to(q.device))
    return None


class AbsorbedMLA:
    """W_UK and W_UV of one MLA layer ([H, nope, r] and [H, v, r], from kv_b_proj as it computes: run on the
    identity, so a quantised kv_b_proj gives exactly the weights its kernel multiplies by) and the launcher."""

    def __init__(self, module: nn.Module, launcher, rope, device: torch.device):
        r, h = module.kv_lora_rank, module.num_heads
        nope, v = module.qk_nope_head_dim, module.v_head_dim
        with torch.inference_mode():  # bf16: the only dtype the decode kernel takes (one-hot rows are exact)
            w = module.kv_b_proj(torch.eye(r, dtype=torch.bfloat16, device=device)).t().float()  # [H * (nope + v), r]
        w = w.reshape(h, nope + v, r)
        self.w_uk = w[:, :nope].contiguous()
        self.w_uv = w[:, nope:].contiguous()
        self.launcher, self.rope = launcher, rope


class MLADecode(nn.Module):
    """Mixin for transformers' DeepSeek-V2/V3 attention: absorbed decode through mla_decode.cu (see module doc)."""

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        from quantkit.runtime.step import KVCache

        if isinstance(cache, KVCache):
            cache.joint.add(self.layer_idx)
        b, t = hidden_states.shape[:2]
        joint = isinstance(cache, KVCache) and (len(cache.layers) <= self.layer_idx
                                                or hasattr(cache.layers[self.layer_idx], "rows"))
        if not (joint and t == 1 and hidden_states.dtype == torch.bfloat16 and _no_mask(attention_mask)):
            return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        mla: AbsorbedMLA = self._absorbed
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(b, 1, -1, self.qk_head_dim).transpose(1, 2)  # [B, H, 1, qk]
        q_pass, q_rot = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope).view(b, 1, 1, self.kv_lora_rank)
        k_rot = k_rot.view(b, 1, 1, self.qk_rope_head_dim)
        q_rot, k_rot = mla.rope(q_rot, k_rot, position_embeddings)
        cache.update(kv_nope, k_rot, self.layer_idx)
        layer = cache.layers[self.layer_idx]
        rows = layer.rows[:, 0]  # [B, capacity, r + rope], every row contiguous
        q_lat = torch.einsum("bhn,hnr->bhr", q_pass[:, :, 0].float(), mla.w_uk)
        q_full = torch.cat([q_lat, q_rot[:, :, 0].float()], dim=-1).to(torch.bfloat16)
        lens = torch.full((b,), layer.length, dtype=torch.int32, device=q_full.device)
        out_lat = K.mla_decode(mla.launcher, q_full, rows, lens, self.kv_lora_rank, scale=self.scaling)
        out = torch.einsum("bhr,hvr->bhv", out_lat.float(), mla.w_uv).to(hidden_states.dtype)
        return self.o_proj(out.reshape(b, 1, -1)), None


def _no_mask(mask) -> bool:
    """True when the decode token may see every cached slot (what the kernel computes: no padding, no tree)."""
    if mask is None:
        return True
    if isinstance(mask, dict):
        return all(_no_mask(m) for m in mask.values())
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return bool((mask == 0).all())


def _mla_ok(module: nn.Module) -> bool:
    d = module.kv_lora_rank + module.qk_rope_head_dim
    return d <= 576 and d % 8 == 0 and module.kv_lora_rank <= 512 and module.kv_lora_rank % 8 == 0


def _install_mla(module: nn.Module, launcher, device) -> bool:
    rope = _rope(module)
    if rope is None or not _mla_ok(module):
        return False
    cls = type(module)
    if cls not in MLA_CLASSES:
        MLA_CLASSES[cls] = type(f"Absorbed{cls.__name__}", (MLADecode, cls), {})
    module._absorbed = AbsorbedMLA(module, launcher, rope, device)
    module.__class__ = MLA_CLASSES[cls]
    return True


# ---- wiring ----

def install(model: nn.Module, launcher, device: torch.device, dtype: torch.dtype) -> dict[str, dict[str, int]]:
    """Wire the CUDA ops into `model` (see module doc); returns op kind -> kernel name -> modules served."""
    from quantkit.runtime.moe import RuntimeMoE

    counts: dict[str, dict[str, int]] = {}

    def count(kind: str, name: str) -> None:
        counts.setdefault(kind, {}).setdefault(f"{launcher.name}-{name}", 0)
        counts[kind][f"{launcher.name}-{name}"] += 1

    for module in list(model.modules()):
        if isinstance(module, RuntimeMoE):
            module.grouped = _grouped(module, launcher)
            if module.grouped is not None:
                count("moe", "moe-grouped-gemm")
        elif dtype == torch.bfloat16 and _is_mla(module) and _install_mla(module, launcher, device):
            count("mla", "mla-decode")
    model.quantkit_launcher = launcher  # speculative verification's tree masks (`tree_mask` below)
    count("tree", "tree-mask")
    return counts


def tree_mask(model: nn.Module, parents: Sequence[int], prefix_len: int, device) -> torch.Tensor | None:
    """[1, 1, N, prefix_len + N] boolean tree mask built by qk_tree_mask when `model` has a launcher, else None."""
    launcher = getattr(model, "quantkit_launcher", None)
    if launcher is None or len(parents) > 1024:
        return None
    par = torch.tensor(list(parents), dtype=torch.int32, device=device)
    return K.tree_mask(launcher, par, prefix_len).bool()[None, None]
