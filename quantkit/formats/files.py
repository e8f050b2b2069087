"""Finishing what a command writes: files get the mode the user's umask gives a newly created file (safetensors'
writer creates its files 0600, so a shared checkpoint would be unreadable to the group that serves it), and a
finished folder replaces its target in one rename."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def umask() -> int:
    """The process umask, read without changing it (Linux exposes it in /proc; elsewhere set and restore)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: Path) -> None:
    """Give `path` (a file, or every file under a folder) mode 0666 minus the umask."""
    path = Path(path)
    mode = 0o666 & ~umask()
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        os.chmod(f, mode)


def publish(partial: Path, output: Path) -> None:
    """Move a finished `partial` folder (or file) to `output`, replacing what is there, with umask modes."""
    apply_umask(partial)
    if Path(output).is_dir():
        shutil.rmtree(output)
    Path(partial).replace(output)
