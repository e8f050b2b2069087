"""Method registry: name -> class. `a+b` composes methods in order."""

from __future__ import annotations

from quantkit.errors import InputError
from quantkit.methods.base import LayerContext, Method, QuantizedWeight
from quantkit.methods.rtn import RTN
from quantkit.quant.schemes import Scheme

REGISTRY: dict[str, type[Method]] = {cls.name: cls for cls in (RTN,)}


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
    methods = [REGISTRY[n](scheme, **((options or {}).get(n, {}))) for n in names]
    if not methods[-1].quantizes:
        raise InputError(f"method {names[-1]!r} only transforms weights; follow it with a quantiser, e.g. {names[-1]}+rtn")
    return methods


__all__ = ["LayerContext", "Method", "QuantizedWeight", "REGISTRY", "build_methods", "register"]
