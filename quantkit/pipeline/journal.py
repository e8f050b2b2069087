"""The resume journal: which layers are on disk, and where the activations entering the next layer are."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Journal:
    run_key: str  # hash of everything that determines the output bytes
    layers_done: int = 0
    non_layer_done: bool = False
    layer_records: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    compute: dict | None = None  # the compute dtype choice: a resumed run keeps it, whatever this machine prefers
    routing: dict = field(default_factory=dict)  # MoE layer -> expert counts of the quantised calibration pass

    @staticmethod
    def path(folder: Path) -> Path:
        return Path(folder) / ".quantkit-journal.json"

    def commit(self, folder: Path) -> None:
        """Atomically replace the journal (write, fsync, rename)."""
        target = self.path(folder)
        tmp = target.with_suffix(".tmp")
        with open(tmp, "w") as fh:
            json.dump(asdict(self), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)

    @classmethod
    def load(cls, folder: Path) -> "Journal | None":
        target = cls.path(folder)
        if not target.is_file():
            return None
        try:
            return cls(**json.loads(target.read_text()))
        except (json.JSONDecodeError, TypeError):
            return None
