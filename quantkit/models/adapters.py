"""Per-architecture facts, as data: where the decoder layers are, how checkpoint names map to modules,
MoE expert layout and routing, which linears must never be quantised, and which norm or linear feeds which
linears (used by AWQ and SmoothQuant to fold scales)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from quantkit.errors import InputError


@dataclass(frozen=True)
class ExpertLayout:
    """Routed experts stored fused in transformers 5 ([E, 2I, H] gate_up, [E, H, I] down) but per expert on disk."""

    module: str  # path of the fused experts module inside a decoder layer
    gate: str  # per-expert projection names in the checkpoint
    up: str
    down: str


@dataclass(frozen=True)
class RouterLayout:
    """How a family's sparse-MoE block routes, as far as it is fixed by the architecture.

    The numbers (expert count, top-k, groups, scaling, whether top-k weights are normalised where the
    family reads it from the config) come from the model config: `quantkit.models.moe.router_spec`.
    Module names are relative to `block`; shared experts exist only where `shared_size_key` is a non-zero
    config value (Qwen2-MoE and Qwen3-MoE share one adapter, only Qwen2-MoE has a shared expert).
    """

    block: str = "mlp"  # the sparse-MoE block inside a decoder layer (dense layers have no `router` there)
    router: str = "gate"  # the router linear (weight [E, H]), kept unquantised
    experts: str = "experts"
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    softmax_before_topk: bool = True  # softmax over all experts, then top-k (else top-k logits, then softmax)
    normalize: bool | None = None  # renormalise the top-k weights; None: the config's norm_topk_prob
    selection_bias: str | None = None  # router buffer added to the scores for selection only (not the weights)
    fp32_logits: bool = False  # router matmul upcast to fp32 (else in the model dtype, scores in fp32)
    weights_in_model_dtype: bool = False  # combine weights rounded to the model dtype before the experts
    shared_experts: str | None = None  # always-on expert MLP added to the routed output
    shared_size_key: str | None = None  # config value that sizes the shared experts (0 or absent: none)
    shared_expert_gate: str | None = None  # linear [1, H]: sigmoid(gate(x)) scales the shared output


@dataclass(frozen=True)
class Smoothing:
    """`source` (a norm, or a linear whose output feeds the targets) scales the input of `targets`."""

    source: str
    targets: tuple[str, ...]
    kind: str = "norm"  # "norm" | "gemma_norm" (weight is 1 + w) | "linear"


@dataclass(frozen=True)
class Adapter:
    name: str
    model_types: tuple[str, ...]
    layers_path: str = "model.layers"
    # checkpoint substring -> module substring (inside a layer), e.g. Mixtral's block_sparse_moe -> mlp
    renames: tuple[tuple[str, str], ...] = ()
    experts: ExpertLayout | None = None
    router: RouterLayout | None = None
    never_quantize: tuple[str, ...] = ()  # regexes on layer-local module names
    smoothing: tuple[Smoothing, ...] = ()
    attention: str = "gqa"  # "gqa" | "mla"
    notes: str = ""
    # Where the layers are stored when transformers renames them on load (Gemma 3's checkpoints keep
    # language_model.model.layers for its model.language_model.layers); empty: as in the model.
    stored_layers_path: str = ""

    @property
    def checkpoint_layers_path(self) -> str:
        return self.stored_layers_path or self.layers_path

    def to_checkpoint(self, local: str) -> str:
        """Layer-local module name -> layer-local checkpoint name (renames are prefixes; one ending in a dot also
        renames the module it names)."""
        for ckpt, mod in self.renames:
            swapped = _swap_prefix(local, mod, ckpt)
            if swapped is not None:
                return swapped
        return local

    def to_module(self, local: str) -> str:
        for ckpt, mod in self.renames:
            swapped = _swap_prefix(local, ckpt, mod)
            if swapped is not None:
                return swapped
        return local

    def is_protected(self, local_name: str) -> bool:
        return any(re.fullmatch(p, local_name) for p in self.never_quantize)


def _swap_prefix(name: str, old: str, new: str) -> str | None:
    if name.startswith(old):
        return new + name[len(old):]
    if old.endswith(".") and name == old[:-1]:
        return new[:-1]
    return None


_ATTN = Smoothing("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
_VO = Smoothing("self_attn.v_proj", ("self_attn.o_proj",), kind="linear")
_MLP = (
    Smoothing("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    Smoothing("mlp.up_proj", ("mlp.down_proj",), kind="linear"),
)
_DENSE = (_ATTN, _VO, *_MLP)
_GEMMA = (
    Smoothing("input_layernorm", _ATTN.targets, kind="gemma_norm"),
    _VO,
    Smoothing("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), kind="gemma_norm"),
    Smoothing("mlp.up_proj", ("mlp.down_proj",), kind="linear"),
)
_GEMMA2 = (
    Smoothing("input_layernorm", _ATTN.targets, kind="gemma_norm"),
    _VO,
    Smoothing("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), kind="gemma_norm"),
    Smoothing("mlp.up_proj", ("mlp.down_proj",), kind="linear"),
)
_QWEN_MOE_EXPERTS = ExpertLayout("mlp.experts", "gate_proj", "up_proj", "down_proj")
_ROUTERS = (r"mlp\.gate", r"mlp\.shared_expert_gate")
_MOE_ATTN = (_ATTN, _VO)
# MoE: the norm feeds the router and every expert (module names of the unfused layer, `*` = expert index);
# router columns are scaled with the experts' so routing is unchanged. Names a layer lacks are skipped.
_EXPERTS = "mlp.experts.experts.*."


def _moe_mlp(gate: str, up: str, down: str, shared: tuple[str, ...] = ()) -> tuple[Smoothing, ...]:
    return (
        Smoothing("post_attention_layernorm", ("mlp.gate", _EXPERTS + gate, _EXPERTS + up, *shared)),
        Smoothing(_EXPERTS + up, (_EXPERTS + down,), kind="linear"),
    )


_MLA = (
    Smoothing("input_layernorm", ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
    Smoothing("self_attn.q_a_layernorm", ("self_attn.q_b_proj",)),
    Smoothing("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",)),
)

ADAPTERS: tuple[Adapter, ...] = (
    Adapter("llama", ("llama",), smoothing=_DENSE),
    Adapter("mistral", ("mistral",), smoothing=_DENSE),
    Adapter("qwen2", ("qwen2",), smoothing=_DENSE),
    Adapter("qwen3", ("qwen3",), smoothing=_DENSE),
    Adapter("gemma", ("gemma",), smoothing=_GEMMA),
    Adapter("gemma2", ("gemma2", "gemma3_text"), smoothing=_GEMMA2),
    Adapter(
        "mixtral",
        ("mixtral",),
        renames=(("block_sparse_moe.", "mlp."),),
        experts=ExpertLayout("mlp.experts", "w1", "w3", "w2"),
        # transformers' Mixtral: softmax over all experts, top-k, always renormalised (no config switch).
        router=RouterLayout(normalize=True),
        never_quantize=(r"mlp\.gate",),
        smoothing=(*_MOE_ATTN, *_moe_mlp("w1", "w3", "w2")),
    ),
    Adapter(
        "qwen2_moe",
        ("qwen2_moe", "qwen3_moe"),
        experts=_QWEN_MOE_EXPERTS,
        router=RouterLayout(weights_in_model_dtype=True, shared_experts="shared_expert",
                            shared_size_key="shared_expert_intermediate_size", shared_expert_gate="shared_expert_gate"),
        never_quantize=_ROUTERS,
        smoothing=(
            *_MOE_ATTN,
            *_moe_mlp("gate_proj", "up_proj", "down_proj",
                      ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert_gate")),
            Smoothing("mlp.shared_expert.up_proj", ("mlp.shared_expert.down_proj",), kind="linear"),
        ),
    ),
    Adapter(
        "deepseek_v3",
        ("deepseek_v3",),
        experts=_QWEN_MOE_EXPERTS,
        # Sigmoid scores, group-limited top-k on scores + e_score_correction_bias, weights from the plain
        # scores, normalised per config, times routed_scaling_factor; the router runs in fp32.
        router=RouterLayout(scoring="sigmoid", selection_bias="e_score_correction_bias", fp32_logits=True,
                            shared_experts="shared_experts", shared_size_key="n_shared_experts"),
        never_quantize=(r"mlp\.gate",),
        smoothing=(
            *_MLA,
            *_MLP,  # first_k_dense_replace layers
            *_moe_mlp("gate_proj", "up_proj", "down_proj", ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")),
            Smoothing("mlp.shared_experts.up_proj", ("mlp.shared_experts.down_proj",), kind="linear"),
        ),
        attention="mla",
        notes="first_k_dense_replace layers use a dense MLP; routed experts elsewhere",
    ),
)

_BY_TYPE = {t: a for a in ADAPTERS for t in a.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_TYPE)


def described_moe_types() -> list[str]:
    """The MoE families whose routing is described here (quantkit's runtime routes them itself)."""
    return [t for t in supported_model_types() if _BY_TYPE[t].router is not None]



def adapter_for(model_type: str) -> Adapter:
    adapter = _BY_TYPE.get(model_type)
    if adapter is None:
        raise InputError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    return adapter


GENERIC = "generic"  # Adapter.notes of an adapter inferred from the model (adapter_for_model)


def find_layers_path(config, model) -> str:
    """Where `model` keeps its decoder layers: the shallowest module list with num_hidden_layers entries."""
    from torch import nn

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    count = getattr(text, "num_hidden_layers", None)
    lists = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == count and name]
    if count is None or not lists:
        raise InputError(f"unsupported architecture {getattr(config, 'model_type', '?')!r}: no list of its {count} "
                         f"decoder layers found; supported: {', '.join(supported_model_types())} and dense models "
                         "transformers builds")
    # A multimodal model's vision or audio tower may have as many layers: the text decoder's list is wanted.
    towers = ("vision", "visual", "audio", "image", "patch")
    return min(lists, key=lambda n: (any(t in n for t in towers), n.count(".")))


def adapter_for_model(config, model, names=None, renamed: dict[str, str] | None = None) -> Adapter:
    """The registered adapter of the config's model type; for any other model transformers builds, one inferred
    from `model` (a meta skeleton will do): its decoder layers are the one module list with num_hidden_layers
    entries, checkpoint names map one to one or by transformers' own renamings (`renamed`, module tensor name ->
    stored name), and no scale-folding mappings are fixed (AWQ derives checked ones, SmoothQuant refuses).
    A sparse-MoE model is inferred too where its experts are transformers' standard fused experts, stored one
    linear per expert on disk (`names`, the checkpoint's tensor names): its own router then routes, in the
    pipeline and in the runtime alike; anything else is refused in one line."""
    from torch import nn

    model_type = getattr(config, "model_type", "?")
    if model_type in _BY_TYPE:
        return _BY_TYPE[model_type]
    layers_path = find_layers_path(config, model)
    layers = model.get_submodule(layers_path)
    # Routed experts: a module named `experts` or stacked expert weights (3-D; a Mamba mixer's conv is not), in any
    # layer (hybrid models mix MoE, dense, attention and Mamba layers). Not an expert count in the config: Doge's
    # has one while its layers are dense, and a tiny Flint's layers may all be dense.
    found: dict[str, nn.Module] = {}
    for layer in layers:
        for name, m in layer.named_modules():
            stacked = not isinstance(m, nn.modules.conv._ConvNd) and any(p.dim() == 3 for p in m.parameters(False))
            if name.rpartition(".")[2] == "experts" or stacked:
                found.setdefault(name, m)
    moe = bool(found)
    stored = _stored_local_names(layers_path, names or (), renamed or {})
    renames = _infer_renames(stored)
    if not moe:
        return Adapter(model_type, (model_type,), layers_path=layers_path, renames=renames, notes=GENERIC)
    described = ", ".join(described_moe_types())
    what = f" ({type(next(iter(found.values()))).__name__} in its layers)"
    fused = [(name, m) for name, m in found.items() if is_standard_experts(m)]
    if not fused:
        raise InputError(f"unsupported MoE architecture {model_type!r}{what}: its experts are not transformers' "
                         f"standard gate/up/down experts (biases, transposed or interleaved weights, or a gate of "
                         f"their own), and its routing is not described here; supported MoE: {described} and MoE "
                         "models with standard experts")
    module = fused[0][0]
    layout = _stored_expert_layout(module, stored, model_type)
    owner = next(layer for layer in layers if any(m is fused[0][1] for m in layer.modules()))
    routers = router_names(owner, module, fused[0][1].gate_up_proj.shape[0])
    return Adapter(model_type, (model_type,), layers_path=layers_path, renames=renames, experts=layout,
                   never_quantize=tuple(re.escape(r) for r in routers), notes=GENERIC)


def is_standard_experts(module) -> bool:
    """transformers' fused experts in the layout `quantkit.models.experts.UnfusedExperts` computes exactly:
    gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I], no biases, act(gate) * up."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not all(getattr(t, "dim", lambda: 0)() == 3 for t in (gate_up, down)) or not hasattr(module, "act_fn"):
        return False
    if {n for n, _ in module.named_parameters(recurse=False)} != {"gate_up_proj", "down_proj"}:
        return False
    e, two_i, h = gate_up.shape
    if tuple(down.shape) != (e, h, two_i // 2) or two_i % 2:
        return False
    # transformers' experts decorator records the layout on each instance; a class of its own gate overrides it.
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
             "has_post_expert_norm": False}
    if any(getattr(module, k, v) != v for k, v in flags.items()):
        return False
    apply_gate = getattr(type(module), "_apply_gate", None)
    return apply_gate is None or apply_gate.__name__ == "_default_apply_gate"


def _stored_local_names(layers_path: str, names, renamed: dict[str, str]) -> dict[str, str]:
    """Layer-local module name -> layer-local stored name, over every layer (hybrid models mix layer kinds);
    `renamed`: full module name -> full stored name, where transformers renames on load."""
    to_module = {stored: module for module, stored in renamed.items()}
    root = layers_path + "."
    out = {}
    for name in names:
        module = to_module.get(name, name)
        index, _, local = module[len(root):].partition(".") if module.startswith(root) else ("", "", "")
        if not index.isdigit() or local in out:
            continue
        split = split_stored_layer_name(name, int(index))
        out[local] = split[1] if split else local
    return out


def split_stored_layer_name(name: str, i: int) -> tuple[str, str] | None:
    """(stored layers path, layer-local name) of a stored tensor name of layer i. The stored list may have
    another name than the module list (EXAONE 3 stores model.layers as transformer.h, Gemma 3 under
    language_model.): the layer's names follow its index, the first part equal to it after a named part."""
    parts = name.split(".")
    at = next((j for j in range(1, len(parts) - 1) if parts[j] == str(i) and not parts[j - 1].isdigit()), None)
    return None if at is None else (".".join(parts[:at]), ".".join(parts[at + 1:]))


def _infer_renames(stored: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """Prefix renames (stored, module) that map every layer-local module name to its stored name. For each renamed
    tensor, the shortest differing prefix that holds for every name under it (Mixtral-style `block_sparse_moe.` ->
    `mlp.`), else a longer one, down to the tensor itself."""
    renames: list[tuple[str, str]] = []

    def holds(s_pre: str, m_pre: str) -> bool:
        return all(s == s_pre + m[len(m_pre):] for m, s in stored.items() if m == m_pre or m.startswith(m_pre + "."))

    for m, s in sorted((m, s) for m, s in stored.items() if m != s):
        if any(_swap_prefix(m, mod, ckpt) == s for ckpt, mod in renames):
            continue
        mp, sp = m.split("."), s.split(".")
        k = 0
        while k < min(len(mp), len(sp)) - 1 and mp[-1 - k] == sp[-1 - k]:
            k += 1
        pair = next(((".".join(sp[: len(sp) - j]), ".".join(mp[: len(mp) - j])) for j in range(k, 0, -1)
                     if holds(".".join(sp[: len(sp) - j]), ".".join(mp[: len(mp) - j]))), None)
        renames.append((pair[0] + ".", pair[1] + ".") if pair else (s, m))
    return tuple(renames)


def _stored_expert_layout(module: str, stored: dict[str, str], model_type: str) -> ExpertLayout:
    """The per-expert projection names under the experts module `module`, read off the layer's stored names."""
    pattern = re.compile(re.escape(module) + r"\.(\d+)\.([A-Za-z0-9_]+)\.weight\w*")  # quantised: weight_packed
    projections = {m.group(2) for name in stored if (m := pattern.fullmatch(name))}
    for gate, up, down in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        if {gate, up, down} <= projections:
            return ExpertLayout(module, gate, up, down)
    if any(name.startswith(module + ".gate_up_proj") for name in stored):
        what = "its experts are stored fused on disk"
    else:
        what = f"its expert projections on disk ({', '.join(sorted(projections)) or 'none found'})"
    raise InputError(f"unsupported MoE architecture {model_type!r}: {what}, not one gate/up/down linear per "
                     "expert (gate_proj/up_proj/down_proj or w1/w3/w2)")


def router_names(layer, experts: str, num_experts: int) -> list[str]:
    """Layer-local names of the routers beside `experts` (kept unquantised, listed in the ignore): modules of the
    MoE block outside the experts whose own weight is [num_experts, hidden] or [1, hidden] (a shared-expert gate)."""
    import torch

    block = experts.rpartition(".")[0]
    found = []
    for name, m in (layer.get_submodule(block) if block else layer).named_modules():
        full = f"{block}.{name}" if block and name else (name or block)
        if not name or full == experts or full.startswith(experts + "."):
            continue
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] in (num_experts, 1):
            found.append(full)
    return found
