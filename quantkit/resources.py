"""Data the defaults need, shipped inside the package (`quantkit/builtin/`) and read through
importlib.resources, so a wheel install works without the repository folder.

The repository's `recipes/` and `calibration_data/` are symlinks into `quantkit/builtin/`: one copy, the
paths the README names keep working, and the wheel carries exactly what a source checkout reads.
"""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable

KINDS = ("calibration", "recipes", "tasks")


def builtin_dir(kind: str) -> Traversable:
    if kind not in KINDS:
        raise ValueError(f"unknown builtin kind {kind!r}")
    return files("quantkit").joinpath("builtin", kind)


def builtin_names(kind: str, suffix: str) -> list[str]:
    folder = builtin_dir(kind)
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(suffix)] for p in folder.iterdir() if p.name.endswith(suffix))


def builtin_file(kind: str, name: str, suffix: str) -> Traversable | None:
    """The shipped file `name` (with or without `suffix`) of `kind`, or None."""
    stem = name[: -len(suffix)] if name.endswith(suffix) else name
    if "/" in stem or "\\" in stem or not stem:
        return None
    candidate = builtin_dir(kind).joinpath(stem + suffix)
    return candidate if candidate.is_file() else None
