"""Streaming safetensors writer with every shard planned up front.

All output tensor names, dtypes and shapes are known before quantisation starts, so each shard's header
is written first and every tensor goes straight to its final offset as soon as it exists. Memory stays at
one tensor, no shard is assembled or copied at the end, and a resumed run just keeps filling the same
files. Shards are cut at `max_shard_bytes` (5 GB by default, as transformers does).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.models.safetensors_index import DTYPE_NAMES

MAX_SHARD_BYTES = 5 * 10**9


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class _Slot:
    file: Path
    offset: int  # absolute position of the tensor's first byte in the file
    spec: TensorSpec


class PlannedShardWriter:
    def __init__(self, folder: Path, specs: list[TensorSpec], max_shard_bytes: int = MAX_SHARD_BYTES,
                 create: bool = True):
        self.folder = Path(folder)
        shards: list[list[TensorSpec]] = [[]]
        size = 0
        for spec in specs:
            if shards[-1] and size + spec.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(spec)
            size += spec.nbytes
        n = len(shards)
        self.files = [
            self.folder / ("model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors")
            for k in range(n)
        ]
        self.slots: dict[str, _Slot] = {}
        self.weight_map: dict[str, str] = {}
        self.sizes: dict[str, int] = {}  # file name -> its exact size once written (header + data)
        for path, shard in zip(self.files, shards):
            header, offset = {}, 0
            for spec in shard:
                header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                                     "data_offsets": [offset, offset + spec.nbytes]}
                offset += spec.nbytes
            header["__metadata__"] = {"format": "pt"}
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as safetensors does
            base = 8 + len(raw)
            self.sizes[path.name] = base + offset
            for spec in shard:
                self.slots[spec.name] = _Slot(path, base + header[spec.name]["data_offsets"][0], spec)
                self.weight_map[spec.name] = path.name
            if create:
                with open(path, "wb") as fh:
                    fh.write(len(raw).to_bytes(8, "little"))
                    fh.write(raw)
                    fh.flush()
                    # Reserve the space now, so a full disk fails in seconds instead of after hours of work.
                    try:
                        os.posix_fallocate(fh.fileno(), 0, base + offset)
                    except OSError as exc:
                        if exc.errno == 28:
                            raise
                        fh.truncate(base + offset)  # filesystem without fallocate
        self._fds: dict[Path, int] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        slot = self.slots.get(name)
        if slot is None:
            raise KeyError(f"tensor {name} was not planned")
        spec = slot.spec
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{name}: planned {spec.dtype}{list(spec.shape)}, got {tensor.dtype}{list(tensor.shape)}")
        # A byte view of the tensor's own storage: no copy, however large the tensor.
        data = memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
        self._pwrite(slot, data, 0)

    def write_raw(self, name: str, source: Path, offset: int, nbytes: int, chunk: int = 1 << 26) -> None:
        """Copy a tensor's bytes from another safetensors file in chunks (never the whole tensor in memory)."""
        slot = self.slots[name]
        if nbytes != slot.spec.nbytes:
            raise ValueError(f"{name}: planned {slot.spec.nbytes} bytes, source has {nbytes}")
        with open(source, "rb", buffering=0) as fh:
            done = 0
            while done < nbytes:
                fh.seek(offset + done)
                block = fh.read(min(chunk, nbytes - done))
                if not block:
                    raise OSError(5, "source ended early", str(source))
                self._pwrite(slot, memoryview(block), done)
                done += len(block)

    def _pwrite(self, slot: _Slot, data: memoryview, at: int) -> None:
        fd = self._fds.get(slot.file)
        if fd is None:
            fd = self._fds[slot.file] = os.open(slot.file, os.O_WRONLY)
        written = os.pwrite(fd, data, slot.offset + at)
        if written != len(data):
            raise OSError(28, "short write (disk full?)", str(slot.file))

    def sync(self) -> None:
        for fd in self._fds.values():
            os.fsync(fd)

    def close(self) -> None:
        self.sync()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def index_text(self) -> str | None:
        """model.safetensors.index.json as it will be written (None for a single shard)."""
        if len(self.files) == 1:
            return None
        total = sum(s.spec.nbytes for s in self.slots.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(self.weight_map.items()))}
        return json.dumps(index, indent=2)

    def write_index(self) -> None:
        text = self.index_text()
        if text is not None:
            (self.folder / "model.safetensors.index.json").write_text(text)
