"""Lazy, validated access to the tensors of a safetensors checkpoint (one file or an index of shards).

Only headers are read up front; a tensor is read from its memory-mapped file when asked for, so a layer
at a time costs only that layer's bytes.

Native FP8 checkpoints (DeepSeek-V3 style: config.json `quantization_config.quant_method == "fp8"`, float8
`X.weight` with an fp32 `X.weight_scale_inv` per 128x128 block) are presented as the dense model: the
scale tensors are hidden and each such weight reads as q * scale_inv in the model's dtype, so every
consumer (quantisation, evaluation) sees an ordinary unquantised checkpoint.
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


def native_fp8_config(folder: Path) -> tuple[tuple[int, int], torch.dtype] | None:
    """(weight block, dense dtype) when `folder` holds a native FP8 checkpoint (quant_method "fp8"), else None."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None
    block = tuple(int(b) for b in (qc.get("weight_block_size") or (128, 128)))
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(name, torch.bfloat16)
    return block, dtype


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
        self.native_fp8: dict[str, tuple[TensorInfo, TensorInfo]] = {}  # weight -> (fp8 values, scale_inv)
        native = native_fp8_config(self.folder)
        if native is not None:
            self._present_dense(*native)

    def _present_dense(self, block: tuple[int, int], dtype: torch.dtype) -> None:
        self.fp8_block, self.fp8_dense_dtype = block, dtype
        for name in [n for n in self.tensors if n.endswith(".weight_scale_inv")]:
            weight = name[: -len("_scale_inv")]
            raw = self.tensors.get(weight)
            if raw is None or not raw.dtype.startswith("F8"):
                raise InputError(f"{self.folder}: {name} has no float8 weight {weight} to scale")
            scale = self.tensors.pop(name)
            expected = tuple(-(-d // b) for d, b in zip(raw.shape, block))
            if len(raw.shape) != 2 or scale.shape != expected:
                raise InputError(f"{self.folder}: {name} has shape {list(scale.shape)}, expected {list(expected)} "
                                 f"for {list(raw.shape)} in {block[0]}x{block[1]} blocks")
            n = raw.shape[0] * raw.shape[1]
            self.tensors[weight] = TensorInfo(raw.file, DTYPE_NAMES[dtype], raw.shape,
                                              n * torch.empty((), dtype=dtype).element_size(), raw.offset)
            self.native_fp8[weight] = (raw, scale)

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
        if name in self.native_fp8:
            from quantkit.quant.fp8 import dequantize_fp8, expand_block_scale

            raw, scale = (self._read(name, i) for i in self.native_fp8[name])
            full = expand_block_scale(scale.float(), tuple(raw.shape), self.fp8_block)
            return dequantize_fp8(raw, full, self.fp8_dense_dtype)
        return self._read(name, info)

    def mapped(self, name: str) -> torch.Tensor:
        """A read-only, memory-mapped view of a stored tensor: only the pages actually touched are read (an
        embedding lookup of a few thousand ids touches a few MB of a GB-sized table)."""
        import warnings

        import numpy as np

        info = self.tensors.get(name)
        if info is None or name in self.native_fp8 or info.nbytes == 0:
            return self.get(name)
        raw = np.memmap(info.file, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the array is not writable; we never write it
            flat = torch.from_numpy(raw)
        return flat.view(DTYPES[info.dtype]).reshape(info.shape)

    def _read(self, name: str, info: TensorInfo) -> torch.Tensor:
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
