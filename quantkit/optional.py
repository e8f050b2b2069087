"""Optional dependencies: a feature that needs a package which is not installed says so in one line,
naming the pip extra that brings it (instead of an unexpected ModuleNotFoundError deep inside a run)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from quantkit.errors import InputError


@dataclass(frozen=True)
class OptionalPackage:
    module: str  # what is imported
    package: str  # what pip installs
    extra: str  # quantkit's extra that lists it (pyproject.toml [project.optional-dependencies])


OPTIONAL: dict[str, OptionalPackage] = {
    p.module: p
    for p in (
        OptionalPackage("matplotlib", "matplotlib", "eval"),
        OptionalPackage("lm_eval", "lm-eval", "lm-eval"),
        OptionalPackage("vllm", "vllm", "vllm"),
        OptionalPackage("cuda.bindings", "cuda-bindings", "cuda"),
    )
}


class MissingDependency(InputError):
    """An optional package a requested feature needs is not installed (exit 2)."""


def missing_message(module: str, feature: str) -> str:
    p = OPTIONAL[module]
    return f"{feature} needs {p.package}, which is not installed: pip install 'quantkit-llm[{p.extra}]'"


def require(module: str, feature: str) -> ModuleType:
    """Import optional `module` for `feature`, or raise MissingDependency naming its extra."""
    if module not in OPTIONAL:
        raise KeyError(f"{module} is not a registered optional dependency")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        # Only the package itself (or its parent) missing is "not installed"; a broken dependency inside an
        # installed package is a different problem and keeps its own error.
        top = module.split(".")[0]
        if exc.name is not None and exc.name not in (module, top):
            raise
        raise MissingDependency(missing_message(module, feature)) from None


def available(module: str) -> bool:
    """Whether `module` is installed, without importing it (vLLM takes seconds to import)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package of a dotted name
        return False
