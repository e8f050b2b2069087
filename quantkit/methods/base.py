"""The method interface: what a quantisation method sees of a layer, and what it hands back.

The engine calls, for each decoder layer: `attach` (register statistics hooks for the calibration pass,
only when `uses_statistics`), then `apply` after the pass. Methods compose (`smoothquant+gptq`): all attach
in the same pass, apply in order; the last one must quantise every target the earlier ones left.
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from quantkit.distributed import SINGLE, Ranks
from quantkit.errors import InputError, RunError
from quantkit.quant.weights import as_stored
from quantkit.quant.schemes import Scheme


@dataclass
class QuantizedWeight:
    q: torch.Tensor  # [out, in]: int8 values in the scheme's signed range, float8_e4m3fn, or fp4 values in fp32
    scale: torch.Tensor  # fp32, stored layout: [out, n_groups] / [out, 1] / [1] / [ceil(out/bh), ceil(in/bw)]
    zero_point: torch.Tensor | None  # int8 [out, n_groups], None when symmetric
    g_idx: torch.Tensor | None = None  # int32 [in]: group of each input column (act-order "group")
    method: str = ""
    global_scale: torch.Tensor | None = None  # NVFP4's fp32 [1]


def _sync_device() -> None:
    """Wait for queued GPU work (nothing to do, and CUDA never initialised by this, in a CPU run)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


@dataclass
class LayerContext:
    index: int
    layer: nn.Module  # fp32 copy of the decoder layer on the compute device
    targets: dict[str, nn.Linear]  # layer-local name -> linear to quantise
    scheme: Scheme  # the run's scheme; `schemes` overrides it per linear (fallbacks)
    checkpoint_names: dict[str, str]  # layer-local name -> full checkpoint name
    weight_dtype: torch.dtype = torch.bfloat16  # dtype of weights and scales in the checkpoint
    results: dict[str, QuantizedWeight] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)  # warnings / fallbacks, written to the manifest
    linear_errors: dict[str, float] = field(default_factory=dict)  # relative output error per linear
    schemes: dict[str, Scheme] = field(default_factory=dict)
    input_absmax: dict[str, torch.Tensor] = field(default_factory=dict)  # static-activation observers
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # static input_scale per linear
    adapter: object = None  # the model's Adapter (smoothing mappings for AWQ / SmoothQuant)
    # What the run's matmuls compute in (quantkit.compute): methods' own products (AWQ's Hessian loss) follow
    # it, since a bf16 product is ~10x faster than fp32 on AMX CPUs and ~30x slower on AVX2-only ones.
    matmul_dtype: torch.dtype = torch.float32
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase of this layer (see `phase`)
    ranks: Ranks = SINGLE  # data-parallel calibration: this process's place among the ranks
    # One-pass schedule: the linears an `apply` call quantises (None: every pending one), and the linear whose
    # input each linear shares (its statistics' owner), known before the pass from the probe forward.
    active: set[str] | None = None
    input_leaders: dict[str, str] = field(default_factory=dict)
    schedule: str = "two-pass"  # which schedule calibrated this layer (recorded in the manifest)
    # MoE experts' statistics from every token (recipe calibration.expert_tokens "all"), or only routed ones,
    # with experts routed fewer than min_expert_tokens quantised by RTN.
    all_expert_tokens: bool = True
    min_expert_tokens: int = 64
    expert_linears: set[str] = field(default_factory=set)  # targets inside routed experts (not shared ones)
    global_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # NVFP4, per linear (see global_scale)
    # --kv-cache: absmax per KV head of the keys ("k", after RoPE) and values ("v") the layer stores, observed in
    # the pass that feeds the next layer (emptied as that pass starts, so earlier passes do not count)
    kv_absmax: dict[str, torch.Tensor] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str):
        """Time a phase of this layer's work (statistics, factorisation, solve, scale_search, error_report, ...);
        the seconds add up per name and go to the layer's record in the manifest and --json. Where CUDA is in
        use the device is synchronised at both ends, so a phase is charged its own GPU work, not the queue's."""
        _sync_device()
        began = time.perf_counter()
        try:
            yield
        finally:
            _sync_device()
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - began

    def scheme_for(self, name: str) -> Scheme:
        return self.schemes.get(name, self.scheme)

    def global_scale(self, name: str) -> torch.Tensor | None:
        """NVFP4's global scale of a linear, shared by the linears a serving engine fuses with it (q/k/v,
        gate/up: vLLM runs them as one matmul under one global scale), from their weights as they are when the
        first of them is quantised (after any smoothing). None for every other scheme."""
        if not self.scheme_for(name).weights.fp4_global:
            return None
        if name not in self.global_scales:
            from quantkit.quant.fp4 import nvfp4_global_scale
            from quantkit.serving.parallel import merge_key

            key = merge_key(name)
            fused = [n for n in self.targets if key is not None and (merge_key(n) or ("",))[0] == key[0]
                     and self.scheme_for(n).weights.fp4_global] or [name]
            absmax = torch.stack([self.targets[n].weight.data.abs().amax().float() for n in fused]).amax()
            scale = nvfp4_global_scale(absmax.cpu())
            for n in fused:
                self.global_scales[n] = scale
        return self.global_scales[name]

    def warn(self, linear: str, what: str) -> None:
        self.events.append({"layer": self.index, "module": self.checkpoint_names.get(linear, linear), "event": what})

    def set_quantized(self, name: str, result: QuantizedWeight) -> None:
        """Record a linear's quantised weight and swap the dequantised values into the module, so the rest
        of the layer (and the next layers) run with what the checkpoint will contain."""
        linear = self.targets[name]
        deq = as_stored(result.q, result.scale, result.zero_point, self.scheme_for(name).weights, self.weight_dtype,
                        result.g_idx, result.global_scale)
        linear.weight.data.copy_(deq.to(linear.weight.dtype))
        self.results[name] = result

    def pending(self) -> list[str]:
        return [n for n in self.targets if n not in self.results and (self.active is None or n in self.active)]


@dataclass
class PreviewStats:
    """Statistics of a linear's input on a few calibration samples (the mixed-precision sensitivity pass)."""

    tokens: int
    mean_square: torch.Tensor | None = None  # [in] mean x^2 per input column
    hessian: torch.Tensor | None = None  # [in, in] 2 / tokens * X^T X (GPTQ's H)


def check_known_options(method: str, options: dict, known) -> None:
    """Refuse recipe options a method does not have, naming the valid ones (a typo must not be ignored)."""
    bad = set(options) - set(known)
    if bad:
        raise InputError(f"unknown {method} option(s): {', '.join(sorted(bad))}; valid: {', '.join(sorted(known))}")


class Method:
    name: ClassVar[str] = ""
    needs_calibration: ClassVar[bool] = False
    quantizes: ClassVar[bool] = True  # False for pure transforms (smoothing) that must be followed by a quantiser
    schemes: ClassVar[tuple[str, ...] | None] = None  # scheme names the method can produce; None = every scheme
    # Whether `apply` may quantise any subset of the pending linears (ctx.active) with the statistics of those
    # alone, as the one-pass schedule asks; methods that move scales between linears (AWQ) cannot.
    groupwise: ClassVar[bool] = False

    def __init__(self, scheme: Scheme, **options):
        self.scheme = scheme
        self.options = options

    @property
    def uses_statistics(self) -> bool:
        """Whether `attach` must run during the calibration pass. A method may want statistics without the
        full calibration set (RTN's importance weights come from the few error-measuring samples)."""
        return self.needs_calibration

    @property
    def statistics_tokens(self) -> int | None:
        """How many calibration tokens the statistics need: None for all of them (sums a method must see whole,
        such as GPTQ's Hessian); a number lets a two-pass calibration pass run only the run's first batches up
        to that many tokens (means and sampled losses: AWQ). The quantised pass always runs every batch."""
        return None

    def attach(self, ctx: LayerContext) -> list[torch.utils.hooks.RemovableHandle]:
        return []

    # What `preview` needs of the linear's input: None, "importance" (PreviewStats.mean_square) or "hessian".
    preview_stats: ClassVar[str | None] = None

    def preview(self, weight: torch.Tensor, args, stats: PreviewStats | None, weight_dtype: torch.dtype) -> torch.Tensor:
        """The fp32 weight this method would store for `weight` under `args` (a QuantArgs), as the checkpoint
        rounds it: what mixed precision weighs each choice by. The default rounds to nearest."""
        from quantkit.quant.weights import round_trip

        return round_trip(weight, args, weight_dtype)

    def reduce_statistics(self, ranks: Ranks) -> None:
        """Data-parallel calibration: combine this rank's statistics with every other rank's (`ranks.reduce`),
        so that `apply` sees the whole run's. Sums are kept in float64 (exact, so independent of the split)."""
        if self.uses_statistics:
            raise RunError(f"{self.name} cannot calibrate data-parallel yet; run it in one process")

    def apply(self, ctx: LayerContext) -> None:
        raise NotImplementedError

    # A transform stage the one-pass schedule can run inside its grouped pass (engine._process_layer_one_pass)
    # instead of in a calibration pass of its own: it changes only how a module's output feeds one group of linears.
    def group_sources(self, ctx: LayerContext) -> dict[str, list[str]] | None:
        """{module name: the linears its output feeds} that `transform_group` acts on, after `attach`; None where
        this method needs a pass of its own. The engine checks on its probe forward that each module's output is
        exactly the input of that group."""
        return None

    def transform_group(self, ctx: LayerContext, names: list[str]) -> torch.Tensor | None:
        """Transform the group `names` from the statistics its batches recorded so far, leaving the layer's
        function unchanged, and return s such that the group's input is now x / s (per input channel); None when
        nothing changed. The engine divides the paused batches' inputs by s."""
        return None

    # Whether `rescale_input_statistics` can follow such a transform (methods without statistics need nothing).
    rescales_inputs: ClassVar[bool] = False

    def rescale_input_statistics(self, leader: str, s: torch.Tensor) -> None:
        """The statistics gathered on the input x of `leader`'s group must now describe x / s: a transform fused into
        the grouped pass changed that input after they were recorded and before this method applies."""


class SharedInputs:
    """Which linears read the same input tensor (q/k/v, gate/up, a MoE block's input): each linear maps to its
    leader, the first linear seen reading that tensor object, so statistics of one input are gathered once.
    The last `keep` inputs are remembered, most recently used last, so a MoE block's input stays known while
    every expert's own input passes by. They are held by weak reference: remembering an input must never keep
    a batch's activations alive (strong references held ~100 MB of a 0.7B model's past batches)."""

    def __init__(self, keep: int = 8, known: dict[str, str] | None = None) -> None:
        self.leaders: dict[str, str] = dict(known or {})  # known: from the one-pass probe (ctx.input_leaders)
        self._recent: list[tuple[weakref.ref, str]] = []
        self._keep = keep

    def see(self, name: str, x: torch.Tensor) -> str:
        """Record that `name` read `x`; return its leader (itself if it is the first reader)."""
        leader = self.leaders.get(name)
        if leader is None:
            leader = next((lead for ref, lead in self._recent if ref() is x), name)
            self.leaders[name] = leader
        alive = [(ref, lead) for ref, lead in self._recent if ref() is not None and ref() is not x]
        self._recent = (alive + [(weakref.ref(x), leader)])[-self._keep:]
        return leader

    def leader(self, name: str) -> str:
        return self.leaders.get(name, name)

    def release(self) -> None:
        """Drop the references to input tensors (the leaders stay)."""
        self._recent = []
