"""Draft sources: another model (any checkpoint with the target's tokenizer), the target itself with quantised
activations (QSPEC: `self:W4A8`, `self:W4A4`), the target's first N decoder layers (`self:skip:N`, an early exit:
its final norm and head read layer N's output), and prompt lookup (`ngram`).

Every source answers `propose(context, spec, temperature, generator, rates) -> DraftTree`. Model drafts grow
the tree with their own forward passes over a KV cache: a separate draft keeps the committed text in its own
cache; the self drafts write into the target's cache and crop it back, so the verify pass rewrites the drafted
positions at full precision: one copy of the weights, one cache. The early exit's layers below N compute exactly
what the target's do, so the target's cached keys and values of the committed text are its own.
Drafters that read the target's features (EAGLE, Medusa) are in `heads.py`.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Protocol

import torch
from torch import nn

from quantkit.runtime.speculative.heads import draft_distribution
from quantkit.runtime.speculative.trees import AcceptanceRates, DraftTree, TreeSpec, build_tree
from quantkit.runtime.step import KVCache, step

NGRAM_MAX = 3  # longest suffix matched by prompt lookup (vLLM and llama.cpp use 1..3/4 too)


class DraftSource(Protocol):
    name: str
    shares_target_cache: bool

    def reset(self, target_cache: KVCache) -> None: ...

    def propose(self, context: list[int], spec: TreeSpec, temperature: float, generator: torch.Generator | None,
                rates: AcceptanceRates) -> DraftTree: ...


def _network(model) -> nn.Module:
    from quantkit.runtime.model import RuntimeModel

    return model.model if isinstance(model, RuntimeModel) else model


def _decoder_layers(net: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """(parent, attribute, list) of the decoder's layers, where the architecture's adapter (the layout the pipeline
    and the runtime read) puts them."""
    from quantkit.errors import InputError
    from quantkit.models.loader import _get
    from quantkit.runtime.model import _generic_adapter

    path = _generic_adapter(getattr(net.config, "model_type", "?"), net).layers_path
    parent_path, _, attr = path.rpartition(".")
    try:
        parent = _get(net, parent_path) if parent_path else net
        layers = getattr(parent, attr)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList):
        raise InputError(f"self:skip: {type(net).__name__} has no decoder layers at {path}")
    return parent, attr, layers


@contextmanager
def early_exit(model, layers: int):
    """Only the first `layers` decoder layers run (the list is shortened for the duration); the final norm and
    the head then read layer `layers`'s output. Cache slots of the later layers are left as they were."""
    parent, attr, full = _decoder_layers(_network(model))
    setattr(parent, attr, full[:layers])
    try:
        yield
    finally:
        setattr(parent, attr, full)


@contextmanager
def quantized_activations(model, bits: int, integer: bool = True):
    """Every linear inside the decoder layers sees its input quantised per token to `bits`-bit symmetric integers
    (absmax scale, as the consumers' dynamic per-token activation quantisation does); the weights and the cache are
    untouched. The LM head keeps full-precision inputs (QSPEC quantises the decoder's linears).

    With `integer` and 8 bits, a linear whose kernel takes int8 codes (`run_int8_tokens`: the integer-dot kernels
    of 4- and 8-bit weights) computes on the codes, as an engine with int8 activations does; the others, and
    `integer=False`, fake-quantise the input (quantise, dequantise) in front of their usual kernel. Yields how many
    linears compute on int8 codes."""
    from quantkit.quant.args import QuantArgs
    from quantkit.runtime.linear import QuantLinear
    from quantkit.runtime.reference import quantize_activation

    args = QuantArgs(num_bits=bits, strategy="token", dynamic=True)
    net = _network(model)
    head = net.get_output_embeddings()

    def hook(module, inputs):
        return (quantize_activation(inputs[0], args),) + tuple(inputs[1:])

    def on_codes(module, run, fallback):
        def forward(x):
            y = run(x, module.prepared, args)
            return fallback(quantize_activation(x, args)) if y is None else y
        return forward

    handles, patched = [], []
    for m in net.modules():
        if m is head or not (isinstance(m, nn.Linear) or type(m).__name__ == "QuantLinear"):
            continue
        run = getattr(m.kernel, "run_int8_tokens", None) if isinstance(m, QuantLinear) else None
        if integer and bits == 8 and run is not None:
            m.forward = on_codes(m, run, m.forward)  # an instance attribute, deleted on the way out
            patched.append(m)
        else:
            handles.append(m.register_forward_pre_hook(hook))
    try:
        yield len(patched)
    finally:
        for h in handles:
            h.remove()
        for m in patched:
            del m.forward


def vocabulary_head(model, ids: torch.Tensor) -> nn.Linear:
    """The model's output head restricted to the rows `ids`: a dense linear (a quantised head is dequantised, in row
    blocks, to the dtype of its scales)."""
    from quantkit.runtime.linear import DenseLinear, QuantLinear

    head = _network(model).get_output_embeddings()
    ids = ids.to(torch.long)
    if isinstance(head, QuantLinear):
        from quantkit.runtime.reference import dequantize_weight

        parts, step = [], 8192
        for r0 in range(0, head.out_features, step):
            r1 = min(r0 + step, head.out_features)
            inside = ids[(ids >= r0) & (ids < r1)]
            if len(inside):
                parts.append((inside, dequantize_weight(head, rows=(r0, r1))[inside - r0]))
        order = torch.argsort(torch.cat([p[0] for p in parts]))
        weight = torch.cat([p[1] for p in parts])[order]
        dtype = head.weight_scale.dtype
    else:
        weight, dtype = head.weight.detach()[ids], head.weight.dtype
    bias = getattr(head, "bias", None)
    small = DenseLinear(weight.shape[1], len(ids), bias=bias is not None, device=weight.device, dtype=dtype)
    with torch.no_grad():
        small.weight.copy_(weight)
        if bias is not None:
            small.bias.copy_(bias.detach()[ids])
    small.requires_grad_(False)
    return small


def weight_bytes_per_token(model, exit_layers: int | None = None, head: nn.Module | None = None) -> int | None:
    """Weight bytes one batch-1 step reads: the decoder layers it runs and the output head (`head` where a draft
    swaps its own in). The embedding table is read one row per token and norms are a few KB, so neither counts;
    tied embeddings count once, as the head. A MoE layer counts every expert (an upper bound: a step reads the routed
    ones). None where the decoder's layer list cannot be found."""
    from quantkit.errors import InputError
    from quantkit.runtime.model import resident_bytes

    net = _network(model)
    try:
        _, _, layers = _decoder_layers(net)
    except InputError:
        return None
    run = list(layers) if exit_layers is None else list(layers[:exit_layers])
    return resident_bytes(nn.ModuleList([*run, head if head is not None else net.get_output_embeddings()]))


@contextmanager
def output_head(model, head: nn.Module):
    """`head` in place of the model's output head for the duration."""
    net = _network(model)
    full = net.get_output_embeddings()
    net.set_output_embeddings(head)
    try:
        yield
    finally:
        net.set_output_embeddings(full)


class ModelDraft:
    """A draft model: `model` with its own cache, or the target itself on the target's cache (`shares_target_cache`):
    with quantised activations (QSPEC, `activation_bits`) or through its first `exit_layers` decoder layers.

    `restrict_vocabulary(ids)` makes the draft score only those tokens (a head of len(ids) rows instead of the whole
    vocabulary, which on small models is most of what a draft step reads); its distribution is zero elsewhere, and
    verification still runs over the target's whole vocabulary, so acceptance stays lossless."""

    def __init__(self, model, name: str, activation_bits: int | None = None, exit_layers: int | None = None):
        self.model = model
        self.name = name
        self.activation_bits = activation_bits
        self.exit_layers = exit_layers
        self.shares_target_cache = activation_bits is not None or exit_layers is not None
        self.cache = KVCache()
        self._temperature = 1.0
        self.vocabulary: torch.Tensor | None = None
        self._head: nn.Module | None = None
        self._full_vocab = 0
        self.integer_activations = True  # QSPEC on int8 codes where the kernels take them (quantized_activations)
        self.int8_linears: int | None = None  # how many of them did, in the last draft pass (QSPEC W4A8 only)

    def restrict_vocabulary(self, ids: torch.Tensor) -> None:
        head = _network(self.model).get_output_embeddings()
        self._full_vocab = head.out_features
        self.vocabulary = torch.unique(ids.to(torch.long))
        if not len(self.vocabulary) or int(self.vocabulary.min()) < 0 or int(self.vocabulary.max()) >= self._full_vocab:
            raise ValueError(f"a draft vocabulary is a non-empty set of ids in [0, {self._full_vocab})")
        self._head = vocabulary_head(self.model, self.vocabulary)

    def reset(self, target_cache: KVCache) -> None:
        self.cache = target_cache if self.shares_target_cache else KVCache()

    @property
    def bytes_per_token(self) -> int | None:
        """Weight bytes one draft step reads (QSPEC reads the target's own: its activations change, not its bytes)."""
        return weight_bytes_per_token(self.model, self.exit_layers, self._head)

    def _mode(self):
        stack = ExitStack()
        if self.exit_layers is not None:
            stack.enter_context(early_exit(self.model, self.exit_layers))
        elif self.activation_bits is not None:
            self.int8_linears = stack.enter_context(
                quantized_activations(self.model, self.activation_bits, self.integer_activations))
        if self._head is not None:
            stack.enter_context(output_head(self.model, self._head))
        return stack

    def _dist(self, logits: torch.Tensor) -> torch.Tensor:
        return draft_distribution(logits, self._temperature, self.vocabulary, self._full_vocab)

    def propose(self, context: list[int], spec: TreeSpec, temperature: float, generator, rates) -> DraftTree:
        self._temperature = temperature if temperature > 0 else 1.0
        sample = temperature > 0
        entry = self.cache.length
        device = _network(self.model).device
        with self._mode():
            new = torch.tensor([context[entry:]], device=device)
            positions = torch.arange(entry, len(context), device=device)[None]
            self._root = self._dist(step(self.model, new, positions, self.cache, logits_to_keep=1)[0, -1])
            self._base, self._slots, self._len = self.cache.length, {}, len(context)
            tree = build_tree(self, spec, sample, generator, rates)
        # A separate draft keeps the committed text; the QSPEC draft gives the target its cache back as it was.
        self.cache.crop(entry if self.shares_target_cache else len(context))
        return tree

    def root(self) -> torch.Tensor:
        return self._root

    def expand(self, tree: DraftTree, nodes: list[int]) -> list[torch.Tensor]:
        """Feed `nodes` (whose ancestors were fed by earlier expansions) and return the draft after each."""
        device = _network(self.model).device
        past = self.cache.length
        tokens = torch.tensor([[tree.tokens[n] for n in nodes]], device=device)
        positions = torch.tensor([[self._len + tree.depths[n] for n in nodes]], device=device)
        chain = len(nodes) == 1 and self._ancestor_slots(tree, nodes[0]) == list(range(self._base, past))
        mask = None
        if not chain:  # each node sees the committed text, its ancestors' slots and itself
            mask = torch.zeros(1, 1, len(nodes), past + len(nodes), dtype=torch.bool, device=device)
            mask[..., : self._base] = True
            for i, n in enumerate(nodes):
                mask[0, 0, i, self._ancestor_slots(tree, n)] = True
                mask[0, 0, i, past + i] = True
        logits = step(self.model, tokens, positions, self.cache, mask)[0]
        for i, n in enumerate(nodes):
            self._slots[n] = past + i
        return [self._dist(row) for row in logits]

    def _ancestor_slots(self, tree: DraftTree, node: int) -> list[int]:
        slots, p = [], tree.parents[node]
        while p >= 0:
            slots.append(self._slots[p])
            p = tree.parents[p]
        return sorted(slots)


SELF_DRAFT_BITS = {"W4A8": 8, "W4A4": 4, "A8": 8, "A4": 4}  # self:SCHEME -> activation bits of the draft pass


SELF_DRAFTS = "self:W4A8, self:W4A4 or self:skip:N (the first N decoder layers)"


def skip_layers(scheme: str, num_layers: int | None = None) -> int | None:
    """N of `skip:N` (None for another scheme); InputError unless 1 <= N < num_layers (when known)."""
    from quantkit.errors import InputError

    kind, _, n = scheme.partition(":")
    if kind.lower() != "skip":
        return None
    if not n.isdigit() or int(n) < 1:
        raise InputError(f"self:skip:N needs a positive number of layers, got self:{scheme}")
    if num_layers is not None and int(n) >= num_layers:
        raise InputError(f"self:{scheme}: the target has {num_layers} decoder layers; the draft must use fewer")
    return int(n)


def self_draft(model, scheme: str) -> ModelDraft:
    """QSPEC: `W4A8` / `W4A4` (the target's own weights, activations per token at 8 / 4 bits in the draft pass);
    `skip:N`: the target's first N decoder layers, then its final norm and head."""
    from quantkit.errors import InputError

    net = _network(model)
    config = net.config.get_text_config() if hasattr(net.config, "get_text_config") else net.config
    layers = skip_layers(scheme, getattr(config, "num_hidden_layers", None))
    if layers is not None:
        _decoder_layers(net)  # a model whose layer list cannot be found is refused here, not mid-decode
        return ModelDraft(model, f"self:skip:{layers}", exit_layers=layers)
    bits = SELF_DRAFT_BITS.get(scheme.upper())
    if bits is None:
        raise InputError(f"unknown self-draft scheme {scheme!r}; use {SELF_DRAFTS}")
    return ModelDraft(model, f"self:{scheme.upper()}", activation_bits=bits)


class NgramDraft:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last n tokens
    (n = 3, then 2, then 1). A static tree takes up to W distinct continuations, the latest first."""

    name = "ngram"
    shares_target_cache = False
    bytes_per_token = 0  # no weights

    def reset(self, target_cache: KVCache) -> None:
        pass

    def propose(self, context: list[int], spec: TreeSpec, temperature: float, generator, rates) -> DraftTree:
        width = spec.width if spec.kind == "static" else 1
        found: list[list[int]] = []
        firsts: set[int] = set()
        for n in range(min(NGRAM_MAX, len(context) - 1), 0, -1):
            suffix = context[-n:]
            for j in range(len(context) - n - 1, -1, -1):
                if context[j : j + n] == suffix:
                    cont = context[j + n : j + n + spec.depth]
                    if cont and cont[0] not in firsts:
                        found.append(cont)
                        firsts.add(cont[0])
                        if len(found) == width:
                            break
            if len(found) == width:
                break
        tree = DraftTree()
        for rank, cont in enumerate(found):
            parent = -1
            for tok in cont:
                parent = tree.add(tok, parent, None, rank if parent < 0 else 0)
        return tree
