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
straight into its tensors, no module built, no tensor allocated; the quantised linears then re-prepare the
kernel the resident model chose, so the offloaded model computes bit for bit what the resident one does.

Prefetch (`prefetch=True`, after MoE-SpeQ's draft-predicted experts): when decoder layer l finishes, a draft
predicts layer l+1's experts by running layer l+1's own post-attention norm and (unquantised) router on the
hidden state leaving layer l, skipping l+1's attention, and loads the predicted experts before layer l+1
asks for them. Prediction fidelity = |predicted ∩ used| / k per token and layer.
With `overlap` (the default) the reads run on one background thread while layer l+1's attention computes (the
GIL is free during a read); a request for an expert still in flight waits for it, and the block's end files the
finished ones into the cache. A read in flight holds a slot: resident + in flight never exceed N. Without
`overlap` the predicted experts load in the hook, before the attention.
Hit rate counts demand requests only (a prefetched expert that is then used is a hit).
"""

from __future__ import annotations

import copy
import os
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.errors import InputError
from quantkit.models.safetensors_index import DTYPES
from quantkit.models.experts import UnfusedExperts
from quantkit.runtime import dispatch
from quantkit.runtime.formats import INPUT_TENSORS, WEIGHT_TENSORS
from quantkit.runtime.linear import QuantLinear, dense_parameter

POLICIES = ("lru", "lfu", "trace")


@dataclass(frozen=True)
class OffloadOptions:
    cache_size: int  # experts per MoE layer kept resident
    policy: str = "lru"
    prefetch: bool = False
    overlap: bool = True  # prefetch loads on a background thread (False: in the hook, before the layer runs)
    trace_decay: float = 0.9  # trace policy: weight of a request after each further request in the layer
    profile_weight: float = 1.0  # trace policy: weight of the routing-profile frequency (scaled to requests)

    def check(self, num_experts: int, top_k: int) -> None:
        if self.policy not in POLICIES:
            raise InputError(f"unknown offload policy {self.policy!r}; valid: {', '.join(POLICIES)}")
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


def _expert_tensors(module: nn.Module, prefix: str, index) -> list[tuple[str, str, str, bool]]:
    """(child path, leaf, checkpoint name, is_param) of every tensor an expert module is built from. A prepared
    QuantLinear holds its kernel's tensors, not the checkpoint's, so its stored names are looked up instead."""
    out = []
    for name, child in module.named_modules():
        own = [(leaf, True) for leaf, p in child._parameters.items() if p is not None]
        if isinstance(child, QuantLinear):
            base = f"{prefix}.{name}" if name else prefix
            own += [(leaf, False) for leaf in (*WEIGHT_TENSORS, *INPUT_TENSORS) if f"{base}.{leaf}" in index]
        else:
            own += [(leaf, False) for leaf, b in child._buffers.items() if b is not None]
        for leaf, is_param in own:
            out.append((name, leaf, f"{prefix}.{name}.{leaf}" if name else f"{prefix}.{leaf}", is_param))
    return out


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
        self.tensors: dict[tuple[int, int], list] = {}
        self.resident: dict[int, OrderedDict[int, nn.Module]] = {}
        # Plain lists, not tensors: they change on every expert request, and a tensor op there costs microseconds.
        self.freq: dict[int, list[float]] = {}
        self.recent: dict[int, list[float]] = {}
        self.prior: dict[int, torch.Tensor] = {}
        self.predicted: dict[int, torch.Tensor] = {}
        self.pending: dict[int, dict[int, tuple[nn.Module, Future]]] = {}
        self.signature: dict[tuple[int, int], tuple] = {}  # an expert's stored layout: modules of one are reusable
        self._fds: dict[object, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        for layer, block in self.blocks.items():
            experts: UnfusedExperts = getattr(block, spec.experts)
            full = module_name[id(experts)]  # e.g. model.layers.3.mlp.experts
            for e, module in enumerate(experts.experts):
                prefix = _disk_prefix(adapter, full, e)
                entries = _expert_tensors(module, prefix, index)
                for _, _, ckpt, _ in entries:
                    if ckpt not in index:
                        raise InputError(f"{rt.path}: expert tensor {ckpt} is not in the checkpoint")
                self.tensors[(layer, e)] = entries
                self.signature[(layer, e)] = tuple((c, leaf, index.tensors[ck].dtype, index.tensors[ck].shape, p)
                                                   for c, leaf, ck, p in entries) + tuple(
                    repr(m.fmt) for m in module.modules() if isinstance(m, QuantLinear))
                self.templates[(layer, e)] = _stripped(module, entries)
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
        self._hooks = []
        if opts.prefetch:
            self._install_prefetch(rt)

    # --------------------------------------------------------------------------------- residency
    # An expert module that holds tensors is either resident (in the cache) or pending (a prefetch reading into
    # it); together they never exceed the cache size. A load takes its module from the expert it evicts (same
    # structure: its tensors are overwritten in place) or, while the layer has room, a copy of the template.

    def _slot(self, layer: int, expert: int, keep=()) -> nn.Module | None:
        """A module to read `expert` into: the evicted victim's (never one in `keep`), or a fresh copy of the
        template while resident + pending are below the cache size. None when every slot is kept or in flight."""
        cache = self.resident[layer]
        if len(cache) + len(self.pending[layer]) < self.opts.cache_size:
            return copy.deepcopy(self.templates[(layer, expert)]).eval()
        victim = self._victim(layer, keep)
        if victim is None:
            return None
        module = cache.pop(victim)
        if self.signature[(layer, victim)] != self.signature[(layer, expert)]:
            return copy.deepcopy(self.templates[(layer, expert)]).eval()  # another layout: the victim is freed
        return module

    def _fill(self, layer: int, expert: int, module: nn.Module) -> tuple[int, float]:
        """Read the expert's tensors into `module` (bytes read, seconds). It touches no cache state and holds the
        GIL only between positioned reads, so it may run on the prefetch thread while the module is its own."""
        start = time.perf_counter()
        moved = 0
        for child_name, leaf, ckpt, is_param in self.tensors[(layer, expert)]:
            info = self.index.tensors[ckpt]
            child = module.get_submodule(child_name) if child_name else module
            stored = DTYPES[info.dtype]
            as_stored = isinstance(child, QuantLinear) and not is_param  # quantised tensors as stored, like load_model
            want = stored if as_stored or not stored.is_floating_point else self.dtype
            where = child._buffers if as_stored else child._parameters
            dest = where.get(leaf)
            if (dest is None or dest.is_meta or dest.dtype != want or tuple(dest.shape) != info.shape
                    or dest.device != self.device):
                dest = torch.empty(info.shape, dtype=want, device=self.device)
                where[leaf] = dest if as_stored else dense_parameter(dest)
                dest = where[leaf]
            self._read_into(ckpt, info, dest)
            moved += info.nbytes
        return moved, time.perf_counter() - start

    def _read_into(self, ckpt: str, info, dest: torch.Tensor) -> None:
        """The stored bytes straight into `dest` where nothing is converted; else read, then cast into it."""
        if (dest.device.type != "cpu" or DTYPES[info.dtype] != dest.dtype or ckpt in self.index.native_fp8
                or not dest.is_contiguous()):
            with torch.no_grad():
                dest.copy_(self.index.get(ckpt))
            return
        if info.nbytes == 0:
            return
        view = memoryview(dest.detach().reshape(-1).view(torch.uint8).numpy())
        fd = self._fds.get(info.file)
        if fd is None:
            fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY)
        done = 0
        while done < info.nbytes:
            got = os.preadv(fd, [view[done:]], info.offset + done)
            if got <= 0:
                raise InputError(f"truncated safetensors file {info.file}: cannot read {ckpt}")
            done += got

    def _finish(self, module: nn.Module) -> None:
        """Re-prepare the kernels the resident model chose, on the decoding thread (kernel packing is OpenMP
        work that would fight the layer's own compute for the cores); the reference path needs nothing."""
        for child in module.modules():
            if isinstance(child, QuantLinear) and getattr(child, "_offload_kernels", False):
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
        module, future = self.pending[layer].pop(expert)
        moved, seconds = future.result()
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
        for expert, (_, future) in list(self.pending[layer].items()):
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

            def after(mod, args, out, layer=layer, block=block, norm=norm):
                h = out[0] if isinstance(out, tuple) else out
                x = norm(h).reshape(-1, h.shape[-1])
                predicted = block.predict(x)
                self.predicted[layer] = predicted
                wanted = set(predicted.view(-1).tolist())
                if len(wanted) > self.opts.cache_size:
                    return  # a prefill: more experts than fit; loading them would only churn the cache
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
                        self.pending[layer][e] = (module, self._pool.submit(self._fill, layer, e, module))

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


def _disk_prefix(adapter, module_name: str, expert: int) -> str:
    """Checkpoint prefix of expert e of the UnfusedExperts at `module_name` (model.layers.i.<local>)."""
    root = adapter.layers_path + "."
    rest = module_name[len(root):]
    i, _, local = rest.partition(".")
    return f"{root}{i}.{adapter.to_checkpoint(local)}.{expert}"


def _stripped(module: nn.Module, entries) -> nn.Module:
    """A copy of an expert module without its tensors (meta placeholders), and the original's freed."""
    for child_name, leaf, _, is_param in entries:
        child = module.get_submodule(child_name) if child_name else module
        if is_param:
            p = child._parameters[leaf]
            child._parameters[leaf] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
        else:
            child._buffers[leaf] = None
    for child in module.modules():
        if isinstance(child, QuantLinear):
            child._offload_kernels = child.kernel is not None
            child.kernel, child.prepared = None, None  # the kernel's tensors go with the checkpoint's
    return module


def install_offload(rt, opts: OffloadOptions, profile=None) -> ExpertCache:
    """Offload every routed expert of `rt` (a RuntimeModel loaded with its experts resident) behind a cache."""
    return ExpertCache(rt, opts, profile)
