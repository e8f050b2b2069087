"""Expert offloading on CPU: N experts per MoE layer resident, the others read from the checkpoint on demand.

`install_offload(rt, OffloadOptions(...))` strips every routed expert of a loaded runtime model of its tensors
and puts a stand-in in its place; the first call to an expert that is not resident reads its tensors from the
checkpoint's safetensors (one `get_tensor` per expert tensor from a `safe_open` handle), builds the expert
exactly as `load_model` does (the same QuantLinear formats, the same dtype casts: the offloaded model computes
bit for bit what the resident one does) and, when the layer holds N experts already, evicts one:

- lru: the least recently used;
- lfu: the least often used since the start;
- trace: activation-trace priority (after MoE-Infinity): the routing profile's frequency of the expert
  (routing_profile.json, when the checkpoint has one) plus an exponentially decayed count of its recent
  requests; the cache also starts filled with the profile's most frequent experts.

Prefetch (`prefetch=True`, after MoE-SpeQ's draft-predicted experts): when decoder layer l finishes, a draft
predicts layer l+1's experts by running layer l+1's own post-attention norm and (unquantised) router on the
hidden state leaving layer l, skipping l+1's attention, and loads the predicted experts before layer l+1
asks for them. Prediction fidelity = |predicted ∩ used| / k per token and layer.
With `overlap` (the default) their checkpoint reads run on one background thread while layer l+1's attention
computes, and a request for an expert still in flight waits for it; the module is assembled on the decoding
thread (Python and kernel packing there would fight the layer's compute for the GIL and the cores), and the
block's end files the finished ones into the cache. Without it they load in the hook, before the attention: each
prefetch then costs what the miss it saves would have, plus the wrong guesses. Evicted expert modules are reused
by the next load of their layer: a load is the tensor read and its assignment, not a copy of the module.
Measured (benchmarks/results/moe.md): on 2 CPU cores with the checkpoint in the page cache, where a load is a
memory copy and Python rather than a wait, prefetch raises the hit rate but neither mode raises decode speed.
Hit rate counts demand requests only (a prefetched expert that is then used is a hit).
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.errors import InputError
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
        from safetensors import safe_open

        from quantkit.models.safetensors_index import SafetensorsIndex
        from quantkit.runtime.moe import moe_blocks

        self.opts = opts
        self.stats = OffloadStats()
        self.dtype = rt.dtype
        self.device = rt.device
        self.blocks = {b.layer_index: b for b in moe_blocks(rt.model)}
        if not self.blocks:
            raise InputError(f"{rt.path} has no sparse-MoE layers to offload")
        spec = next(iter(self.blocks.values())).spec
        opts.check(spec.num_experts, spec.top_k)
        self.num_experts, self.top_k = spec.num_experts, spec.top_k
        index = SafetensorsIndex(rt.path)
        self._files = {}
        self._where: dict[str, object] = {}
        names = {n: m for n, m in rt.model.named_modules()}
        module_name = {id(m): n for n, m in names.items()}
        from quantkit.runtime.model import _generic_adapter

        adapter = _generic_adapter(getattr(rt.config, "model_type", "?"))
        self.templates: dict[tuple[int, int], nn.Module] = {}
        self.tensors: dict[tuple[int, int], list] = {}
        self.resident: dict[int, OrderedDict[int, nn.Module]] = {}
        self.freq: dict[int, torch.Tensor] = {}
        self.recent: dict[int, torch.Tensor] = {}
        self.prior: dict[int, torch.Tensor] = {}
        self.predicted: dict[int, torch.Tensor] = {}
        self.pending: dict[int, dict[int, Future]] = {}
        self._spare: dict[int, list[nn.Module]] = {}  # evicted experts per layer, reused by the next load
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
                    info = index.tensors[ckpt]
                    if info.file not in self._files:
                        self._files[info.file] = safe_open(str(info.file), framework="pt", device="cpu")
                    self._where[ckpt] = self._files[info.file]
                self.tensors[(layer, e)] = entries
                self.templates[(layer, e)] = _stripped(module, entries)
                experts.experts[e] = _Standin(self, layer, e)
            self.resident[layer] = OrderedDict()
            self.pending[layer] = {}
            self.freq[layer] = torch.zeros(self.num_experts)
            self.recent[layer] = torch.zeros(self.num_experts)
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

    def _read(self, layer: int, expert: int) -> tuple[list, int, float]:
        """(the expert's tensors as (child, leaf, tensor, is_param), bytes read, seconds): the checkpoint read
        alone, touching no module or cache state, so it may run on the prefetch thread."""
        start = time.perf_counter()
        moved = 0
        tensors = []
        for child_name, leaf, ckpt, is_param in self.tensors[(layer, expert)]:
            t = self._where[ckpt].get_tensor(ckpt)
            moved += t.numel() * t.element_size()
            tensors.append((child_name, leaf, t, is_param))
        return tensors, moved, time.perf_counter() - start

    def _assemble(self, layer: int, expert: int, tensors: list) -> nn.Module:
        """The expert module from its tensors, exactly as load_model builds it. An evicted expert of the layer
        is reused when there is one (same structure: only its tensors change), else the template is copied;
        quantised linears re-prepare the kernel the resident model chose."""
        spare = self._spare.get(layer)
        module = spare.pop() if spare else copy.deepcopy(self.templates[(layer, expert)]).eval()
        for child_name, leaf, t, is_param in tensors:
            child = module.get_submodule(child_name) if child_name else module
            if isinstance(child, QuantLinear) and not is_param:
                child._buffers[leaf] = t.to(self.device)  # quantised tensors as stored, like load_model
            else:
                t = t.to(self.dtype) if t.is_floating_point() else t
                child._parameters[leaf] = dense_parameter(t.to(self.device))
        for child in module.modules():
            if isinstance(child, QuantLinear) and getattr(child, "_offload_kernels", False):
                child.kernel, child.prepared = None, None  # a reused module's kernel holds the old tensors
                dispatch.prepare_layer(child, "auto")  # the kernel the resident model chose, re-prepared
        return module

    def _build(self, layer: int, expert: int) -> tuple[nn.Module, int, float]:
        """(the expert, bytes read, seconds) on the calling thread."""
        start = time.perf_counter()
        tensors, moved, _ = self._read(layer, expert)
        return self._assemble(layer, expert, tensors), moved, time.perf_counter() - start

    def _load(self, layer: int, expert: int, demand: bool, count: bool = True) -> nn.Module:
        return self._insert(layer, expert, self._build(layer, expert), demand, count)

    def _collect(self, layer: int, expert: int, future: Future, demand: bool) -> nn.Module:
        """A prefetched read, assembled here on the decoding thread (module building and kernel packing are
        Python and OpenMP work that would fight the layer's own compute for the GIL and the cores)."""
        start = time.perf_counter()
        tensors, moved, read_seconds = future.result()
        module = self._assemble(layer, expert, tensors)
        return self._insert(layer, expert, (module, moved, read_seconds + time.perf_counter() - start), demand)

    def _insert(self, layer: int, expert: int, built: tuple[nn.Module, int, float], demand: bool,
                count: bool = True) -> nn.Module:
        module, moved, seconds = built
        self.stats.bytes_moved += moved
        self.stats.load_seconds += seconds
        if count:
            if demand:
                self.stats.loads += 1
            else:
                self.stats.prefetch_loads += 1
        cache = self.resident[layer]
        while len(cache) >= self.opts.cache_size:
            self._spare.setdefault(layer, []).append(cache.pop(self._victim(layer)))
        cache[expert] = module
        return module

    def _victim(self, layer: int) -> int:
        cache = self.resident[layer]
        if self.opts.policy == "lru":
            return next(iter(cache))
        if self.opts.policy == "lfu":
            score = self.freq[layer]
        else:
            requests = max(float(self.freq[layer].sum()), 1.0)
            score = self.recent[layer] + self.opts.profile_weight * self.prior[layer] * min(requests, 64.0)
        # Lowest score goes; ties go to the least recently used (the order of the OrderedDict).
        return min(cache, key=lambda e: float(score[e]))

    def fetch(self, layer: int, expert: int) -> nn.Module:
        self.stats.requests += 1
        self.freq[layer][expert] += 1
        self.recent[layer] *= self.opts.trace_decay
        self.recent[layer][expert] += 1
        cache = self.resident[layer]
        if expert in cache:
            self.stats.hits += 1
            cache.move_to_end(expert)
            return cache[expert]
        future = self.pending[layer].pop(expert, None)
        if future is not None:  # prefetched, perhaps still in flight: a hit, at most a shorter wait
            self.stats.hits += 1
            return self._collect(layer, expert, future, demand=False)
        return self._load(layer, expert, demand=True)

    def _settle(self, layer: int) -> None:
        """File the layer's finished prefetches into its cache; those in flight stay pending."""
        for expert, future in list(self.pending[layer].items()):
            if future.done():
                del self.pending[layer][expert]
                self._collect(layer, expert, future, demand=False)

    def reset_stats(self) -> None:
        """Start counting afresh (after a prefill, to measure decode alone); residency is kept."""
        self.stats = OffloadStats()

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
                predicted = block.route(x).selected
                self.predicted[layer] = predicted
                wanted = predicted.unique().tolist()
                if len(wanted) > self.opts.cache_size:
                    return  # a prefill: more experts than fit; loading them would only churn the cache
                for e in wanted:
                    if e in self.resident[layer]:
                        self.resident[layer].move_to_end(e)
                    elif e in self.pending[layer]:
                        continue
                    elif self._pool is not None:
                        self.pending[layer][e] = self._pool.submit(self._read, layer, e)
                    else:
                        self._load(layer, e, demand=False)

            self._hooks.append(prev.register_forward_hook(after))
            if self._pool is not None:
                self._hooks.append(block.register_forward_hook(lambda mod, args, out, layer=layer: self._settle(layer)))
            self._hooks.append(block.add_router_observer(self._score_prediction))

    def _score_prediction(self, layer: int, n: int, selected: torch.Tensor, weights, scores) -> None:
        pred = self.predicted.pop(layer, None)
        if pred is None or pred.shape[0] != selected.shape[0]:
            return
        e = self.num_experts
        used = torch.zeros(selected.shape[0], e, dtype=torch.bool).scatter_(1, selected.clamp(0, e - 1).cpu(), True)
        self.stats.predicted += pred.numel()
        self.stats.predicted_right += int(used.gather(1, pred.cpu()).sum())

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for pending in self.pending.values():
            pending.clear()


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
