"""One forward pass per layer: the linears calibrate group by group in the order the layer calls them
([q, k, v] -> [o] -> [gate, up] -> [down] in a Llama layer), so each matmul runs once, with its final weights,
and the pass that gathers a group's statistics is the same pass that feeds the next group and the next layer.

A group is the set of linears that read one input tensor; the order and the groups are read off one probe
forward of the layer (the unquantised reference forward of the first error-measuring batch, which the run needs
anyway), so any architecture's layer order is learned, not listed. Each batch's forward runs as a greenlet (a
stack of its own, all on the calling thread), one at a time, in batch order: a batch that reaches a group not yet
quantised records its statistics (the methods' hooks) and switches back to the scheduler, which runs the next
batch; when every live batch waits, the groups they wait at are quantised and batch 0 resumes. The same batches in
the same order feed the same sums as a sequential loop.

Greenlets, not threads: every thread that runs torch ops gets an OpenMP thread pool of its own, and while more
OpenMP threads exist than CPUs libgomp cuts its barrier spin short, so each parallel region waits on a futex
wake-up. A thread per batch made every op of the pass slower (README, "one-pass").
"""

from __future__ import annotations

from typing import Callable

import torch
from greenlet import getcurrent, greenlet
from torch import nn


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


class GroupedPass:
    """Runs `forward(j)` for every batch j, pausing all of them at the first linear of each group until every
    batch has passed its statistics, then calling `apply_group(names)` once and resuming."""

    def __init__(self, groups: list[list[str]], apply_group: Callable[[list[str]], None]):
        self.groups = groups
        self.apply_group = apply_group
        self._scheduler: greenlet | None = None  # the caller's greenlet while `run` runs
        self._running: tuple[int, greenlet] | None = None  # the batch that runs now, and its greenlet
        self._waiting: dict[int, int] = {}  # batch -> group index it waits at
        self._inputs: dict[int, torch.Tensor] = {}  # batch -> the input it waits with
        self._done: set[int] = set()

    def gate(self, index: int):
        """A forward pre-hook for the first linear of group `index`; register it after the statistics hooks.
        Outside `run`, and in forwards that `apply_group` itself runs, it does nothing."""

        def hook(module, args):
            running = self._running
            if running is not None and getcurrent() is running[1] and index not in self._done:
                self._pause(running[0], index, args[0])

        return hook

    def run(self, batches: list[int], forward: Callable[[int], torch.Tensor], on_done=None) -> dict[int, torch.Tensor]:
        """Every batch's output, or (with `on_done(j, output)`, called as each batch finishes, in batch order)
        nothing: the caller takes each output as it comes. Torch's thread-local modes (grad, autocast) are the
        caller's: every batch runs on the caller's thread."""
        outputs: dict[int, torch.Tensor] = {}
        self._scheduler = getcurrent()
        glets = {j: greenlet(lambda j=j: forward(j), parent=self._scheduler) for j in batches}
        alive = list(batches)
        try:
            while alive:
                for j in list(alive):
                    self._running = (j, glets[j])
                    out = glets[j].switch()
                    self._running = None
                    if glets[j].dead:
                        alive.remove(j)
                        if on_done is None:
                            outputs[j] = out
                        else:
                            on_done(j, out)
                for index in sorted(set(self._waiting.values())):  # every live batch waits: quantise, resume
                    self.apply_group(self.groups[index])
                    self._done.add(index)
        except BaseException:
            for g in glets.values():  # unwind the paused forwards (their finally blocks run) before raising
                if not g.dead:
                    g.throw()
            raise
        finally:
            self._scheduler = self._running = None
        unapplied = [i for i in range(len(self.groups)) if i not in self._done]
        for i in unapplied:  # groups no batch reached (an empty batch list): quantised from what they have
            self.apply_group(self.groups[i])
        return outputs

    def paused_inputs(self, index: int) -> list[torch.Tensor]:
        """The inputs the batches waiting at group `index` hold (for `apply_group`, which runs while they wait)."""
        return [self._inputs[b] for b, i in self._waiting.items() if i == index]

    def _pause(self, batch: int, index: int, x: torch.Tensor) -> None:
        self._waiting[batch] = index
        self._inputs[batch] = x
        try:
            self._scheduler.switch()
        finally:
            del self._waiting[batch], self._inputs[batch]
