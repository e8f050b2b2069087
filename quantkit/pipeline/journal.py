"""The resume journal: which layers are on disk, and where the activations entering the next layer are."""

from __future__ import annotations

import json
import os
import time
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
    # The layer whose input activations are saved in `.state/gen-NNNNN` (0: none saved, recapture from the
    # embeddings). It may trail layers_done: state is not written after every layer (see StatePolicy), and a
    # resume recomputes the layers in between, rewriting the same bytes. None: a journal from before this field,
    # which saved after every layer.
    state_layer: int | None = 0
    state_bytes: int = 0  # bytes written for resume state so far (hard links cost none)

    def resume_layer(self) -> int:
        """The first layer a resumed run computes; the records of later layers are dropped (recomputed)."""
        start = self.layers_done if self.state_layer is None else min(self.state_layer, self.layers_done)
        self.layer_records = [r for r in self.layer_records if r["layer"] < start]
        self.events = [e for e in self.events if e.get("layer", -1) < start]
        self.layers_done = start
        self.state_layer = start
        return start

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
            data = json.loads(target.read_text())
            data.setdefault("state_layer", None)  # written before the field existed: state after every layer
            return cls(**data)
        except (json.JSONDecodeError, TypeError):
            return None


# How much of the run's time the resume state may cost. The activations entering the next layer are saved
# after a layer only once the work since the last save is at least STATE_TIME_RATIO times what that save took,
# so saving costs at most about 1 / (1 + ratio) of the wall time (and of the disk's write bandwidth over the
# run), while a kill loses at most about ratio x one save plus one layer of work. Spilled activations
# (--offload-dir on the output's filesystem) are hard-linked: no bytes written, so they are saved every layer.
STATE_TIME_RATIO = 10.0


class StatePolicy:
    def __init__(self, ratio: float | None = None, clock=time.monotonic):
        env = os.environ.get("QUANTKIT_RESUME_STATE_RATIO")  # test aid: a huge ratio saves only the first state
        self.ratio = float(env) if ratio is None and env else (STATE_TIME_RATIO if ratio is None else ratio)
        self.clock = clock
        self.last_end = clock()
        self.last_cost: float | None = None  # seconds the last save took; None before the first

    def due(self) -> bool:
        if self.last_cost is None:
            return True  # the first save measures what a save costs
        return self.clock() - self.last_end >= self.ratio * self.last_cost

    def saved(self, started: float) -> None:
        self.last_end = self.clock()
        self.last_cost = self.last_end - started
