"""Per-batch activation storage: on the compute device, in host memory (a GPU run whose activations do not fit
on the device), or spilled to a folder (one file per batch).

Whatever the storage, `store[j]` hands back batch j on the compute device (`device`), so a GPU run reads its
inputs where its layer is; the host and disk copies are plain (unpinned) CPU tensors, written synchronously.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


class ActivationStore:
    """`folder`: spill every batch there (--offload-dir). `device`: where `store[j]` returns batches (None: as
    stored). `host`: keep in-memory batches in CPU memory instead of on `device` (GPU offload). `dtype`: every
    batch is kept in it (None: as given), so a layer whose output comes out wider (an fp32 norm's weight under
    autocast) does not widen the next generation."""

    def __init__(self, folder: Path | None = None, device: torch.device | str | None = None, host: bool = False,
                 dtype: torch.dtype | None = None):
        self.folder = Path(folder) if folder is not None else None
        self.device = torch.device(device) if device is not None else None
        self.host = host and self.folder is None and self.device is not None and self.device.type != "cpu"
        self.dtype = dtype
        self._mem: dict[int, torch.Tensor] = {}
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    @property
    def placement(self) -> str:
        """Where the batches live: disk, host (CPU memory, moved to the device per use) or device."""
        return "disk" if self.folder is not None else "host" if self.host else "device"

    def _path(self, j: int) -> Path:
        return self.folder / f"batch-{j:05d}.pt"

    def __setitem__(self, j: int, tensor: torch.Tensor) -> None:
        if self.dtype is not None:
            tensor = tensor.to(self.dtype)
        if self.folder is None:
            self._mem[j] = tensor.detach().to("cpu") if self.host else tensor
        else:
            # A new file, never a write through the old path: the resume state may hard-link the old one.
            self._path(j).unlink(missing_ok=True)
            torch.save(tensor.detach().cpu().contiguous(), self._path(j))

    def __getitem__(self, j: int) -> torch.Tensor:
        if self.folder is None:
            t = self._mem[j]
            return t.to(self.device) if self.host else t
        return torch.load(self._path(j), weights_only=True, map_location=self.device)

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
                # CPU bytes on disk whatever the device, so the state resumes on any device.
                torch.save(self._mem[j].detach().cpu().contiguous(), target)
            written += target.stat().st_size
        return written

    @classmethod
    def load_from(cls, folder: Path, batches, spill: Path | None, device: torch.device | str | None = None,
                  host: bool = False, dtype: torch.dtype | None = None) -> "ActivationStore":
        store = cls(spill, device, host, dtype)
        for j in batches:
            # Straight to where the store keeps it: host and spilled batches never pass through the device.
            where = "cpu" if store.folder is not None or store.host else store.device
            store[j] = torch.load(folder / f"batch-{j:05d}.pt", weights_only=True, map_location=where)
        return store

    def drop(self) -> None:
        self._mem.clear()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
