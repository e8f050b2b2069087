"""Packing must be bit-identical to compressed-tensors' own pack/unpack (the independent oracle)."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from quantkit.quant import pack_int32, unpack_int32


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("cols", [1, 7, 31, 32, 33, 100, 576])
def test_pack_matches_compressed_tensors(bits, cols):
    g = torch.Generator().manual_seed(bits * 1000 + cols)
    values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (6, cols), generator=g).to(torch.int8)
    ours = pack_int32(values, bits)
    theirs = pack_to_int32(values, bits)
    assert torch.equal(ours, theirs)
    assert torch.equal(unpack_int32(ours, bits, cols), values)
    assert torch.equal(unpack_from_int32(ours, bits, torch.Size([6, cols])), values)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_along_dim0_matches_compressed_tensors(bits):
    values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (45, 3)).to(torch.int8)
    ours = pack_int32(values, bits, packed_dim=0)
    assert torch.equal(ours, pack_to_int32(values, bits, packed_dim=0))
    assert torch.equal(unpack_int32(ours, bits, 45, packed_dim=0), values)


def test_pack_rejects_wrong_dtype():
    with pytest.raises(TypeError):
        pack_int32(torch.zeros(2, 2, dtype=torch.int32), 4)
