"""Per-batch activation storage, in memory or spilled to a folder (one file per batch)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


class ActivationStore:
    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder is not None else None
        self._mem: dict[int, torch.Tensor] = {}
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, j: int) -> Path:
        return self.folder / f"batch-{j:05d}.pt"

    def __setitem__(self, j: int, tensor: torch.Tensor) -> None:
        if self.folder is None:
            self._mem[j] = tensor
        else:
            # A new file, never a write through the old path: the resume state may hard-link the old one.
            self._path(j).unlink(missing_ok=True)
            torch.save(tensor.detach().cpu().contiguous(), self._path(j))

    def __getitem__(self, j: int) -> torch.Tensor:
        if self.folder is None:
            return self._mem[j]
        return torch.load(self._path(j), weights_only=True)

    def save_to(self, folder: Path, batches) -> int:
        """Persist the batches `batches` (indices) to `folder` (for the resume journal). Spilled batches are
        hard-linked where the filesystem allows (no bytes written). Returns the bytes actually written."""
        import os

        folder.mkdir(parents=True, exist_ok=True)
        written = 0
        for j in batches:
            target = folder / f"batch-{j:05d}.pt"
            target.unlink(missing_ok=True)
            if self.folder is not None:
                try:
                    os.link(self._path(j), target)
                    continue
                except OSError:  # another filesystem (EXDEV) or no hard links: copy
                    shutil.copyfile(self._path(j), target)
            else:
                torch.save(self._mem[j].contiguous(), target)
            written += target.stat().st_size
        return written

    @classmethod
    def load_from(cls, folder: Path, batches, spill: Path | None) -> "ActivationStore":
        store = cls(spill)
        for j in batches:
            store[j] = torch.load(folder / f"batch-{j:05d}.pt", weights_only=True)
        return store

    def drop(self) -> None:
        self._mem.clear()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
