"""The output folder of a conversion: refused when it exists (unless overwriting), built beside it under a
process-unique partial name and renamed at the end, so a failed run never leaves something that looks complete."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from quantkit.errors import InputError


def prepare_output(output: Path, overwrite: bool) -> Path:
    """The partial folder to write into (emptied); raises InputError when `output` exists and not overwriting."""
    output = Path(output)
    if output.exists() and not overwrite:
        raise InputError(f"output {output} exists; pass --overwrite to replace it")
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial
