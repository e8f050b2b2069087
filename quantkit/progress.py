"""Rich progress bars on stderr (silent when QUANTKIT_NO_PROGRESS is set or stderr is not a terminal in tests)."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

stderr_console = Console(stderr=True)


def progress_enabled() -> bool:
    return not os.environ.get("QUANTKIT_NO_PROGRESS") and sys.stderr.isatty()


@contextmanager
def progress_bar():
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=stderr_console,
        disable=not progress_enabled(),
        transient=False,
    )
    with progress:
        yield progress


def announce(message: str) -> None:
    """One informational line on stderr where progress bars show (an interactive run: it tells at the start
    what the run will do); commands print the same facts in their closing summary otherwise."""
    if progress_enabled():
        stderr_console.print(f"[dim]{message}[/]", highlight=False, soft_wrap=True)
