"""The baseline's logits, computed once and kept on disk.

Keyed by the baseline model (config, file names, sizes, modification times and safetensors headers), the
token blocks' fingerprint and the compute dtype, so evaluating ten candidates costs one baseline pass.
Logits are stored exactly as computed (the model dtype, e.g. bf16), one [L, V] tensor per block, in a
safetensors file written block by block; a `complete` marker is written last so a killed run recomputes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from quantkit.formats.safetensors_writer import PlannedShardWriter, TensorSpec
from quantkit.models.safetensors_index import SafetensorsIndex, _header_len
from quantkit.models.source import cache_dir


def model_fingerprint(folder: Path) -> str:
    h = hashlib.sha256()
    folder = Path(folder)
    h.update((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        st = path.stat()
        h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        with open(path, "rb") as fh:
            h.update(fh.read(8 + _header_len(path)))
    return h.hexdigest()


class BaselineCache:
    def __init__(self, model_folder: Path, tokens_fingerprint: str, dtype: torch.dtype, root: Path | None = None):
        key = hashlib.sha256(f"{model_fingerprint(model_folder)}|{tokens_fingerprint}|{dtype}".encode()).hexdigest()
        self.key = key[:24]
        self.folder = Path(root or cache_dir() / "eval-baselines") / self.key
        self._index: SafetensorsIndex | None = None

    @property
    def complete(self) -> bool:
        return (self.folder / "complete.json").is_file()

    def write(self, n_blocks: int, block_shape: tuple[int, int], dtype: torch.dtype, blocks) -> None:
        """Consume an iterator of (block index, logits [L, V]) and store them; marks the cache complete."""
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        specs = [TensorSpec(f"logits.{i}", dtype, tuple(block_shape)) for i in range(n_blocks)]
        writer = PlannedShardWriter(self.folder, specs, max_shard_bytes=1 << 62)
        try:
            for i, logits in blocks:
                writer.write(f"logits.{i}", logits.to(dtype).contiguous())
        finally:
            writer.close()
        (self.folder / "complete.json").write_text(json.dumps({"blocks": n_blocks, "shape": list(block_shape)}))

    def read(self, i: int) -> torch.Tensor:
        if self._index is None:
            self._index = SafetensorsIndex(self.folder)
        return self._index.get(f"logits.{i}")
