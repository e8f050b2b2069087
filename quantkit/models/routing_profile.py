"""routing_profile.json: how often each expert of each MoE layer is chosen, and with which others.

Written beside a quantised MoE checkpoint by `quantkit quantize` from its calibration pass (the quantised
layers' own routing of the calibration tokens, counted once per token), read by `quantkit eval --moe` and
by the expert-offload cache (`quantkit/runtime/offload.py`), which can start from these frequencies instead
of an empty history. Counts are plain integers so a recount from a router observer compares exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

PROFILE = "routing_profile.json"
VERSION = 1


def count_selection(selected: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [E], co-activation [E, E]) of one routing decision selected [T, k]; slots outside [0, E)
    (dropped) are not counted. co[i, j] = tokens routed to both i and j (the diagonal = counts)."""
    sel = selected.reshape(-1, selected.shape[-1]).long()
    valid = (sel >= 0) & (sel < num_experts)
    onehot = torch.zeros(sel.shape[0], num_experts + 1, dtype=torch.float64, device=sel.device)
    onehot.scatter_(1, torch.where(valid, sel, num_experts), 1.0)
    onehot = onehot[:, :num_experts]
    return onehot.sum(0).round().long(), (onehot.T @ onehot).round().long()


@dataclass
class LayerCounts:
    num_experts: int
    tokens: int = 0
    counts: torch.Tensor = None  # [E] int64
    coactivation: torch.Tensor = None  # [E, E] int64

    def __post_init__(self):
        if self.counts is None:
            self.counts = torch.zeros(self.num_experts, dtype=torch.long)
        if self.coactivation is None:
            self.coactivation = torch.zeros(self.num_experts, self.num_experts, dtype=torch.long)

    def add(self, selected: torch.Tensor) -> None:
        c, co = count_selection(selected, self.num_experts)
        self.counts += c.to(self.counts.device)  # the counts stay on the CPU whatever device routed
        self.coactivation += co.to(self.coactivation.device)
        self.tokens += selected.reshape(-1, selected.shape[-1]).shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The counts as named tensors (to sum them over the ranks of a data-parallel run)."""
        return {"tokens": torch.tensor(self.tokens), "counts": self.counts, "coactivation": self.coactivation}

    def merge(self, summed: dict[str, torch.Tensor]) -> None:
        """Take counts summed over every rank (`tensors`, reduced)."""
        self.tokens, self.counts, self.coactivation = int(summed["tokens"]), summed["counts"], summed["coactivation"]

    def frequency(self) -> torch.Tensor:
        """Share of tokens that choose each expert."""
        return self.counts.double() / max(self.tokens, 1)


@dataclass
class RoutingProfile:
    num_experts: int
    top_k: int
    layers: dict[int, LayerCounts] = field(default_factory=dict)
    source: str = ""  # what was counted (e.g. "calibration: kjv 128 x 512")

    def add(self, layer: int, selected: torch.Tensor) -> None:
        self.layers.setdefault(layer, LayerCounts(self.num_experts)).add(selected)

    def observer(self):
        """A router observer (quantkit.runtime.moe) that counts into this profile."""
        return lambda layer, n, selected, weights, scores: self.add(layer, selected.cpu())

    def to_dict(self) -> dict:
        return {"version": VERSION, "num_experts": self.num_experts, "top_k": self.top_k, "source": self.source,
                "layers": {str(i): {"tokens": c.tokens, "counts": c.counts.tolist(),
                                    "coactivation": c.coactivation.tolist()}
                           for i, c in sorted(self.layers.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> "RoutingProfile":
        prof = cls(int(d["num_experts"]), int(d["top_k"]), source=d.get("source", ""))
        for key, v in d.get("layers", {}).items():
            prof.layers[int(key)] = LayerCounts(prof.num_experts, int(v["tokens"]), torch.tensor(v["counts"]),
                                                torch.tensor(v["coactivation"]))
        return prof

    def write(self, folder: Path) -> Path:
        path = Path(folder) / PROFILE
        path.write_text(json.dumps(self.to_dict()) + "\n")
        return path


def read_profile(folder: Path) -> RoutingProfile | None:
    """The profile beside a checkpoint, or None where there is none (or it cannot be read)."""
    path = Path(folder) / PROFILE
    if not path.is_file():
        return None
    try:
        return RoutingProfile.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
