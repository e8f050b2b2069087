"""Dense packing of 1..8-bit integers into int32 words, bit-compatible with compressed-tensors.

Each value is offset to unsigned (q + 2^(bits-1)) and written as a little-endian bit stream along the
packed dimension: element i occupies bits [i*bits, (i+1)*bits) of the row, crossing word boundaries
where needed; a row takes ceil(n * bits / 32) words.
"""

from __future__ import annotations

import sys

import torch


def packed_columns(n: int, num_bits: int) -> int:
    return -(-n * num_bits // 32)


def pack_int32(values: torch.Tensor, num_bits: int, packed_dim: int = 1) -> torch.Tensor:
    """Pack a 2-D int8 tensor of signed num_bits values along `packed_dim` into int32."""
    if values.dtype != torch.int8:
        raise TypeError("pack_int32 expects int8 values")
    if not 1 <= num_bits <= 8:
        raise ValueError(f"num_bits must be in 1..8, got {num_bits}")
    if packed_dim == 0:
        return pack_int32(values.t().contiguous(), num_bits, 1).t().contiguous()
    rows, cols = values.shape
    unsigned = (values.to(torch.int16) + (1 << (num_bits - 1))) & ((1 << num_bits) - 1)
    if 8 % num_bits == 0 and sys.byteorder == "little":
        # Values never straddle a byte: build the little-endian byte stream directly and view it as int32.
        per_byte = 8 // num_bits
        n_words = packed_columns(cols, num_bits)
        padded = torch.zeros(rows, n_words * 32 // num_bits, dtype=torch.uint8, device=values.device)
        padded[:, :cols] = unsigned.to(torch.uint8)
        lanes = padded.view(rows, n_words * 4, per_byte)
        out = lanes[:, :, 0].clone()
        for k in range(1, per_byte):
            out |= lanes[:, :, k] << (k * num_bits)
        return out.contiguous().view(torch.int32)
    # Pad to whole 32-element chunks: each chunk fills exactly num_bits words.
    chunks = -(-cols // 32)
    padded = torch.zeros(rows, chunks * 32, dtype=torch.int64, device=values.device)
    padded[:, :cols] = unsigned.to(torch.int64)
    bit_pos = torch.arange(32, device=values.device) * num_bits
    words = torch.zeros(rows, chunks, num_bits + 1, dtype=torch.int64, device=values.device)
    shifted = padded.view(rows, chunks, 32) << (bit_pos % 32)
    # Low part lands in word bit_pos // 32; the bits above 32 spill into the next word.
    words.scatter_add_(2, (bit_pos // 32).expand(rows, chunks, 32), shifted & 0xFFFFFFFF)
    words.scatter_add_(2, (bit_pos // 32 + 1).expand(rows, chunks, 32), shifted >> 32)
    flat = words[:, :, :num_bits].reshape(rows, chunks * num_bits)[:, : packed_columns(cols, num_bits)]
    # Reinterpret the unsigned 32-bit pattern as int32.
    return torch.where(flat >= 2**31, flat - 2**32, flat).to(torch.int32).contiguous()


def unpack_int32(packed: torch.Tensor, num_bits: int, n: int, packed_dim: int = 1) -> torch.Tensor:
    """Inverse of pack_int32: recover `n` signed values per row (int8) along `packed_dim`."""
    if packed.dtype != torch.int32:
        raise TypeError("unpack_int32 expects int32 words")
    if packed_dim == 0:
        return unpack_int32(packed.t().contiguous(), num_bits, n, 1).t().contiguous()
    rows, n_words = packed.shape
    if 8 % num_bits == 0 and sys.byteorder == "little":
        # Fast path: values never straddle a byte, so each byte of the little-endian stream decodes to
        # 8 // num_bits values through a 256-entry table (an embedding lookup is the fastest gather on CPU).
        per_byte, mask = 8 // num_bits, (1 << num_bits) - 1
        codes = torch.arange(256, dtype=torch.int16, device=packed.device)
        table = torch.stack([((codes >> (k * num_bits)) & mask) - (1 << (num_bits - 1)) for k in range(per_byte)], -1)
        values = torch.nn.functional.embedding(packed.contiguous().view(torch.uint8).int(), table)
        return values.reshape(rows, -1)[:, :n].to(torch.int8)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    bit_pos = torch.arange(n, device=packed.device) * num_bits
    lo_word, shift = bit_pos // 32, bit_pos % 32
    hi_word = (lo_word + 1).clamp(max=n_words - 1)
    combined = words[:, lo_word] | (words[:, hi_word] << 32)
    unsigned = (combined >> shift) & ((1 << num_bits) - 1)
    return (unsigned - (1 << (num_bits - 1))).to(torch.int8)
