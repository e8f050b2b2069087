"""RoPE math for MLA conversion: complex views of rotary projections, per-frequency rotation across KV
heads, and the two rotary layouts (Llama's half split, DeepSeek's interleaved pairs).

A rotary projection sees pair j of a head as the complex number z_j = x_j + i y_j; RoPE at position n
multiplies every z_j by exp(i theta_j n). Llama keeps x_j at dim j and y_j at dim j + d/2; DeepSeek (with
`rope_interleave`, and vLLM) keeps them at dims 2j and 2j+1. A complex-linear map applied across KV
heads within one frequency commutes with that multiplication, so it leaves every attention score
unchanged at any positions; PCA of the rotated keys then puts a frequency's positional signal in its
first component, the one MLA's single shared RoPE key can carry.
"""

from __future__ import annotations

import torch


def inv_frequencies(dim: int, theta: float) -> torch.Tensor:
    """theta_j = theta ** (-2j / dim), j < dim/2 (the default RoPE of Llama and DeepSeek)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def complex_rows(weight: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """[n_heads*head_dim, in] in Llama's half-split layout -> complex [head_dim/2, n_heads, in]."""
    w = weight.to(torch.float64).reshape(n_heads, 2, head_dim // 2, -1)
    return torch.complex(w[:, 0], w[:, 1]).permute(1, 0, 2).contiguous()


def real_rows(z: torch.Tensor) -> torch.Tensor:
    """Inverse of `complex_rows`: complex [head_dim/2, n_heads, in] -> [n_heads*head_dim, in]."""
    z = z.permute(1, 0, 2)
    return torch.cat([z.real, z.imag], dim=1).reshape(-1, z.shape[-1])


def interleave_rows(z: torch.Tensor) -> torch.Tensor:
    """Complex [pairs, in] -> [2*pairs, in] with pair j at rows 2j (real) and 2j+1 (imaginary)."""
    return torch.stack([z.real, z.imag], dim=1).reshape(-1, z.shape[-1])


def frequency_rotations(keys: torch.Tensor, cov_x: torch.Tensor, use_complex: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per frequency, an orthonormal basis of the KV-head space sorted by key energy (descending).

    keys: complex [pairs, n_kv, in]; cov_x: E[x x^T] of the projection's input. Returns (U [pairs, n_kv,
    n_kv] with columns the basis, energies [pairs, n_kv]). `use_complex=False` restricts U to real
    rotations (the same rotation for both coordinates of a pair, as TransMLA does)."""
    cov = keys @ cov_x.to(keys.dtype) @ keys.conj().transpose(1, 2)  # E[z z^H] per frequency
    cov = 0.5 * (cov + cov.conj().transpose(1, 2))
    if not use_complex:
        cov = cov.real.to(keys.dtype)
    vals, vecs = torch.linalg.eigh(cov)
    order = torch.argsort(vals.real, dim=-1, descending=True)
    vals = torch.gather(vals.real, 1, order)
    vecs = torch.gather(vecs, 2, order[:, None, :].expand_as(vecs))
    return vecs, vals.clamp_min(0)


def apply_rope_half(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama RoPE on [..., seq, head_dim] (half-split layout) in x's dtype, the angles taken in float64."""
    d = x.shape[-1]
    ang = positions.to(torch.float64)[:, None] * inv_frequencies(d, theta)[None, :]
    cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """DeepSeek RoPE on [..., seq, dim] with pairs at (2j, 2j+1); output keeps the interleaved layout."""
    d = x.shape[-1]
    ang = positions.to(torch.float64)[:, None] * inv_frequencies(d, theta)[None, :]
    cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
