"""Drafters that read the target's features: EAGLE (one decoder layer drafting autoregressively in the target's
feature space) and Medusa-1 (K residual heads on the target's last feature), and the draft sources that run them.

A feature is what the target's output head reads: its decoder's final (normed) hidden state at a position. The head
of a feature at position t scores token t+1.
- EAGLE: position t reads [embedding of token t+1, feature t] (fused by one linear) through one Llama decoder layer
  with its own KV cache and predicts feature t+1; the target's frozen head turns the prediction into token t+2's
  distribution. While drafting, a predicted feature takes the place of the unknown real one. The layout follows
  the `speculators` EAGLE-1 checkpoint (`fusion_fc`, `transformer`, no extra norms).
- Medusa: head k (1..K) maps feature t to r = f + SiLU(W_k f + b_k); the frozen head of r scores token t+k+1.

Both draft over an optional reduced vocabulary (a head of the rows `vocabulary`; verification stays over the whole
vocabulary, so acceptance stays lossless). The decode loop hands a feature-reading draft the target's features of
every committed position (`observe`); `FeatureTap` captures them from the verify steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from quantkit.errors import InputError
from quantkit.runtime.speculative.trees import DraftTree, build_tree

KINDS = ("eagle", "medusa")


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def eagle_layer_config(target_config, intermediate_size: int | None = None):
    """A one-layer Llama config with the target's width, heads and RoPE (the drafter's attention sees the target's
    positions); the MLP as wide as the target's unless given."""
    from transformers import LlamaConfig

    text = text_config(target_config)
    hidden, heads = text.hidden_size, text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or {"rope_type": "default",
                                                       "rope_theta": getattr(text, "rope_theta", 10000.0)}
    if isinstance(rope, dict) and set(rope) >= {"full_attention"}:  # per layer type (gemma3): the global one
        rope = rope["full_attention"]
    cfg = LlamaConfig(
        vocab_size=text.vocab_size, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or hidden // heads,
        intermediate_size=intermediate_size or getattr(text, "intermediate_size", None) or 4 * hidden,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6), hidden_act="silu",
        max_position_embeddings=getattr(text, "max_position_embeddings", 4096), rope_parameters=dict(rope),
        tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return cfg


class DraftKV:
    """The one layer's keys and values (a drafter's cache is small: a concatenating cache is enough)."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys, self.values = torch.cat([self.keys, keys], -2), torch.cat([self.values, values], -2)
        return self.keys, self.values

    def crop(self, keep: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]


class EagleDrafter(nn.Module):
    def __init__(self, layer_config):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        from quantkit.runtime.step import _cache_keyword

        super().__init__()
        self.layer_config = layer_config
        hidden = layer_config.hidden_size
        self.fusion_fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.transformer = LlamaDecoderLayer(layer_config, layer_idx=0)
        self.transformer.input_layernorm = nn.Identity()  # EAGLE-1: the fused input goes straight in
        self.rotary_emb = LlamaRotaryEmbedding(layer_config)
        self._cache_keyword = _cache_keyword(LlamaDecoderLayer.forward)
        std = 0.02
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)

    @property
    def hidden_size(self) -> int:
        return self.layer_config.hidden_size

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: DraftKV | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted features [B, T, H] of positions+1. Without a cache and mask: causal over the T positions;
        with a cache, `mask` [1, 1, T, past + T] (True = may attend) says what each new position sees."""
        h = self.fusion_fc(torch.cat([embeds, features], dim=-1))
        rope = self.rotary_emb(h, positions)
        kwargs = {self._cache_keyword: cache} if cache is not None else {}
        out = self.transformer(h, attention_mask=mask, position_ids=positions, position_embeddings=rope,
                               use_cache=cache is not None, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class MedusaHeads(nn.Module):
    """K residual SiLU blocks; head k's output, scored by the target's head, predicts token t+k+1 from feature t.
    Zero-initialised, so an untrained head k repeats the target's own next-token prediction."""

    def __init__(self, hidden_size: int, heads: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(heads))
        for b in self.blocks:
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)

    @property
    def hidden_size(self) -> int:
        return self.blocks[0].in_features

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[K, ..., H]: every head's output for every feature."""
        return torch.stack([features + F.silu(b(features)) for b in self.blocks])


def draft_distribution(logits: torch.Tensor, temperature: float, vocabulary: torch.Tensor | None,
                       full_vocab: int) -> torch.Tensor:
    """The draft's distribution over the whole vocabulary (zero outside a reduced draft vocabulary)."""
    q = torch.softmax(logits.double() / temperature, dim=-1)
    if vocabulary is None:
        return q
    full = torch.zeros(full_vocab, dtype=q.dtype, device=q.device)
    return full.index_copy_(0, vocabulary.to(q.device), q)


class FeatureTap:
    """The target's features of the positions each of its forwards ran, from a hook on its decoder (whose output is
    what the output head reads). `take()` returns the last forward's [B, T, H] and forgets it."""

    def __init__(self, target):
        from quantkit.runtime.speculative.drafts import _network

        decoder = _decoder(_network(target))
        self._last: torch.Tensor | None = None
        self._handle = decoder.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self._last = output[0] if isinstance(output, (tuple, list)) else output.last_hidden_state

    def take(self) -> torch.Tensor:
        out, self._last = self._last, None
        if out is None:
            raise RuntimeError("the target's decoder produced no features in its last forward")
        return out

    def close(self) -> None:
        self._handle.remove()


def _decoder(net: nn.Module) -> nn.Module:
    decoder = net.get_decoder() if hasattr(net, "get_decoder") else None
    if not isinstance(decoder, nn.Module) or decoder is net:
        raise InputError(f"{type(net).__name__} has no decoder module separate from its head; feature-reading "
                         f"drafts (eagle:, medusa:) need one")
    return decoder


@dataclass
class _Features:
    """The target's features of committed positions 0..len-1, grown as steps verify more text."""

    rows: torch.Tensor | None = None
    length: int = 0

    def write(self, start: int, feats: torch.Tensor) -> None:
        end = start + feats.shape[0]
        if self.rows is None or end > self.rows.shape[0]:
            grown = feats.new_empty(max(end, 2 * (0 if self.rows is None else self.rows.shape[0]), 64),
                                    feats.shape[-1])
            if self.rows is not None:
                grown[: self.length] = self.rows[: self.length]
            self.rows = grown
        self.rows[start:end] = feats
        self.length = end


class _FeatureDraft:
    """What EAGLE and Medusa drafts share: the target's head (or its rows `vocabulary`), the features observed."""

    reads_features = True
    shares_target_cache = False

    def __init__(self, target, module: nn.Module, name: str, vocabulary: torch.Tensor | None = None):
        from quantkit.runtime.speculative.drafts import _network, vocabulary_head

        net = _network(target)
        text = text_config(net.config)
        head = net.get_output_embeddings()
        if module.hidden_size != text.hidden_size:
            raise InputError(f"draft {name}: its hidden size {module.hidden_size} is not the target's "
                             f"{text.hidden_size}; fit it to this target (quantkit draft-heads)")
        self.full_vocab = head.out_features
        if vocabulary is not None and (not len(vocabulary) or int(vocabulary.max()) >= self.full_vocab
                                       or int(vocabulary.min()) < 0):
            raise InputError(f"draft {name}: its vocabulary has ids outside the target's {self.full_vocab}; fit it "
                             f"to this target (quantkit draft-heads)")
        self.name = name
        self.vocabulary = vocabulary
        self.head = vocabulary_head(target, vocabulary) if vocabulary is not None else head
        # The target's compute dtype (a RuntimeModel says it; a transformers model, its parameters').
        dtype = getattr(target, "dtype", None) or next(p for p in net.parameters() if p.is_floating_point()).dtype
        # Parameters only: buffers keep their precision (RoPE's inverse frequencies rounded to bf16 put every
        # position past a few dozen at the wrong angle).
        self.module = module.to(device=net.device).eval()
        for p in self.module.parameters():
            p.data = p.data.to(dtype)
        self.device = net.device
        self.features = _Features()
        self._temperature = 1.0

    @property
    def bytes_per_token(self) -> int:
        from quantkit.runtime.model import resident_bytes

        return resident_bytes(nn.ModuleList([self.module, self.head]))

    def reset(self, target_cache) -> None:
        self.features = _Features()

    def observe(self, start: int, feats: torch.Tensor) -> None:
        """The target's features of positions start .. start + len(feats) - 1 (committed text)."""
        self.features.write(start, feats.to(self.features.rows.dtype if self.features.rows is not None
                                            else feats.dtype))

    def _dist(self, logits: torch.Tensor) -> torch.Tensor:
        return draft_distribution(logits, self._temperature, self.vocabulary, self.full_vocab)

    def root(self) -> torch.Tensor:
        return self._root


class EagleDraft(_FeatureDraft):
    def __init__(self, target, drafter: EagleDrafter, name: str, vocabulary: torch.Tensor | None = None):
        from quantkit.runtime.speculative.drafts import _network

        super().__init__(target, drafter, name, vocabulary)
        self.embed = _network(target).get_input_embeddings()
        self.cache = DraftKV()

    def reset(self, target_cache) -> None:
        super().reset(target_cache)
        self.cache = DraftKV()

    def _run(self, tokens: list[int], feats: torch.Tensor, positions: list[int], mask: torch.Tensor) -> torch.Tensor:
        ids = torch.tensor([tokens], device=self.device)
        pos = torch.tensor([positions], device=self.device)
        return self.module(self.embed(ids), feats[None].to(self.module.fusion_fc.weight.dtype), pos, self.cache,
                           mask)[0]

    def propose(self, context: list[int], spec, temperature: float, generator, rates) -> DraftTree:
        """Drafter position t reads (feature t, token t+1): the committed ones up to len-2 (their features are the
        target's), then the tree's nodes on predicted features."""
        self._temperature = temperature if temperature > 0 else 1.0
        n, fed = len(context), self.cache.length
        if n < 2 or self.features.length < n - 1:
            return DraftTree()  # no feature yet (a one-token prompt): this step verifies the root alone
        count = n - 1 - fed
        past = fed
        mask = torch.ones(1, 1, count, past + count, dtype=torch.bool, device=self.device).tril_(past)
        out = self._run(context[fed + 1 : n], self.features.rows[fed : n - 1], list(range(fed, n - 1)), mask)
        self._root_feature = out[-1]
        self._root = self._dist(self.head(self._root_feature[None])[0])
        self._base, self._n, self._slots, self._out = self.cache.length, n, {}, {}
        tree = build_tree(self, spec, temperature > 0, generator, rates)
        self.cache.crop(n - 1)  # the committed positions' entries are exact; drafted ones are not kept
        return tree

    def expand(self, tree: DraftTree, nodes: list[int]) -> list[torch.Tensor]:
        past = self.cache.length
        feats = torch.stack([self._root_feature if tree.parents[v] < 0 else self._out[tree.parents[v]]
                             for v in nodes])
        mask = torch.zeros(1, 1, len(nodes), past + len(nodes), dtype=torch.bool, device=self.device)
        mask[..., : self._base] = True
        for i, v in enumerate(nodes):
            p = tree.parents[v]
            while p >= 0:
                mask[0, 0, i, self._slots[p]] = True
                p = tree.parents[p]
            mask[0, 0, i, past + i] = True
        out = self._run([tree.tokens[v] for v in nodes], feats, [self._n - 1 + tree.depths[v] for v in nodes], mask)
        for i, v in enumerate(nodes):
            self._slots[v], self._out[v] = past + i, out[i]
        logits = self.head(out)
        return [self._dist(row) for row in logits]


class MedusaDraft(_FeatureDraft):
    def propose(self, context: list[int], spec, temperature: float, generator, rates) -> DraftTree:
        """Head k of the last committed feature (position len-2, whose own head gave the last token) scores token
        len-1+k; a node at depth d takes head d+1's distribution, whatever its ancestors (Medusa-1)."""
        from dataclasses import replace

        self._temperature = temperature if temperature > 0 else 1.0
        n = len(context)
        if n < 2 or self.features.length < n - 1:
            return DraftTree()
        feature = self.features.rows[n - 2].to(self.module.blocks[0].weight.dtype)
        logits = self.head(self.module(feature[None])[:, 0])
        self._heads = [self._dist(row) for row in logits]
        self._root = self._heads[0]
        depth = min(spec.depth, len(self._heads))
        return build_tree(self, replace(spec, depth=depth), temperature > 0, generator, rates)

    def expand(self, tree: DraftTree, nodes: list[int]) -> list[torch.Tensor]:
        return [self._heads[tree.depths[v] + 1] for v in nodes]


def load_draft(spec: str, target) -> _FeatureDraft:
    """`eagle:DIR` / `medusa:DIR` as a draft source for `target`; a drafter fitted to another model (hidden size,
    vocabulary) is refused in one line."""
    from pathlib import Path

    from quantkit.formats import drafter as fmt
    from quantkit.runtime.speculative.drafts import _network

    kind, _, folder = spec.partition(":")
    if kind not in KINDS or not folder:
        raise InputError(f"--speculative {spec!r}: use eagle:DIR or medusa:DIR (a quantkit draft-heads folder)")
    config, tensors = fmt.read(Path(folder), kind)
    vocabulary = tensors.pop(fmt.VOCAB_KEY, None)
    meta = config["quantkit"]
    target_vocab = _network(target).get_output_embeddings().out_features
    if meta.get("vocab_size") != target_vocab:
        raise InputError(f"draft {spec}: fitted to a vocabulary of {meta.get('vocab_size')} tokens, the target has "
                         f"{target_vocab}; fit it to this target (quantkit draft-heads)")
    try:
        if kind == "eagle":
            from transformers import LlamaConfig

            layer_config = LlamaConfig(**config["transformer_layer_config"])
            layer_config._attn_implementation = "sdpa"
            module: nn.Module = EagleDrafter(layer_config)
        else:
            module = MedusaHeads(int(config["hidden_size"]), int(config["num_heads"]))
        module.load_state_dict(tensors, strict=True)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        why = str(exc).strip().splitlines()[0][:160]
        raise InputError(f"draft {spec}: its weights do not fit a {kind} drafter ({why})") from None
    cls = EagleDraft if kind == "eagle" else MedusaDraft
    return cls(target, module, spec, vocabulary)
