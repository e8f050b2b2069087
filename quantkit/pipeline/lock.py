"""One writer per output folder: an exclusive flock on `OUT.partial.lock`, which holds the writer's pid.

Two runs on the same output would otherwise share (and delete, with --overwrite) one `OUT.partial`. The
lock is taken before the output or its partial folder is looked at, and the kernel drops it when the
process dies however it dies (SIGKILL included), so a killed run never leaves a stale lock behind: the
next run (say with --resume) simply takes it.
"""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path

from quantkit.errors import InputError


def lock_path(output: Path) -> Path:
    output = Path(output)
    return output.with_name(output.name + ".partial.lock")


def _holder_pid(fd: int) -> str:
    # The holder writes its pid right after locking; give it a moment if we looked in between.
    for _ in range(20):
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 64).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.01)
    return "?"


@contextmanager
def output_lock(output: Path):
    """Hold the lock on writing `output` for the duration of the block; InputError (exit 2) when another
    process holds it."""
    output = Path(output)
    path = lock_path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder_pid(fd)
            os.close(fd)
            raise InputError(f"another quantkit run (pid {pid}) is writing {output}") from None
        # The previous holder unlinks the file before unlocking: if that happened between our open and our
        # flock, we hold a lock on a file nobody else can see. Start over on the current file.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        yield path
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        os.close(fd)
