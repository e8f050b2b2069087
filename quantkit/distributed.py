"""Data-parallel calibration over torch.distributed: which batches this process calibrates on, and the
collectives that make every rank's statistics the whole run's.

Launched by `torchrun --nproc-per-node N -m quantkit quantize ...` (or `--nnodes` across machines): each rank
holds a contiguous shard of the calibration batches (the batches themselves are the single-process run's:
same tokens, same batch size), runs every layer on its shard, and before a method's `apply` the statistics
are combined. Sums are kept in float64 by the methods: a float64 sum of float32 (or bf16) terms is exact
unless one entry's terms span more than 2^29 in magnitude, so the total does not depend on how the batches
were split or in which order the partial sums are added, and the float32 statistics the solves see equal a
single-process run's. Maxima are exact in any order. Every rank then applies the method to identical
statistics; GPTQ spreads its solves over the ranks and gathers the results (`Ranks.spread`). Rank 0 writes
the checkpoint, the journal and the manifest; each rank saves its own shard of the resume state.

gloo on CPU, NCCL on GPUs (each rank on `cuda:LOCAL_RANK`). Everything here is a no-op with one process.
"""

from __future__ import annotations

import os
import pickle
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from quantkit.errors import InputError, RunError


@dataclass(eq=False)  # identity, not value: one per process, shared by reference
class Ranks:
    rank: int = 0
    world: int = 1
    backend: str | None = None
    bytes_moved: int = 0  # payload bytes this rank sent and received in collectives (the benchmark's figure)
    _layer: int | None = field(default=None, repr=False)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def writer(self) -> bool:
        """Whether this rank writes the output (rank 0)."""
        return self.rank == 0

    def shard(self, n: int) -> list[int]:
        """This rank's contiguous share of `n` batch indices (sizes differ by at most one)."""
        return list(range(n * self.rank // self.world, n * (self.rank + 1) // self.world))

    def at_layer(self, index: int | None) -> None:
        self._layer = index

    # ----- collectives (each one names the failure in one line: a rank that stopped) ---------------------

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, ConnectionError) as exc:
            where = f" during layer {self._layer}" if self._layer is not None else ""
            first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            raise RunError(f"rank {self.rank}: lost contact with the other ranks{where} (another rank stopped? "
                           f"{first}); rerun the same command with --resume to continue") from None

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        self._call(dist.all_gather_object, out, obj)
        self.bytes_moved += len(pickle.dumps(obj)) * self.world
        return out

    def broadcast(self, obj, src: int = 0):
        """Rank `src`'s `obj` on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        self._call(dist.broadcast_object_list, box, src)
        self.bytes_moved += len(pickle.dumps(box[0]))
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            self._call(dist.barrier)

    def agree(self, value, what: str) -> None:
        """Refuse to go on unless every rank holds the same `value` (e.g. the run key: recipe, model, data)."""
        values = self.gather(value)
        for r, v in enumerate(values):
            if v != values[0]:
                raise InputError(f"rank {r}'s {what} differs from rank 0's; every rank must run the same command "
                                 f"on the same files")

    def check_shared(self, folder, what: str) -> None:
        """Refuse to start unless every rank sees the same `folder` (the output: each rank saves its share of the
        resume state there): rank 0 leaves a file with a fresh token in it and every rank must read that token.
        A node whose path points elsewhere (another machine's local disk, a relative path from another working
        directory) is named in one line."""
        if not self.distributed:
            return
        import secrets
        from pathlib import Path

        folder = Path(folder)
        token = self.broadcast(secrets.token_hex(8) if self.writer else None)
        marker = folder / f".quantkit-shared-{token}"
        if self.writer:
            folder.mkdir(parents=True, exist_ok=True)
            marker.write_text(token)
        self.barrier()
        try:
            seen = marker.read_text() == token
        except OSError:
            seen = False
        views = self.gather((seen, str(folder.resolve())))
        self.barrier()
        if self.writer:
            marker.unlink(missing_ok=True)
        blind = [r for r, (ok, _) in enumerate(views) if not ok]
        if blind:
            r = blind[0]
            raise InputError(f"{what} {folder} is not on storage every rank sees: rank {r} reads {views[r][1]} and does "
                             f"not find what rank 0 wrote in {views[0][1]}; put it on a filesystem shared by every node "
                             f"(it holds the resume state) and give an absolute path")

    def first_error(self, error: Exception | None) -> None:
        """After a step only some ranks check (rank 0 owns the output folder): raise the first rank's error on
        every rank, so none waits in a collective for a rank that has stopped."""
        errors = self.gather(None if error is None else (type(error).__name__, str(error)))
        for item in errors:
            if item is not None:
                kind, message = item
                raise (InputError if kind == "InputError" else RunError)(message)

    def reduce(self, named: dict[str, torch.Tensor], op: str) -> dict[str, torch.Tensor]:
        """All-reduce named tensors ('sum' or 'max'), in sorted-name order, over the union of the names the
        ranks hold (a statistic one rank never saw counts as zeros / -inf there). Returns the reduced dict."""
        if not self.distributed:
            return named
        import torch.distributed as dist

        meta = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in named.items()}
        union: dict[str, tuple] = {}
        for m in self.gather(meta):
            for k, spec in m.items():
                if union.setdefault(k, spec) != spec:
                    raise RunError(f"statistic {k} has different shapes or dtypes on different ranks")
        device = next((v.device for v in named.values()), torch.device("cpu"))
        if self.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        out = {}
        for k in sorted(union):
            shape, dtype = union[k]
            dt = getattr(torch, dtype)
            t = named.get(k)
            if t is None:
                t = torch.zeros(shape, dtype=dt, device=device) if op == "sum" else \
                    torch.full(shape, float("-inf") if dt.is_floating_point else torch.iinfo(dt).min, dtype=dt, device=device)
            home = t.device
            t = t.to(device).contiguous().clone()
            self._call(dist.all_reduce, t, red)
            self.bytes_moved += 2 * t.numel() * t.element_size()
            out[k] = t.to(home)
        return out

    def spread(self, costs: list[float]) -> list[int]:
        """Owner rank of each work unit: longest first onto the least loaded rank (deterministic, the same on
        every rank)."""
        load = [0.0] * self.world
        owner = [0] * len(costs)
        for u in sorted(range(len(costs)), key=lambda u: (-costs[u], u)):
            r = min(range(self.world), key=lambda r: (load[r], r))
            owner[u] = r
            load[r] += costs[u]
        return owner


SINGLE = Ranks()


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


@contextmanager
def ranks_from_env(device: str):
    """The process group torchrun describes (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT), set up for the
    run and torn down after it; one process (no WORLD_SIZE) gets `SINGLE`. Ranks past 0 show no progress bars.
    Yields (ranks, device): a CUDA run puts each rank on its own local GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        yield SINGLE, device
        return
    import datetime

    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    backend = _backend(device)
    quiet = os.environ.get("QUANTKIT_NO_PROGRESS")
    if rank and quiet is None:
        os.environ["QUANTKIT_NO_PROGRESS"] = "1"
    try:
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(
                seconds=float(os.environ.get("QUANTKIT_DIST_TIMEOUT", "1800"))))
        except (RuntimeError, ValueError) as exc:
            raise RunError(f"cannot join the torch.distributed group ({backend}): {str(exc).splitlines()[0]}") from None
        try:
            yield Ranks(rank=dist.get_rank(), world=dist.get_world_size(), backend=backend), device
        finally:
            dist.destroy_process_group()
    finally:
        if rank and quiet is None:
            os.environ.pop("QUANTKIT_NO_PROGRESS", None)


def leave_worker(code: int) -> None:
    """End a rank past 0 of a data-parallel run (its group already torn down, its files closed) without the
    interpreter's shutdown: about one start in sixteen, a worker aborted there (`terminate called without an
    active exception`, after destroy_process_group had returned) once rank 0, the rendezvous host, had gone."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_worker() -> bool:
    """Whether this process is a rank past 0 of a torchrun launch."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and os.environ.get("RANK", "0") != "0"
