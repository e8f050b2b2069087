"""One forward pass per layer: the linears calibrate group by group in the order the layer calls them
([q, k, v] -> [o] -> [gate, up] -> [down] in a Llama layer), so each matmul runs once, with its final weights,
and the pass that gathers a group's statistics is the same pass that feeds the next group and the next layer.

A group is the set of linears that read one input tensor; the order and the groups are read off one probe
forward of the layer (the unquantised reference forward of the first error-measuring batch, which the run needs
anyway), so any architecture's layer order is learned, not listed. Each batch's forward runs in its own thread,
but only one runs at a time, in batch order: a batch that reaches a group not yet quantised records its
statistics (the methods' hooks) and hands over to the next batch; when the last batch has arrived, the group is
quantised and batch 0 resumes. The same batches in the same order feed the same sums as a sequential loop, so
the result does not depend on thread timing.
"""

from __future__ import annotations

import queue
import threading
from contextlib import ExitStack
from typing import Callable

import torch
from torch import nn


class Cancelled(Exception):
    """Raised inside a paused forward when another batch's forward failed: unwinds it quietly."""


def probe_groups(targets: dict[str, nn.Module], forward: Callable[[], torch.Tensor], inputs: list | None = None):
    """Run `forward` once and return (its output, the groups of target names in call order, or None); `inputs`,
    when given, receives each group's input tensor in the same order.

    None when some target was not called (MoE experts a batch did not route to: the order is not static) or a
    target was called twice (its statistics could not be finished before it runs again)."""
    calls: list[tuple[str, torch.Tensor]] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=name: calls.append((n, args[0])))
             for name, m in targets.items()]
    try:
        out = forward()
    finally:
        for h in hooks:
            h.remove()
    names = [n for n, _ in calls]
    if sorted(names) != sorted(targets):
        return out, None
    groups: list[list[str]] = []
    seen: list[torch.Tensor] = []
    for name, x in calls:
        at = next((i for i, y in enumerate(seen) if y is x), None)
        if at is None:
            seen.append(x)
            groups.append([name])
        elif at != len(seen) - 1:
            return out, None  # an input read again after another group: not a simple chain
        else:
            groups[at].append(name)
    if inputs is not None:
        inputs.extend(seen)
    return out, groups


class WorkerThreads:
    """Long-lived threads that run a list of jobs concurrently, one thread per job, reused from layer to layer.

    A thread's first forward pays one-time costs (its OpenMP team, oneDNN's per-thread state): measured on a
    SmolLM2 layer, 0.048 s per batch on a fresh thread against 0.040 s on one that has run before, which a
    thread per batch and layer pays every time. Use as a context manager; `close` ends the threads."""

    def __init__(self) -> None:
        self._inboxes: list[queue.SimpleQueue] = []
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> "WorkerThreads":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # After an error (an interrupt included) a thread may still wait inside a job: it is a daemon, so it is
        # told to stop and left to end, not joined.
        self.close(join=exc_type is None)

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while (job := inbox.get()) is not None:
            fn, done = job
            try:
                fn()  # jobs handle their own errors (GroupedPass hands them to the caller)
            finally:
                done.release()

    def run_all(self, jobs: list[Callable[[], None]]) -> None:
        """Run every job on its own thread, all at once; return when all have returned."""
        while len(self._threads) < len(jobs):
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            t = threading.Thread(target=self._serve, args=(inbox,), name=f"quantkit-batch-{len(self._threads)}",
                                 daemon=True)
            t.start()
            self._inboxes.append(inbox)
            self._threads.append(t)
        done = threading.Semaphore(0)
        for inbox, fn in zip(self._inboxes, jobs):
            inbox.put((fn, done))
        for _ in jobs:
            done.acquire()

    def close(self, join: bool = True) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for t in self._threads if join else []:
            t.join()
        self._inboxes, self._threads = [], []


class GroupedPass:
    """Runs `forward(j)` for every batch j, pausing all of them at the first linear of each group until every
    batch has passed its statistics, then calling `apply_group(names)` once and resuming."""

    def __init__(self, groups: list[list[str]], apply_group: Callable[[list[str]], None]):
        self.groups = groups
        self.apply_group = apply_group
        # One lock; each batch waits on a condition of its own over it, so a handover wakes only the batch whose
        # turn it is instead of every paused thread (each would take the lock and the GIL to re-check).
        self._lock = threading.Lock()
        self._conds: dict[int, threading.Condition] = {}
        self._local = threading.local()
        self._turn: int | None = None
        self._alive: list[int] = []
        self._waiting: dict[int, int] = {}  # batch -> group index it waits at
        self._inputs: dict[int, torch.Tensor] = {}  # batch -> the input it waits with
        self._done: set[int] = set()
        self._error: BaseException | None = None

    def gate(self, index: int):
        """A forward pre-hook for the first linear of group `index`; register it after the statistics hooks."""

        def hook(module, args):
            batch = getattr(self._local, "batch", None)
            if batch is not None:
                self._arrive(batch, index, args[0])

        return hook

    def run(self, batches: list[int], forward: Callable[[int], torch.Tensor], on_done=None,
            workers: WorkerThreads | None = None) -> dict[int, torch.Tensor]:
        """Every batch's output, or (with `on_done(j, output)`, called as each batch finishes, in batch order)
        nothing: the caller takes each output as it comes. `workers`: the threads to run the batches on (a
        run's, kept from layer to layer); by default threads of this call's own."""
        outputs: dict[int, torch.Tensor] = {}
        grad, autocast = torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")
        autocast_dtype = torch.get_autocast_dtype("cpu")
        self._alive = list(batches)
        self._conds = {j: threading.Condition(self._lock) for j in batches}
        self._turn = batches[0] if batches else None

        def worker(j: int) -> None:
            self._local.batch = j
            try:
                with self._lock:
                    self._conds[j].wait_for(lambda: self._error is not None or self._turn == j)
                    if self._error is not None:
                        return
                with ExitStack() as stack:  # grad mode and autocast are per thread
                    stack.enter_context(torch.set_grad_enabled(grad))
                    stack.enter_context(torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast))
                    out = forward(j)
            except Cancelled:
                return
            except BaseException as exc:  # handed to the caller's thread
                with self._lock:
                    self._fail(exc)
                return
            with self._lock:
                try:
                    if on_done is None:
                        outputs[j] = out
                    else:
                        on_done(j, out)
                except BaseException as exc:
                    self._fail(exc)
                    return
                self._alive.remove(j)
                self._handover(j)

        jobs = [lambda j=j: worker(j) for j in batches]
        if workers is not None:
            workers.run_all(jobs)
        else:
            with WorkerThreads() as own:
                own.run_all(jobs)
        if self._error is not None:
            raise self._error
        unapplied = [i for i in range(len(self.groups)) if i not in self._done]
        for i in unapplied:  # groups no batch reached (an empty batch list): quantised from what they have
            self.apply_group(self.groups[i])
        return outputs

    def paused_inputs(self, index: int) -> list[torch.Tensor]:
        """The inputs the batches waiting at group `index` hold (for `apply_group`, which runs while they wait)."""
        return [self._inputs[b] for b, i in self._waiting.items() if i == index]

    def _arrive(self, batch: int, index: int, x: torch.Tensor) -> None:
        with self._lock:
            if index in self._done:
                return
            self._waiting[batch] = index
            self._inputs[batch] = x
            self._handover(batch)
            self._conds[batch].wait_for(lambda: self._error is not None or (self._turn == batch and index in self._done))
            del self._waiting[batch], self._inputs[batch]
            if self._error is not None:
                raise Cancelled

    def _handover(self, batch: int) -> None:
        """Called by the running batch (lock held) when it pauses or finishes: the next batch runs, or, when every
        live batch waits, the groups they wait at are quantised (in this thread) and the first batch resumes."""
        later = [k for k in self._alive if k > batch]
        if later:
            self._turn = later[0]
        elif self._alive:
            try:
                for index in sorted(set(self._waiting.values())):
                    self.apply_group(self.groups[index])
                    self._done.add(index)
            except BaseException as exc:
                self._fail(exc)
                return
            self._turn = self._alive[0]
        if self._turn in self._conds:
            self._conds[self._turn].notify()

    def _fail(self, exc: BaseException) -> None:
        """Record the first error (lock held) and wake every batch, so each unwinds."""
        if self._error is None:
            self._error = exc
        for cond in self._conds.values():
            cond.notify()
