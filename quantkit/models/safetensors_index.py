"""Lazy, validated access to the tensors of a safetensors checkpoint (one file or an index of shards).

Only headers are read up front; a tensor is read from its memory-mapped file when asked for, so a layer
at a time costs only that layer's bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.errors import InputError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # absolute byte offset of the data in the file


def _header_len(path: Path) -> int:
    with open(path, "rb") as fh:
        return struct.unpack("<Q", fh.read(8))[0]


def read_header(path: Path) -> dict:
    """Parse and sanity-check a safetensors header; raises InputError for corrupt or truncated files."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8 or n > 100_000_000:
                raise ValueError("header length beyond end of file")
            header = json.loads(fh.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"corrupt safetensors file {path}: {exc}") from None
    data_len = size - 8 - n
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if end > data_len:
        raise InputError(f"truncated safetensors file {path}: header needs {end} data bytes, file has {data_len}")
    return header


class SafetensorsIndex:
    """Name -> tensor access over every *.safetensors file of a model folder."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise InputError(f"{self.folder} has no .safetensors files (quantkit loads only safetensors)")
        self.tensors: dict[str, TensorInfo] = {}
        for path in files:
            header = read_header(path)
            base = 8 + _header_len(path)
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                start, stop = meta["data_offsets"]
                if meta["dtype"] not in DTYPES:
                    raise InputError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
                self.tensors[name] = TensorInfo(path, meta["dtype"], tuple(meta["shape"]), stop - start, base + start)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor with a positioned read (not a memory map: mapped pages of a huge checkpoint
        would stay resident and count against the process while the layer is long gone)."""
        info = self.tensors.get(name)
        if info is None:
            raise InputError(f"tensor {name} is missing from {self.folder}")
        buf = bytearray(info.nbytes)
        with open(info.file, "rb", buffering=0) as fh:
            fh.seek(info.offset)
            got = fh.readinto(buf)
        if got != info.nbytes:
            raise InputError(f"truncated safetensors file {info.file}: cannot read {name}")
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=DTYPES[info.dtype])
        return torch.frombuffer(buf, dtype=DTYPES[info.dtype]).reshape(info.shape)

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.tensors[name].dtype]
