"""The single dispatch point for quantised ops.

Kernels (`quantkit.runtime.kernels.base.Kernel`) register by name per device type with a priority. At load,
`prepare_layer` offers each quantised linear to the kernels of its device in priority order; the first whose
`supports` accepts the format and whose `prepare` succeeds repacks the layer and serves it from then on.
A linear no kernel takes runs the torch reference (`runtime/reference.py`, also the oracle the kernels are
tested against), and the load says so in one warning line. `kernels="reference"`, or QUANTKIT_REFERENCE=1 in
the environment when the model is loaded, sends every linear to the reference. `kernels="cuda-emulated"` (a
developer check, slow) offers CPU-resident linears to the CUDA kernels running on the CPU emulator instead of the
CPU kernels (`runtime/cuda/emulator.py`), exactly as a GPU would be served.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch

from quantkit.errors import InputError
from quantkit.progress import warn_once
from quantkit.runtime import reference
from quantkit.runtime.kernels.base import NotSupported

KERNEL_MODES = ("auto", "reference", "cuda-emulated")
EMULATED = "cuda-emulated"  # the kernel-list key of the emulated CUDA kernels (their tensors are on the CPU)
_KERNELS: dict[str, dict[str, tuple[int, object]]] = defaultdict(dict)  # device type -> name -> (priority, kernel)
_BUILTIN = False


def register_kernel(kernel, device_type: str, priority: int = 100) -> None:
    """Offer `kernel` for linears on `device_type` (cpu, cuda); lower priorities are tried first."""
    _KERNELS[device_type][kernel.name] = (priority, kernel)


def unregister_kernel(name: str, device_type: str) -> None:
    _KERNELS[device_type].pop(name, None)


def kernels_for(device_type: str) -> list:
    global _BUILTIN
    if not _BUILTIN:
        from quantkit.runtime.kernels import register_builtin

        _BUILTIN = True
        register_builtin()
    return [k for _, k in sorted(_KERNELS[device_type].values(), key=lambda pk: pk[0])]


def check_mode(kernels: str) -> str:
    if kernels not in KERNEL_MODES:
        raise InputError(f"unknown kernels {kernels!r}: use {', '.join(KERNEL_MODES[:-1])} or {KERNEL_MODES[-1]}")
    if os.environ.get("QUANTKIT_REFERENCE"):
        return "reference"
    if kernels == EMULATED:
        from quantkit.runtime.cuda.emulator import emulator

        ok, line = emulator().ready()
        if not ok:
            raise InputError(line.replace("; using the reference path", ""))
    return kernels


def describe(fmt) -> str:
    w = fmt.weights
    what = f"{fmt.kind} {fmt.format} {w.strategy}" + (f" {w.group_size}" if w.strategy == "group" else "")
    return what + ("" if w.symmetric else " asym") + (" act-order" if w.actorder else "")


def _key(mode: str, device: torch.device) -> str:
    return EMULATED if mode == EMULATED else device.type


def prepare_layer(layer, mode: str = "auto", prefer: str | None = None) -> tuple[str, str | None]:
    """Attach the first kernel that serves `layer` (see module doc; `prefer` names a kernel to try first: the
    measured choice). Returns (kernel name, why the reference runs it when no kernel took it under mode auto,
    else None)."""
    if check_mode(mode) == "reference":
        return "reference", None
    ref = layer.weight_scale
    device, shape = ref.device, (layer.out_features, layer.in_features)
    if mode == EMULATED and device.type != "cpu":
        raise InputError(f"--kernels {EMULATED} runs on CPU tensors; the model is on {device}")
    refused = []
    kernels = kernels_for(_key(mode, device))
    if prefer is not None:
        kernels = sorted(kernels, key=lambda k: k.name != prefer)  # stable: the rest keep their order
    for kernel in kernels:
        if not kernel.supports(layer.fmt, device, shape, layer.compute_dtype):
            continue
        try:
            prepared = kernel.prepare(layer)
        except (NotSupported, RuntimeError) as exc:  # a torch op refusing this layer, a CUDA source that does not
            # compile: the next kernel may take it
            refused.append(f"{kernel.name}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            continue
        layer.attach(kernel, prepared)
        return kernel.name, None
    return "reference", "; ".join(refused) or f"no {'emulated CUDA' if mode == EMULATED else device.type} kernel"


def _measured_choice(layer, mode: str):
    """The measured kernel choice (`kernels/choice.py`) for this layer's signature, or None where fewer than two
    kernels can serve it. The winner's layout of `layer` is attached to it (it was prepared for the timing)."""
    from quantkit.runtime.kernels import choice

    device, shape = layer.weight_scale.device, (layer.out_features, layer.in_features)
    prepared = []
    for kernel in kernels_for(_key(mode, device)):
        if kernel.supports(layer.fmt, device, shape, layer.compute_dtype):
            try:
                prepared.append((kernel, kernel.prepare(layer)))
            except (NotSupported, RuntimeError):
                continue
    if len(prepared) < 2:
        return None
    signature = f"{describe(layer.fmt)} {shape[0]}x{shape[1]} {str(layer.compute_dtype).replace('torch.', '')}"
    chosen = choice.choose(layer, prepared, signature)
    layer.attach(*next((k, p) for k, p in prepared if k.name == chosen.chosen))
    return chosen


def prepare_model(model: torch.nn.Module, mode: str = "auto", choices: list | None = None) -> dict[str, dict[str, int]]:
    """Prepare every QuantLinear; returns op kind -> kernel name -> number of linears it serves. Where several
    kernels can serve a layer (mode auto on the CPU) the fastest measured one does; each measured choice is
    appended to `choices`."""
    from quantkit.runtime.kernels import choice
    from quantkit.runtime.linear import QuantLinear

    mode = check_mode(mode)
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    fallbacks: dict[str, int] = defaultdict(int)
    measured: dict[tuple, object] = {}
    device = None
    for module in model.modules():
        if not isinstance(module, QuantLinear):
            continue
        device = module.weight_scale.device.type
        prefer = None
        if mode == "auto" and device == "cpu" and choice.mode() == "measure":
            sig = (describe(module.fmt), module.out_features, module.in_features, module.compute_dtype)
            if sig not in measured:
                measured[sig] = _measured_choice(module, mode)
                if measured[sig] is not None and choices is not None:
                    choices.append(measured[sig])
            prefer = measured[sig].chosen if measured[sig] is not None else None
        if module.kernel is not None:  # attached by its signature's measurement
            counts[module.kind][module.kernel.name] += 1
            continue
        name, why = prepare_layer(module, mode, prefer)
        counts[module.kind][name] += 1
        if why is not None:
            fallbacks[f"{describe(module.fmt)} ({why})"] += 1
    if fallbacks:
        what = ", ".join(f"{n} x {d}" for d, n in fallbacks.items())
        where = "emulated CUDA" if mode == EMULATED else device or "cpu"
        warn_once(f"no {where} kernel for {sum(fallbacks.values())} quantised linear(s): {what}; "
                  "they run the torch reference (slower)")
    return {kind: dict(by_kernel) for kind, by_kernel in counts.items()}


def linear(x: torch.Tensor, layer) -> torch.Tensor:
    if layer.kernel is None:
        return reference.linear(x, layer)
    return layer.kernel.run(x, layer.prepared)
