"""Method registry: name -> class. `a+b` composes methods in order."""

from __future__ import annotations

from quantkit.errors import InputError
from quantkit.methods.awq import AWQ
from quantkit.methods.base import LayerContext, Method, QuantizedWeight
from quantkit.methods.gptq import GPTQ
from quantkit.methods.fp8 import FP8
from quantkit.methods.rtn import RTN
from quantkit.methods.smoothquant import SmoothQuant
from quantkit.quant.schemes import Scheme

REGISTRY: dict[str, type[Method]] = {cls.name: cls for cls in (RTN, GPTQ, SmoothQuant, FP8, AWQ)}


def register(cls: type[Method]) -> type[Method]:
    REGISTRY[cls.name] = cls
    return cls


def build_methods(spec: str, scheme: Scheme, options: dict | None = None) -> list[Method]:
    """Parse `a+b` into method instances; options are keyed by method name."""
    names = [n.strip().lower() for n in spec.split("+") if n.strip()]
    if not names:
        raise InputError("no method given")
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise InputError(f"unknown method {unknown[0]!r}; valid methods: {', '.join(sorted(REGISTRY))} (compose with +)")
    if not REGISTRY[names[-1]].quantizes:
        names.append("rtn")  # a transform alone (`smoothquant`) is followed by round-to-nearest weights
    check_schemes(names, scheme)
    methods = [REGISTRY[n](scheme, **((options or {}).get(n, {}))) for n in names]
    for m in methods[:-1]:
        if hasattr(m, "transform_only"):
            m.transform_only()  # a later method quantises (awq+gptq: AWQ scales, GPTQ rounds)
    return methods


def check_schemes(names: list[str], scheme: Scheme) -> None:
    """Refuse, before any work, a scheme one of the methods cannot produce, naming methods that can."""
    for n in names:
        allowed = REGISTRY[n].schemes
        if allowed is None or scheme.name in allowed:
            continue
        able = [m for m, cls in sorted(REGISTRY.items()) if cls.quantizes and (cls.schemes is None or scheme.name in cls.schemes)]
        raise InputError(
            f"method {n!r} cannot produce {scheme.name} (it makes {', '.join(allowed)}); "
            f"for {scheme.name} use --method {' or '.join(able) or 'rtn'}"
            + (f", or pick --scheme {allowed[0]} for {n}" if allowed else "")
        )


__all__ = ["LayerContext", "Method", "QuantizedWeight", "REGISTRY", "build_methods", "register"]
