"""Recipes: one dataclass tree describing a run; YAML in and out. CLI flags override recipe fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from quantkit.errors import InputError


@dataclass
class ModelSpec:
    source: str | None = None  # HF folder, .gguf file, hub id; None = the embedded default
    trust_remote_code: bool = False


ESTIMATES = ("pooled", "sequence")  # how the sensitivity pass weighs a linear's choices (pipeline.sensitivity)


@dataclass
class MixedSpec:
    """Mixed precision: one of `schemes` per linear, chosen under a size or an accuracy budget."""

    schemes: list[str] = field(default_factory=list)  # the allowed choices, spelt NAME[:gSIZE|:ch] (W4A16:g64)
    target_bits: float | None = None  # bits per quantised weight, scales included (the manifest's figure)
    max_kl: float | None = None  # estimated KL of the output (nats per token), summed over the linears
    samples: int = 8  # calibration sequences the sensitivity pass reads
    draws: int = 4  # next-token draws per sequence in that pass
    estimate: str = "pooled"  # how that pass weighs a linear's choices: pooled | sequence (pipeline.sensitivity)

    def __post_init__(self) -> None:
        if not self.schemes:
            raise InputError("mixed precision needs --schemes, the choices a linear may take (e.g. "
                             "W4A16:g128,W4A16:g64,W8A16:ch)")
        if (self.target_bits is None) == (self.max_kl is None):
            raise InputError("mixed precision needs exactly one budget: --target-bits B or --max-kl X")
        if self.target_bits is not None and not self.target_bits > 0:
            raise InputError(f"--target-bits must be positive, got {self.target_bits}")
        if self.max_kl is not None and not self.max_kl > 0:
            raise InputError(f"--max-kl must be positive, got {self.max_kl}")
        if self.samples < 1 or self.draws < 1:
            raise InputError("mixed.samples and mixed.draws must be at least 1")
        if self.estimate not in ESTIMATES:
            raise InputError(f"mixed.estimate must be pooled or sequence, got {self.estimate!r}")


@dataclass
class QuantizationSpec:
    method: str = "rtn"
    scheme: str = "W4A16"
    group_size: int = 128  # -1 = per output channel
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    options: dict = field(default_factory=dict)  # per-method options, keyed by method name
    strict: bool = False  # refuse instead of falling back when a layer cannot take the scheme (FP8_BLOCK)
    kv_cache: str | None = None  # fp8 (one scale per layer) | fp8-head (per KV head): a calibrated fp8 KV cache
    mixed: MixedSpec | None = None  # per-linear schemes under a budget (quantkit.pipeline.mixed)

    def __post_init__(self) -> None:
        if isinstance(self.mixed, dict):
            known = {f.name for f in fields(MixedSpec)}
            bad = set(self.mixed) - known
            if bad:
                raise InputError(f"recipe section 'quantization.mixed' has unknown field(s): {', '.join(sorted(bad))}")
            self.mixed = MixedSpec(**self.mixed)


SCHEDULES = ("auto", "one-pass", "two-pass")
EXPERT_TOKENS = ("all", "routed")


@dataclass
class CalibrationSpec:
    dataset: str = "kjv"
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 42
    text_column: str | None = None
    batch_size: int = 0  # 0 = automatic (about 4096 tokens per batch)
    error_samples: int = 8  # samples that measure per-layer error for data-free methods
    # one-pass: a layer's linears calibrate group by group in call order inside one forward per batch (each
    # group's statistics see the earlier groups quantised); two-pass: statistics of all from an unquantised
    # pass, then a quantised pass; auto: one-pass where the paused batches' activations fit in a quarter of the
    # free memory (quantkit.pipeline.grouped; README, "Calibration schedule").
    schedule: str = "auto"
    # MoE experts' statistics: from every calibration token (each expert also runs on the tokens not routed to
    # it; E/k times the expert compute of the statistics pass) or from its routed tokens only. With "routed", an
    # expert routed fewer than min_expert_tokens tokens is starved: methods that need statistics give it RTN.
    # Either way the manifest lists the starved experts.
    expert_tokens: str = "all"
    min_expert_tokens: int = 64

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise InputError(f"calibration.schedule must be {' or '.join(SCHEDULES)}, not {self.schedule!r}")
        if self.expert_tokens not in EXPERT_TOKENS:
            raise InputError(f"calibration.expert_tokens must be {' or '.join(EXPERT_TOKENS)}, "
                             f"not {self.expert_tokens!r}")
        if self.min_expert_tokens < 1:
            raise InputError(f"calibration.min_expert_tokens must be at least 1, not {self.min_expert_tokens}")


@dataclass
class Recipe:
    model: ModelSpec = field(default_factory=ModelSpec)
    quantization: QuantizationSpec = field(default_factory=QuantizationSpec)
    calibration: CalibrationSpec = field(default_factory=CalibrationSpec)
    output: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict) -> "Recipe":
        data = data or {}
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise InputError(f"recipe has unknown section(s): {', '.join(sorted(unknown))}")
        parts = {}
        for f, typ in (("model", ModelSpec), ("quantization", QuantizationSpec), ("calibration", CalibrationSpec)):
            section = data.get(f) or {}
            names = {x.name for x in fields(typ)}
            bad = set(section) - names
            if bad:
                raise InputError(f"recipe section {f!r} has unknown field(s): {', '.join(sorted(bad))}")
            parts[f] = typ(**section)
        return cls(**parts, output=data.get("output"))

    @classmethod
    def load(cls, path: str | Path) -> "Recipe":
        """A recipe file, or a recipe shipped with quantkit by name (`rtn-w4a16`, `recipes/rtn-w4a16.yaml`):
        a wheel install has no `recipes/` folder, so names the README uses resolve to the packaged copy."""
        return cls.from_dict(load_yaml_mapping(path, "recipe"))

    def override(self, section: str, **values) -> None:
        """Set the fields whose value is not None (the CLI flags the user actually gave)."""
        target = getattr(self, section)
        for key, value in values.items():
            if value is not None:
                setattr(target, key, value)


def find_recipe_text(path: str | Path, what: str = "recipe") -> tuple[str, str]:
    """(YAML text, where it came from) for a file, else for a built-in recipe of that name."""
    from quantkit.resources import builtin_file, builtin_names

    path = Path(path)
    if path.is_file():
        return path.read_text(), str(path)
    shipped = None
    if path.parent in (Path("."), Path("recipes")):
        shipped = builtin_file("recipes", path.name, ".yaml")
    if shipped is None:
        names = ", ".join(builtin_names("recipes", ".yaml"))
        raise InputError(f"{what} file {path} does not exist (built-in recipes: {names})")
    return shipped.read_text(), f"built-in {shipped.name}"


def load_yaml_mapping(path: str | Path, what: str = "recipe") -> dict:
    text, where = find_recipe_text(path, what)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InputError(f"{what} {where} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is not None and not isinstance(data, dict):
        raise InputError(f"{what} {where} must be a mapping")
    return data or {}
