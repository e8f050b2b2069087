"""Expert offloading on CPU: N experts per MoE layer resident, the others read from the checkpoint on demand.

`install_offload(rt, OffloadOptions(...))` strips every routed expert of a loaded runtime model of its tensors
and puts a stand-in in its place; the first call to an expert that is not resident reads its tensors from the
checkpoint's safetensors and, when the layer holds N experts already, evicts one:

- lru: the least recently used;
- lfu: the least often used since the start;
- trace: activation-trace priority (after MoE-Infinity): the routing profile's frequency of the expert
  (routing_profile.json, when the checkpoint has one) plus an exponentially decayed count of its recent
  requests; the cache also starts filled with the profile's most frequent experts.

A load reads into the evicted expert's own module where their stored layouts match: positioned reads
straight into its tensors, no module built, no tensor allocated. Quantised linears are read in their kernel's
layout: when offloading starts, each expert's prepared kernel tensors (what the resident model chose and packed)
are written once to a scratch file (`OffloadOptions.scratch_dir`, else the system's temporary folder; deleted
when the cache is removed, or with the process), and a load reads those bytes back. Re-preparing the kernel on
every load instead cost more than the read (SmolLM2 MoE, GPTQ W4A16: ~180 us per linear against ~35 us for an
expert's read); it is still done for layouts that hold tensors outside their fields (`_plain_layout`). Either way
the offloaded model computes bit for bit what the resident one does.

Prefetch (`prefetch=True`, after MoE-SpeQ's draft-predicted experts): when decoder layer l finishes, a draft
predicts layer l+1's experts by running layer l+1's own post-attention norm and (unquantised) router on the
hidden state leaving layer l, skipping l+1's attention, and loads the predicted experts before layer l+1
asks for them. Prediction fidelity = |predicted ∩ used| / k per token and layer.
With `overlap` (the default) the reads run on one background thread while layer l+1's attention computes (the
GIL is free during a read); a request for an expert still in flight waits for it, and the block's end files the
finished ones into the cache. A read in flight holds a slot: resident + in flight never exceed N. Without
`overlap` the predicted experts load in the hook, before the attention.
Hit rate counts demand requests only (a prefetched expert that is then used is a hit).
`reads="storage"` drops the checkpoint from the OS page cache when offloading starts and every range a load reads
after it, so each load reads the disk, as for a checkpoint larger than memory (the default, "page-cache", reads
what the OS keeps in memory: a load is then a memory copy).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import InputError
from quantkit.models.safetensors_index import DTYPE_NAMES, DTYPES, TensorInfo
from quantkit.models.experts import UnfusedExperts
from quantkit.runtime import dispatch
from quantkit.runtime.formats import INPUT_TENSORS, WEIGHT_TENSORS
from quantkit.runtime.linear import QuantLinear, dense_parameter

POLICIES = ("lru", "lfu", "trace")
READS = ("page-cache", "storage")  # where a load's bytes come from (the module docstring's last paragraph)


@dataclass(frozen=True)
class OffloadOptions:
    cache_size: int  # experts per MoE layer kept resident
    policy: str = "lru"
    prefetch: bool = False
    overlap: bool = True  # prefetch loads on a background thread (False: in the hook, before the layer runs)
    trace_decay: float = 0.9  # trace policy: weight of a request after each further request in the layer
    profile_weight: float = 1.0  # trace policy: weight of the routing-profile frequency (scaled to requests)
    reads: str = "page-cache"  # READS
    # Where quantised experts' prepared kernel tensors are kept (None: the temporary folder): about the quantised
    # experts' size on disk; a temporary folder in memory (tmpfs) would hold them in RAM.
    scratch_dir: str | None = None

    def check(self, num_experts: int, top_k: int) -> None:
        if self.policy not in POLICIES:
            raise InputError(f"unknown offload policy {self.policy!r}; valid: {', '.join(POLICIES)}")
        if self.reads not in READS:
            raise InputError(f"unknown offload read source {self.reads!r}; valid: {', '.join(READS)}")
        if self.reads == "storage" and not hasattr(os, "posix_fadvise"):
            raise InputError("--offload-reads storage needs posix_fadvise (Linux) to keep reads off the page cache")
        if not top_k <= self.cache_size <= num_experts:
            raise InputError(f"--offload-cache {self.cache_size} is outside the valid range {top_k}..{num_experts} "
                             f"(at least top-k = {top_k} experts must fit, at most all {num_experts})")


@dataclass
class OffloadStats:
    requests: int = 0
    hits: int = 0
    loads: int = 0  # demand loads (misses)
    prefetch_loads: int = 0
    bytes_moved: int = 0
    load_seconds: float = 0.0
    predicted: int = 0  # predicted slots compared with the real routing
    predicted_right: int = 0

    def to_dict(self) -> dict:
        return {"requests": self.requests, "hits": self.hits, "hit_rate": round(self.hits / max(self.requests, 1), 4),
                "demand_loads": self.loads, "prefetch_loads": self.prefetch_loads, "bytes_moved": self.bytes_moved,
                "load_seconds": round(self.load_seconds, 4),
                "prefetch_fidelity": round(self.predicted_right / self.predicted, 4) if self.predicted else None}


PARAM, BUFFER, PREPARED = "param", "buffer", "prepared"  # where an expert tensor lives in its module


def _expert_tensors(module: nn.Module, prefix: str, index) -> list[tuple[str, str, str, str]]:
    """(child path, leaf, stored name, kind) of every tensor an expert module is built from. A QuantLinear with a
    kernel holds the kernel's prepared tensors (kind PREPARED, named `<linear>#prepared.<field>`: they are read
    from the cache's scratch file); one on the reference path holds its checkpoint tensors."""
    out = []
    for name, child in module.named_modules():
        base = f"{prefix}.{name}" if name else prefix
        own = [(leaf, PARAM) for leaf, p in child._parameters.items() if p is not None]
        if isinstance(child, QuantLinear) and _plain_layout(child.prepared):
            out += [(name, f.name, f"{base}#prepared.{f.name}", PREPARED) for f in dataclasses.fields(child.prepared)
                    if isinstance(getattr(child.prepared, f.name), torch.Tensor)]
        elif isinstance(child, QuantLinear):
            own += [(leaf, BUFFER) for leaf in (*WEIGHT_TENSORS, *INPUT_TENSORS) if f"{base}.{leaf}" in index]
        else:
            own += [(leaf, BUFFER) for leaf, b in child._buffers.items() if b is not None]
        out += [(name, leaf, f"{base}.{leaf}", kind) for leaf, kind in own]
    return out


def _plain_layout(prepared) -> bool:
    """Whether a kernel's layout holds its tensors in its own fields only, each of a dtype safetensors names (then
    they can be stored and read back field by field). A layout that also keeps tensors elsewhere (the CUDA kernels'
    checkpoint tensors, for their reference fallback) is prepared again after each load instead."""
    if prepared is None:
        return False
    fields = [t for f in dataclasses.fields(prepared) if isinstance(t := getattr(prepared, f.name), torch.Tensor)]
    return ({id(t) for t in prepared.tensors()} <= {id(t) for t in fields}
            and all(t.dtype in DTYPE_NAMES for t in fields))


class _Standin(nn.Module):
    """Sits where an offloaded expert was; asks the cache for the real one."""

    def __init__(self, cache: "ExpertCache", layer: int, expert: int):
        super().__init__()
        self.layer, self.expert = layer, expert
        self._cache = [cache]  # a list: not a registered submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._cache[0].fetch(self.layer, self.expert)(x)


class ExpertCache:
    """Per-layer resident experts with one eviction policy; experts are built from the checkpoint on demand."""

    def __init__(self, rt, opts: OffloadOptions, profile=None):
        from quantkit.models.safetensors_index import SafetensorsIndex
        from quantkit.runtime.moe import moe_blocks

        self.opts = opts
        self._cold = opts.reads == "storage"
        self._stats = OffloadStats()
        self._guesses: list[tuple[torch.Tensor, torch.Tensor]] = []  # (predicted, used) per layer step, scored late
        self.dtype = rt.dtype
        self.device = rt.device
        self.blocks = {b.layer_index: b for b in moe_blocks(rt.model)}
        if not self.blocks:
            raise InputError(f"{rt.path} has no sparse-MoE layers to offload")
        spec = next(iter(self.blocks.values())).spec
        opts.check(spec.num_experts, spec.top_k)
        self.num_experts, self.top_k = spec.num_experts, spec.top_k
        index = SafetensorsIndex(rt.path)
        self.index = index
        names = {n: m for n, m in rt.model.named_modules()}
        module_name = {id(m): n for n, m in names.items()}
        from quantkit.runtime.model import _generic_adapter

        adapter = _generic_adapter(getattr(rt.config, "model_type", "?"))
        self.templates: dict[tuple[int, int], nn.Module] = {}
        self.resident: dict[int, OrderedDict[int, nn.Module]] = {}
        # Plain lists, not tensors: they change on every expert request, and a tensor op there costs microseconds.
        self.freq: dict[int, list[float]] = {}
        self.recent: dict[int, list[float]] = {}
        self.prior: dict[int, torch.Tensor] = {}
        self.predicted: dict[int, torch.Tensor] = {}
        self.pending: dict[int, dict[int, tuple[nn.Module, Future, int]]] = {}  # module, its reads, bytes
        self.plans: dict[tuple[int, int], list[tuple]] = {}  # per stored tensor: where and how it is read
        self.signature: dict[tuple[int, int], tuple] = {}  # an expert's stored layout: modules of one are reusable
        self._fds: dict[object, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.stored: dict[str, TensorInfo] = {}  # the prepared kernel tensors written to the scratch file
        self._scratch: str | None = None  # the scratch file's key in _fds (where a kernel layout is stored)
        self._scratch_end = 0  # where its next tensor goes
        self._kernels: dict[int, object] = {}  # shared, never copied with a template (they hold compiled code)
        if any(isinstance(m, QuantLinear) and _plain_layout(m.prepared)
               for block in self.blocks.values() for m in getattr(block, spec.experts).modules()):
            self._open_scratch()
        for layer, block in self.blocks.items():
            experts: UnfusedExperts = getattr(block, spec.experts)
            full = module_name[id(experts)]  # e.g. model.layers.3.mlp.experts
            for e, module in enumerate(experts.experts):
                prefix = _disk_prefix(adapter, full, e)
                entries = _expert_tensors(module, prefix, index)
                for c, leaf, ckpt, kind in entries:
                    if kind == PREPARED:
                        self._store(ckpt, module.get_submodule(c) if c else module, leaf)
                    elif ckpt not in index:
                        raise InputError(f"{rt.path}: expert tensor {ckpt} is not in the checkpoint")
                self.plans[(layer, e)] = [self._plan_entry(module, *entry) for entry in entries]
                self.signature[(layer, e)] = tuple((c, leaf, self._info(ck).dtype, self._info(ck).shape, kind)
                                                   for c, leaf, ck, kind in entries) + tuple(
                    repr(m.fmt) + m.kernel_name for m in module.modules() if isinstance(m, QuantLinear))
                self.templates[(layer, e)] = _stripped(module, entries, self._kernels)
                experts.experts[e] = _Standin(self, layer, e)
            self.resident[layer] = OrderedDict()
            self.pending[layer] = {}
            self.freq[layer] = [0.0] * self.num_experts
            self.recent[layer] = [0.0] * self.num_experts
            self.prior[layer] = torch.zeros(self.num_experts)
            if profile is not None and layer in profile.layers:
                self.prior[layer] = profile.layers[layer].frequency().float()
        if opts.policy == "trace":
            # Start from the profile: its most frequent experts are resident before the first token.
            for layer in self.resident:
                if self.prior[layer].sum() > 0:
                    for e in self.prior[layer].topk(opts.cache_size).indices.tolist():
                        self._load(layer, e, demand=False, count=False)
        if self._cold:
            for file in {info.file for info in index.tensors.values()}:
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        self._hooks = []
        if opts.prefetch:
            self._install_prefetch(rt)

    def _info(self, name: str) -> TensorInfo:
        return self.stored.get(name) or self.index.tensors[name]

    def _open_scratch(self) -> None:
        """Create the scratch file, unlinked at once so the process's exit removes it whatever happens; before any
        expert is touched, so a folder that cannot take it leaves the model as it was."""
        try:
            fd, path = tempfile.mkstemp(prefix="quantkit-offload-", suffix=".bin", dir=self.opts.scratch_dir)
        except OSError as exc:
            where = self.opts.scratch_dir or tempfile.gettempdir()
            raise InputError(f"cannot create the offload scratch file in {where}: {exc.strerror}") from None
        os.unlink(path)
        self._scratch = f"<prepared experts {path}>"
        self._fds[self._scratch] = fd

    def _store(self, name: str, child: QuantLinear, field: str) -> None:
        """Append one prepared kernel tensor to the scratch file and record where it lies."""
        fd = self._fds[self._scratch]
        t = getattr(child.prepared, field).detach().contiguous().cpu()
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        at = -(-self._scratch_end // 64) * 64  # 64-byte aligned, as torch allocates
        done = 0
        while done < len(data):
            done += os.pwrite(fd, memoryview(data)[done:], at + done)
        self._scratch_end = at + len(data)
        self.stored[name] = TensorInfo(self._scratch, DTYPE_NAMES[t.dtype], tuple(t.shape), len(data), at)

    def _read(self, name: str, info: TensorInfo) -> torch.Tensor:
        """A stored tensor as a new CPU tensor, for a destination its bytes cannot go to directly (another device)."""
        if name not in self.stored:
            return self.index.get(name)
        out = torch.empty(info.shape, dtype=DTYPES[info.dtype])
        if info.nbytes:
            _pread_all([(self._fds[info.file], memoryview(out.reshape(-1).view(torch.uint8).numpy()), info.offset,
                         name)])
        return out

    def _plan_entry(self, module: nn.Module, child_name: str, leaf: str, name: str, kind: str) -> tuple:
        """(child, leaf, stored name, info, kept as stored, dtype in the module, kind) of one expert tensor:
        quantised linears keep their tensors as stored, like load_model; dense floating tensors take the model's
        dtype."""
        info = self._info(name)
        child = module.get_submodule(child_name) if child_name else module
        stored = DTYPES[info.dtype]
        as_stored = isinstance(child, QuantLinear) and kind != PARAM
        return (child_name, leaf, name, info, as_stored,
                stored if as_stored or not stored.is_floating_point else self.dtype, kind)

    # --------------------------------------------------------------------------------- residency
    # An expert module that holds tensors is either resident (in the cache) or pending (a prefetch reading into
    # it); together they never exceed the cache size. A load takes its module from the expert it evicts (same
    # structure: its tensors are overwritten in place) or, while the layer has room, a copy of the template.

    def _slot(self, layer: int, expert: int, keep=()) -> nn.Module | None:
        """A module to read `expert` into: the evicted victim's (never one in `keep`), or a fresh copy of the
        template while resident + pending are below the cache size. None when every slot is kept or in flight."""
        cache = self.resident[layer]
        if len(cache) + len(self.pending[layer]) < self.opts.cache_size:
            return self._copy(layer, expert)
        victim = self._victim(layer, keep)
        if victim is None:
            return None
        module = cache.pop(victim)
        if self.signature[(layer, victim)] != self.signature[(layer, expert)]:
            return self._copy(layer, expert)  # another layout: the victim is freed
        return module

    def _copy(self, layer: int, expert: int) -> nn.Module:
        """A fresh module from the expert's template; its kernels are shared, not copied."""
        return copy.deepcopy(self.templates[(layer, expert)], dict(self._kernels)).eval()

    def _fill(self, layer: int, expert: int, module: nn.Module) -> tuple[int, float]:
        """Read the expert's tensors into `module` on the calling thread (bytes read, seconds)."""
        start = time.perf_counter()
        reads, moved = self._targets(layer, expert, module)
        _pread_all(reads, self._cold)
        return moved, time.perf_counter() - start

    def _targets(self, layer: int, expert: int, module: nn.Module) -> tuple[list[tuple], int]:
        """Where the expert's stored tensors go in `module`: (fd, byte view, file offset, checkpoint name) for
        each one read as it is stored, and the bytes of all; a tensor converted on the way (another dtype or
        device, a native FP8 weight) is read and cast here. A module keeps its destinations (tensor and byte
        view) from one read to the next, so a reused module costs no allocation and little Python."""
        plan = self.plans[(layer, expert)]
        dests = module.__dict__.get("_offload_dests")
        known = module.__dict__.get("_offload_reads")
        if known is not None and expert in known and all(where.get(leaf) is held for where, leaf, held, _ in dests):
            return known[expert]  # the same tensors as the last time this expert was read into this module
        if dests is None:
            dests = [[_holder(module.get_submodule(c) if c else module, kind), leaf, None, None]
                     for c, leaf, _, _, _, _, kind in plan]
            module.__dict__["_offload_dests"] = dests
        reads, moved = [], 0
        for slot, (_, _, ckpt, info, as_stored, want, _) in zip(dests, plan):
            where, leaf, held, view = slot
            dest = where.get(leaf)
            if dest is None or dest is not held:
                if (dest is None or dest.is_meta or dest.dtype != want or tuple(dest.shape) != info.shape
                        or dest.device != self.device):
                    fresh = torch.empty(info.shape, dtype=want, device=self.device)
                    where[leaf] = fresh if as_stored else dense_parameter(fresh)
                    dest = where[leaf]
                view = self._byte_view(ckpt, info, dest)
                slot[2], slot[3] = dest, view
            if view is not None:
                fd = self._fds.get(info.file)
                if fd is None:
                    fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY)
                reads.append((fd, view, info.offset, ckpt))
            elif info.nbytes:
                with torch.no_grad():
                    dest.copy_(self._read(ckpt, info))
            moved += info.nbytes
        if all(r is not None for *_, r in dests):  # only byte views: the plan can be replayed
            module.__dict__.setdefault("_offload_reads", {})[expert] = (reads, moved)
        return reads, moved

    def _byte_view(self, ckpt: str, info, dest: torch.Tensor) -> memoryview | None:
        """A writable view of dest's bytes where the stored bytes go there as they are; None where they are
        converted on the way (another dtype or device, a native FP8 weight) or there is nothing to read."""
        if (dest.device.type != "cpu" or DTYPES[info.dtype] != dest.dtype or ckpt in self.index.native_fp8
                or not dest.is_contiguous() or info.nbytes == 0):
            return None
        return memoryview(dest.detach().reshape(-1).view(torch.uint8).numpy())

    def _finish(self, module: nn.Module) -> None:
        """Prepare again the kernels whose layout is not read back (`_plain_layout`), on the decoding thread (kernel
        packing is OpenMP work that would fight the layer's own compute for the cores). Which children need it is
        found once per module."""
        again = module.__dict__.get("_offload_again")
        if again is None:
            again = module.__dict__["_offload_again"] = [
                c for c in module.modules() if isinstance(c, QuantLinear) and getattr(c, "_offload_kernels", False)]
        for child in again:
            child.kernel, child.prepared = None, None
            dispatch.prepare_layer(child, "auto")

    def _load(self, layer: int, expert: int, demand: bool, count: bool = True, keep=()) -> nn.Module | None:
        """Read `expert` into a slot on the calling thread and file it; None when no slot is free."""
        module = self._slot(layer, expert, keep)
        if module is None:
            return None
        moved, seconds = self._fill(layer, expert, module)
        start = time.perf_counter()
        self._finish(module)
        return self._insert(layer, expert, module, moved, seconds + time.perf_counter() - start, demand, count)

    def _collect(self, layer: int, expert: int) -> nn.Module:
        """File a prefetch into the cache, waiting for its read if it is still in flight."""
        module, future, moved = self.pending[layer].pop(expert)
        seconds = future.result()  # the layer's reads together: counted with the first of its experts filed
        if getattr(future, "counted", False):
            seconds = 0.0
        future.counted = True
        start = time.perf_counter()
        self._finish(module)
        return self._insert(layer, expert, module, moved, seconds + time.perf_counter() - start, demand=False)

    def _insert(self, layer: int, expert: int, module: nn.Module, moved: int, seconds: float, demand: bool,
                count: bool = True) -> nn.Module:
        self._stats.bytes_moved += moved
        self._stats.load_seconds += seconds
        if count:
            if demand:
                self._stats.loads += 1
            else:
                self._stats.prefetch_loads += 1
        self.resident[layer][expert] = module
        return module

    def _victim(self, layer: int, keep=()) -> int | None:
        candidates = [e for e in self.resident[layer] if e not in keep]
        if not candidates:
            return None
        if self.opts.policy == "lru":
            return candidates[0]
        if self.opts.policy == "lfu":
            score = self.freq[layer]
        else:
            weight = self.opts.profile_weight * min(max(sum(self.freq[layer]), 1.0), 64.0)
            prior = self.prior[layer].tolist()
            score = [r + weight * p for r, p in zip(self.recent[layer], prior)]
        # Lowest score goes; ties go to the least recently used (the order of the OrderedDict).
        return min(candidates, key=lambda e: score[e])

    def fetch(self, layer: int, expert: int) -> nn.Module:
        self._stats.requests += 1
        self.freq[layer][expert] += 1
        if self.opts.policy == "trace":
            recent = self.recent[layer]
            recent[:] = [r * self.opts.trace_decay for r in recent]
            recent[expert] += 1
        cache = self.resident[layer]
        if expert in cache:
            self._stats.hits += 1
            cache.move_to_end(expert)
            return cache[expert]
        if expert in self.pending[layer]:  # prefetched, perhaps still in flight: a hit, at most a shorter wait
            self._stats.hits += 1
            return self._collect(layer, expert)
        module = self._load(layer, expert, demand=True)
        if module is None:  # every slot is in flight (cache size = prefetches): file them, then evict
            self._settle(layer, wait=True)
            module = self._load(layer, expert, demand=True)
        return module

    def _settle(self, layer: int, wait: bool = False) -> None:
        """File the layer's finished prefetches into its cache (`wait`: all of them); the rest stay pending."""
        for expert, (_, future, _) in list(self.pending[layer].items()):
            if wait or future.done():
                self._collect(layer, expert)

    @property
    def stats(self) -> OffloadStats:
        """The counters so far. Predictions are compared with the routing here, not while decoding: the
        comparison is a handful of small tensor ops per layer and token that would sit on the decode's path."""
        e = self.num_experts
        for pred, selected in self._guesses:
            used = torch.zeros(selected.shape[0], e, dtype=torch.bool).scatter_(1, selected.clamp(0, e - 1).cpu(), True)
            self._stats.predicted += pred.numel()
            self._stats.predicted_right += int(used.gather(1, pred.cpu()).sum())
        self._guesses.clear()
        return self._stats

    def reset_stats(self) -> None:
        """Start counting afresh (after a prefill, to measure decode alone); residency is kept."""
        self._stats = OffloadStats()
        self._guesses.clear()

    def resident_experts(self, layer: int) -> list[int]:
        return list(self.resident[layer])

    # ---------------------------------------------------------------------------------- prefetch

    def _install_prefetch(self, rt) -> None:
        from quantkit.runtime.model import _generic_adapter
        from quantkit.models.loader import _get

        adapter = _generic_adapter(getattr(rt.config, "model_type", "?"))
        layers = _get(rt.model, adapter.layers_path)
        if self.opts.overlap:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-prefetch")
        for layer, block in self.blocks.items():
            if layer == 0:
                continue
            prev, target = layers[layer - 1], layers[layer]
            norm = target.post_attention_layernorm
            folded = folded_router(block, norm)

            def after(mod, args, out, layer=layer, block=block, norm=norm, folded=folded):
                h = out[0] if isinstance(out, tuple) else out
                if folded is not None:  # one small fp32 matmul (bf16 is 4x slower at this size) and a top-k
                    logits = F.linear(h.reshape(-1, h.shape[-1]).float(), folded)
                    predicted = logits.topk(self.top_k, dim=-1).indices
                else:
                    predicted = block.predict(norm(h).reshape(-1, h.shape[-1]))
                self.predicted[layer] = predicted
                wanted = set(predicted.view(-1).tolist())
                if len(wanted) > self.opts.cache_size:
                    return  # a prefill: more experts than fit; loading them would only churn the cache
                batch, jobs = Future(), []
                for e in wanted:
                    if e in self.resident[layer]:
                        self.resident[layer].move_to_end(e)
                    elif e in self.pending[layer]:
                        continue
                    elif self._pool is None:
                        if self._load(layer, e, demand=False, keep=wanted) is None:
                            break
                    else:
                        module = self._slot(layer, e, keep=wanted)
                        if module is None:
                            break
                        reads, moved = self._targets(layer, e, module)
                        self.pending[layer][e] = (module, batch, moved)  # holds its slot from now on
                        jobs += reads
                if jobs:
                    self._pool.submit(_timed_reads, jobs, batch, self._cold)  # one job per layer: the thread only reads
                else:
                    batch.set_result(0.0)  # nothing to read there (converted tensors were read in place)

            self._hooks.append(prev.register_forward_hook(after))
            if self._pool is not None:
                self._hooks.append(block.register_forward_hook(lambda mod, args, out, layer=layer: self._settle(layer)))
            self._hooks.append(block.add_router_observer(self._score_prediction))

    def _score_prediction(self, layer: int, n: int, selected: torch.Tensor, weights, scores) -> None:
        pred = self.predicted.pop(layer, None)
        if pred is not None and pred.shape[0] == selected.shape[0]:
            self._guesses.append((pred, selected))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for pending in self.pending.values():
            pending.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _timed_reads(reads: list[tuple], future: Future, cold: bool = False) -> None:
    """Run the reads and settle `future` with their seconds (or their error, raised where it is collected)."""
    start = time.perf_counter()
    try:
        _pread_all(reads, cold)
    except BaseException as exc:  # noqa: BLE001 - handed to the decoding thread
        future.set_exception(exc)
        return
    future.set_result(time.perf_counter() - start)


def _pread_all(reads: list[tuple], cold: bool = False) -> None:
    """Positioned reads straight into the destinations' bytes. Tensors that lie back to back in a file are read
    by one scattering call: the GIL is free while a call copies, and each call's return takes it back from the
    decoding thread, which is what a prefetch thread costs the decode here. `cold`: each range read is dropped from
    the page cache afterwards, so its next read comes from storage again."""
    runs: list[list] = []
    for fd, view, offset, ckpt in sorted(reads, key=lambda r: (r[0], r[2])):
        last = runs[-1] if runs else None
        if last is not None and last[0] == fd and last[1] + last[2] == offset:
            last[2] += len(view)
            last[3].append(view)
        else:
            runs.append([fd, offset, len(view), [view], ckpt])
    for fd, offset, size, views, ckpt in runs:
        got = os.preadv(fd, views, offset)
        at = offset
        for view in views if got != size else ():  # a short read: finish it buffer by buffer
            done = max(0, min(len(view), got))
            got -= len(view)
            while done < len(view):
                n = os.preadv(fd, [view[done:]], at + done)
                if n <= 0:
                    raise InputError(f"truncated safetensors file: cannot read {ckpt}")
                done += n
            at += len(view)
        if cold:
            os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)


def folded_router(block, norm: nn.Module) -> torch.Tensor | None:
    """The router's weight times the norm's, [E, H] in fp32, where top-k of its logits on the raw hidden state ranks
    the experts as the block's routing of norm(h) does, else None. That holds for softmax scores ranked without a
    selection bias or expert groups, whatever positive factor per token scales the logits, and for a norm that is
    such a factor times weight * h: checked on random rows (Gemma's 1 + weight or a LayerNorm's mean fail it)."""
    spec = block.spec
    weight = getattr(norm, "weight", None)
    if spec.scoring != "softmax" or spec.selection_bias or spec.group_limited or not isinstance(weight, torch.Tensor):
        return None
    if weight.dim() != 1 or not bool((weight != 0).any()):
        return None
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(8, weight.shape[0], generator=generator).to(weight.dtype)
    with torch.no_grad():
        ratio = norm(h).float() / (h.float() * weight.float())
    # Tiny entries say nothing about the ratio at bf16's precision; a zero weight's channel is zero either way.
    keep = (h.float().abs() > 0.05) & (weight != 0)
    for row, mask in zip(ratio, keep):
        r = row[mask]
        if r.numel() == 0 or not bool((r > 0).all()) or float(r.max() / r.min()) > 1.05:
            return None
    return block.router_module().weight.float() * weight.float()


def _disk_prefix(adapter, module_name: str, expert: int) -> str:
    """Checkpoint prefix of expert e of the UnfusedExperts at `module_name` (model.layers.i.<local>)."""
    root = adapter.layers_path + "."
    rest = module_name[len(root):]
    i, _, local = rest.partition(".")
    return f"{root}{i}.{adapter.to_checkpoint(local)}.{expert}"


def _holder(child: nn.Module, kind: str) -> dict:
    """The dict an expert tensor of `kind` lives in: the module's parameters or buffers, or its kernel's fields."""
    if kind == PARAM:
        return child._parameters
    if kind == BUFFER:
        return child._buffers
    return vars(child.prepared)


def _stripped(module: nn.Module, entries, kernels: dict[int, object]) -> nn.Module:
    """A copy of an expert module without its tensors (meta placeholders; the kernels' layouts keep theirs as
    meta tensors), and the original's freed. Each kernel is recorded in `kernels` by id."""
    for child_name, leaf, _, kind in entries:
        child = module.get_submodule(child_name) if child_name else module
        if kind == PARAM:
            p = child._parameters[leaf]
            child._parameters[leaf] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
        elif kind == PREPARED:
            setattr(child.prepared, leaf, torch.empty_like(getattr(child.prepared, leaf), device="meta"))
        else:
            child._buffers[leaf] = None
    stored = {child_name for child_name, _, _, kind in entries if kind == PREPARED}
    for name, child in module.named_modules():
        if not isinstance(child, QuantLinear) or child.kernel is None:
            continue
        if name in stored:  # its layout is read back: the template keeps the kernel, shared by every copy
            kernels[id(child.kernel)] = child.kernel
        else:  # prepared again after each load (_finish); its tensors go with the checkpoint's
            child._offload_kernels = True
            child.kernel, child.prepared = None, None
    return module


def install_offload(rt, opts: OffloadOptions, profile=None) -> ExpertCache:
    """Offload every routed expert of `rt` (a RuntimeModel loaded with its experts resident) behind a cache."""
    return ExpertCache(rt, opts, profile)
