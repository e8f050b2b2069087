"""Progress and terminal output: rich bars on an interactive stderr, periodic plain lines when stderr is a file or
a CI log, nothing when QUANTKIT_NO_PROGRESS is set; a stdout console whose tables stay whole when piped."""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console, ConsoleDimensions
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

PIPE_WIDTH = 10_000  # wide enough for any table: piped output is read by tools and people scrolling a log
LINE_INTERVAL_S = 20.0  # a non-interactive run says where it is at least this often (QUANTKIT_PROGRESS_INTERVAL)


class OutputConsole(Console):
    """A console that is as wide as its content when it is not a terminal. rich assumes 80 columns there and
    cuts table cells to `checkp…`, `0.1766…`; a CI log or a file wants every value whole."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        return size if self.is_terminal else ConsoleDimensions(PIPE_WIDTH, size.height)

    @size.setter
    def size(self, new_size) -> None:
        Console.size.fset(self, new_size)


stderr_console = Console(stderr=True)


def progress_enabled() -> bool:
    return not os.environ.get("QUANTKIT_NO_PROGRESS") and sys.stderr.isatty()


def lines_enabled() -> bool:
    """Plain progress lines: stderr is not a terminal (a log, a pipe, a CI job) and progress is not switched off."""
    return not os.environ.get("QUANTKIT_NO_PROGRESS") and not sys.stderr.isatty()


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float
    info: str


class LineProgress:
    """The part of rich's Progress the commands use, reported as one plain line per unfinished task on stderr
    every `interval` seconds (from a timer thread, so a long step between updates still shows the run is alive)."""

    def __init__(self, interval: float):
        self.interval = interval
        self._tasks: dict[int, _Task] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._began = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="quantkit-progress", daemon=True)

    def __enter__(self) -> "LineProgress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def add_task(self, description: str, total: float | None = None, completed: float = 0, info: str = "",
                 **_) -> int:
        with self._lock:
            task_id = len(self._tasks)
            self._tasks[task_id] = _Task(description.strip(), total, completed, info)
            return task_id

    def update(self, task_id: int, *, advance: float | None = None, completed: float | None = None,
               total: float | None = None, info: str | None = None, **_) -> None:
        with self._lock:
            t = self._tasks[task_id]
            t.completed = completed if completed is not None else t.completed + (advance or 0)
            t.total = t.total if total is None else total
            t.info = t.info if info is None else info

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def reset(self, task_id: int, total: float | None = None, info: str | None = None, **_) -> None:
        self.update(task_id, completed=0, total=total, info=info)

    def lines(self) -> list[str]:
        elapsed = time.monotonic() - self._began
        with self._lock:
            tasks = [t for t in self._tasks.values() if t.total is None or t.completed < t.total]
            return [f"[{elapsed:8.1f} s] {t.description} {t.completed:g}/{'?' if t.total is None else f'{t.total:g}'}"
                    + (f" {t.info}" if t.info else "") for t in tasks]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for line in self.lines():
                print(line, file=sys.stderr, flush=True)


@contextmanager
def progress_bar():
    """A rich progress bar on an interactive stderr; periodic plain lines otherwise; silent with
    QUANTKIT_NO_PROGRESS."""
    if lines_enabled():
        with LineProgress(float(os.environ.get("QUANTKIT_PROGRESS_INTERVAL", LINE_INTERVAL_S))) as lines:
            yield lines
        return
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


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """One line on stderr, the first time this message comes up in the process."""
    if message not in _WARNED:
        _WARNED.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)
