"""Speculative decoding: greedy output equals the target's own greedy output for every draft kind and tree shape,
sampling keeps the target's distribution (exact enumeration of the acceptance rule, and a chi-square test of
the whole loop), the QSPEC draft shares the target's storage, and tree verification equals chain runs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from quantkit.runtime.speculative import (ModelDraft, NgramDraft, SpecConfig, parse_tree, self_draft,
                                          speculative_generate)
from quantkit.runtime.speculative.acceptance import accept_child, emitted_distribution
from quantkit.runtime.speculative.decode import plain_generate
from quantkit.runtime.step import KVCache, step, tree_mask, tree_positions

TREES = ["chain", "static:2x3", "dynamic:8", "dynamic:8@0.3", "opt:6"]


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for a chi-square with `dof` degrees of freedom: the regularised upper incomplete gamma."""
    f64 = torch.float64
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=f64), torch.tensor(x / 2, dtype=f64)))


@pytest.fixture(scope="module")
def models(tiny_models):
    target = AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).eval()
    other = AutoModelForCausalLM.from_pretrained(tiny_models["mistral"]).eval()
    return target, other


def _hf_greedy(model, prompt, n):
    """transformers' own greedy decoding: the independent oracle."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


PROMPTS = [[5, 9, 12, 5, 9, 12, 5, 9], [30, 31, 40, 41, 42, 30, 31, 40, 41, 50, 51, 30, 31]]


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("kind", ["same", "other", "self:W4A8", "self:W4A4", "self:skip:1", "ngram"])
def test_greedy_equals_the_targets_own_greedy(models, kind, tree):
    target, other = models
    if kind == "ngram" and tree not in ("chain", "static:2x3"):
        pytest.skip("prompt lookup drafts chains and static trees")
    draft = {"same": lambda: ModelDraft(target, "same"), "other": lambda: ModelDraft(other, "other"),
             "ngram": NgramDraft}.get(kind, lambda: self_draft(target, kind.split(":", 1)[1]))()
    cfg = SpecConfig(tree=parse_tree(tree, 3), max_new_tokens=20)
    for prompt in PROMPTS:
        got = speculative_generate(target, draft, prompt, cfg)
        assert got.tokens == _hf_greedy(target, prompt, 20), (kind, tree)
        if kind == "same":  # a draft identical to the target is always right: every drafted depth is accepted
            assert got.accepted == got.drafted_depth


@pytest.mark.parametrize("family", ["qwen2_moe", "gemma2", "deepseek_v3"])
def test_greedy_trees_on_other_architectures(tiny_models, family, tmp_path):
    if family == "gemma2":  # sliding-window layers, with a window shorter than prompt + output
        from tests.conftest import make_tiny_model

        folder = make_tiny_model(tmp_path / "g2", "gemma2", head_dim=16, sliding_window=6)
    else:
        folder = tiny_models[family]
    target = AutoModelForCausalLM.from_pretrained(folder).eval()
    for scheme in ("W4A8", "skip:1"):  # the early exit finds the layers where the architecture's adapter puts them
        for tree in ("chain", "dynamic:8"):
            got = speculative_generate(target, self_draft(target, scheme), PROMPTS[1],
                                       SpecConfig(parse_tree(tree, 3), 12))
            assert got.tokens == _hf_greedy(target, PROMPTS[1], 12), (family, scheme, tree)


def test_tree_verification_logits_equal_chain_runs(models):
    target, _ = models
    prefix = PROMPTS[1]
    parents = [-1, 0, 0, 1, 2, 2, 4]  # node 0 = the root (last prefix token); a tree of 6 drafted nodes
    tokens = [prefix[-1], 7, 8, 9, 10, 11, 12]
    cache = KVCache()
    step(target, torch.tensor([prefix[:-1]]), torch.arange(len(prefix) - 1)[None], cache)
    got = step(target, torch.tensor([tokens]), tree_positions(parents, len(prefix) - 1),
               cache, tree_mask(parents, cache.length))[0]
    for i in range(len(tokens)):
        chain, node = [], i
        while node >= 0:
            chain.insert(0, tokens[node])
            node = parents[node]
        with torch.no_grad():
            ref = target(torch.tensor([prefix[:-1] + chain])).logits[0, -1]
        torch.testing.assert_close(got[i], ref, rtol=1e-4, atol=1e-4)  # fp32; batched vs single-row matmuls


def test_cache_keep_compacts_to_the_accepted_path(models):
    target, _ = models
    prefix = PROMPTS[0]
    cache = KVCache()
    step(target, torch.tensor([prefix]), torch.arange(len(prefix))[None], cache)
    parents = [-1, -1, 0, 1]  # two branches of two
    nodes = [20, 21, 22, 23]
    step(target, torch.tensor([nodes]), tree_positions(parents, len(prefix)), cache, tree_mask(parents, cache.length))
    cache.keep(len(prefix), [1, 3])  # the branch 21 -> 23
    got = step(target, torch.tensor([[24]]), torch.tensor([[len(prefix) + 2]]), cache)[0, -1]
    with torch.no_grad():
        ref = target(torch.tensor([prefix + [21, 23, 24]])).logits[0, -1]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_qspec_draft_shares_the_targets_weights_and_cache(models):
    target, _ = models
    before = {n: t.data_ptr() for n, t in itertools.chain(target.named_parameters(), target.named_buffers())}
    draft = self_draft(target, "W4A4")
    seen = []
    orig = draft.propose

    def spy(context, *args):
        seen.append(draft.cache)
        return orig(context, *args)

    draft.propose = spy
    speculative_generate(target, draft, PROMPTS[0], SpecConfig(parse_tree("chain", 3), 8))
    after = {n: t.data_ptr() for n, t in itertools.chain(target.named_parameters(), target.named_buffers())}
    assert before == after and draft.model is target
    assert seen and all(c is seen[0] for c in seen)  # one KV cache for both modes, the target's
    # The draft pass really computes differently (activations at 4 bits), or it would be no draft at all.
    cache = KVCache()
    ids = torch.tensor([PROMPTS[0]])
    full = step(target, ids, torch.arange(ids.shape[1])[None], cache)
    from quantkit.runtime.speculative.drafts import quantized_activations

    with quantized_activations(target, 4):
        low = step(target, ids, torch.arange(ids.shape[1])[None], KVCache())
    assert not torch.allclose(full, low)


@pytest.fixture(scope="module")
def w4a16_runtime(tmp_path_factory):
    """A W4A16 g64 runtime model whose linears the integer-dot kernel serves (K and groups multiples of 64), in fp32
    so that rounding stays far below what int8 activations change."""
    from quantkit.pipeline.engine import quantize_model
    from quantkit.recipe import Recipe
    from quantkit.runtime import load_model
    from tests.conftest import make_tiny_model

    root = tmp_path_factory.mktemp("qspec")
    base = make_tiny_model(root / "base", "llama", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256,
                           head_dim=32)
    r = Recipe()
    r.model.source = str(base)
    r.quantization.scheme, r.quantization.group_size = "W4A16", 64
    r.calibration.num_samples, r.calibration.seq_len = 2, 16
    quantize_model(r, root / "w4a16")
    return load_model(root / "w4a16", torch.float32, "cpu")


def test_qspec_w4a8_draft_runs_on_int8_codes_and_computes_w4a8(w4a16_runtime, monkeypatch):
    """self:W4A8 on a W4A16 target: every integer-dot linear takes the int8 codes (the product itself is checked
    exactly in test_kernels), and only those; everything is restored afterwards, and greedy
    speculation with the draft still equals plain greedy decoding."""
    from quantkit.runtime.kernels.cpp import IntDotKernel
    from quantkit.runtime.linear import QuantLinear
    from quantkit.runtime.speculative.drafts import quantized_activations

    rt = w4a16_runtime
    served = {id(m) for m in rt.model.modules() if isinstance(m, QuantLinear) and isinstance(m.kernel, IntDotKernel)}
    assert served
    called = set()
    real = IntDotKernel.run_int8_tokens

    def spy(self, x, p, args):
        called.update(id(m) for m in rt.model.modules() if isinstance(m, QuantLinear) and m.prepared is p)
        return real(self, x, p, args)

    monkeypatch.setattr(IntDotKernel, "run_int8_tokens", spy)
    ids = torch.tensor([PROMPTS[1]])
    pos = torch.arange(ids.shape[1])[None]
    with torch.inference_mode():
        full = step(rt, ids, pos, KVCache()).float()
        with quantized_activations(rt, 8, integer=False):
            fake = step(rt, ids, pos, KVCache()).float()
        assert not called
        with quantized_activations(rt, 8) as on_codes:
            codes = step(rt, ids, pos, KVCache()).float()
        assert called == served and on_codes == len(served)
        assert all("forward" not in m.__dict__ for m in rt.model.modules())  # the patches are gone
        again = step(rt, ids, pos, KVCache()).float()
    torch.testing.assert_close(again, full, rtol=0, atol=0)
    # Both are W4A8: int8 rounding is discontinuous, so the integer path's last bits (exact sums instead of a
    # rounded q * scale) flip some codes downstream and the two cannot agree to rounding (one layer does:
    # test_kernels); they move the output off the target's by the same order.
    shift, fake_shift = (codes - full).abs().max(), (fake - full).abs().max()
    assert 0 < shift < 3 * fake_shift and fake_shift < 3 * shift
    plain, _ = plain_generate(rt, PROMPTS[1], 12)
    got = speculative_generate(rt, self_draft(rt, "W4A8"), PROMPTS[1], SpecConfig(parse_tree("chain", 3), 12))
    assert got.tokens == plain


def test_early_exit_draft_is_the_truncated_model_on_the_targets_weights_and_cache(models):
    """self:skip:N against an independently built model of N layers holding the target's first N layers, norm and
    head: the same logits. It drafts on the target's own cache and hands it back as it was, the later layers'
    slots never written."""
    target, _ = models
    n = 1
    assert target.config.num_hidden_layers > n
    config = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": n})
    short = LlamaForCausalLM(config).eval()
    missing, unexpected = short.load_state_dict(target.state_dict(), strict=False)
    assert not missing and unexpected and all(".layers." in k for k in unexpected)
    draft = self_draft(target, f"skip:{n}")
    ids = torch.tensor([PROMPTS[1]])
    positions = torch.arange(ids.shape[1])[None]
    from quantkit.runtime.speculative.drafts import early_exit

    with early_exit(target, n):
        got = step(target, ids, positions, KVCache())
    with torch.no_grad():
        expected = short(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert len(target.model.layers) == target.config.num_hidden_layers  # restored

    before = {k: t.data_ptr() for k, t in target.state_dict().items()}
    cache = KVCache()
    step(target, ids[:, :-1], positions[:, :-1], cache)
    kept = [(layer.keys[..., : layer.length, :].clone(), layer.length) for layer in cache.layers]
    draft.reset(cache)
    tree = draft.propose(PROMPTS[1], parse_tree("chain", 3), 0.0, None, None)
    assert len(tree) == 3 and draft.cache is cache and cache.length == ids.shape[1] - 1
    for (keys, length), layer in zip(kept, cache.layers):
        assert layer.length == length and torch.equal(layer.keys[..., :length, :], keys)
    assert {k: t.data_ptr() for k, t in target.state_dict().items()} == before


@pytest.mark.parametrize("scheme", ["skip:0", "skip:x", "skip:2", "skip:9"])
def test_early_exit_draft_needs_fewer_layers_than_the_target(models, scheme):
    from quantkit.errors import InputError

    target, _ = models
    assert target.config.num_hidden_layers == 2
    with pytest.raises(InputError, match="self:skip"):
        self_draft(target, scheme)


VOCAB = torch.tensor([0, 3, 5, 9, 12, 21, 23, 24, 30, 31, 40, 41, 42, 50, 51])


@pytest.mark.parametrize("kind", ["other", "self:skip:1"])
def test_restricted_draft_vocabulary_stays_lossless(models, kind):
    """A draft scoring only some tokens (zero probability elsewhere) still gives the target's own greedy output."""
    target, other = models
    draft = ModelDraft(other, "other") if kind == "other" else self_draft(target, "skip:1")
    draft.restrict_vocabulary(VOCAB)
    cfg = SpecConfig(tree=parse_tree("dynamic:6", 3), max_new_tokens=16)
    for prompt in PROMPTS:
        got = speculative_generate(target, draft, prompt, cfg)
        assert got.tokens == _hf_greedy(target, prompt, 16)


def test_restricted_draft_distribution_is_the_full_heads_renormalised(models):
    """The reduced head's distribution equals the full model's logits at those ids, renormalised over them, and
    is zero at every other id; the full head is back in place afterwards."""
    _, other = models
    draft = ModelDraft(other, "other")
    head = other.get_output_embeddings()
    draft.restrict_vocabulary(VOCAB)
    draft.reset(KVCache())
    tree = draft.propose(PROMPTS[0], parse_tree("chain", 2), 0.0, None, None)
    assert other.get_output_embeddings() is head and set(tree.tokens) <= set(VOCAB.tolist())
    with torch.no_grad():
        logits = other(torch.tensor([PROMPTS[0]])).logits[0, -1].double()
    expected = torch.zeros_like(logits)
    expected[VOCAB] = torch.softmax(logits[VOCAB], -1)
    torch.testing.assert_close(draft.root(), expected, rtol=1e-5, atol=1e-7)


def test_restricted_vocabulary_of_a_quantised_head_is_its_rows():
    """A quantised head restricted to some rows computes what the whole quantised head computes at those rows."""
    from quantkit.runtime.speculative.drafts import vocabulary_head
    from tests.runtime.test_kernels import int_layer

    head = int_layer(96, 64, 4, False, 32, dtype=torch.float32)
    head.bias = None
    dispatch_model = torch.nn.Module()
    dispatch_model.get_output_embeddings = lambda: head
    ids = torch.tensor([1, 7, 8, 40, 95])
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(vocabulary_head(dispatch_model, ids)(x), head(x)[:, ids], rtol=1e-5, atol=1e-5)


def test_draft_bytes_per_token_count_the_layers_and_the_head_a_step_reads(models):
    """Against sums written here over the modules' own parameters: the target reads every decoder layer and its head,
    an early exit only its first layers, a restricted vocabulary only its head's rows."""
    from quantkit.runtime.speculative.drafts import weight_bytes_per_token

    target, _ = models

    def size(*modules):
        return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())

    layers, head = target.model.layers, target.get_output_embeddings()
    assert weight_bytes_per_token(target) == size(*layers, head)
    skip = self_draft(target, "skip:1")
    assert skip.bytes_per_token == size(layers[0], head)
    skip.restrict_vocabulary(VOCAB)
    assert skip.bytes_per_token == size(layers[0]) + len(VOCAB) * head.in_features * head.weight.element_size()
    assert self_draft(target, "W4A8").bytes_per_token == weight_bytes_per_token(target)
    assert NgramDraft().bytes_per_token == 0


def test_acceptance_rule_is_exact_by_enumeration():
    """Over every draw of the children (i.i.d. from q, or chosen distinct tokens), the emitted token's exact
    distribution equals p: the residual and ratio formulas are right."""
    g = torch.Generator().manual_seed(0)
    V = 5
    for trial in range(20):
        p = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1)
        q = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1)
        for m in (1, 2, 3):
            total = torch.zeros(V, dtype=torch.float64)
            for draw in itertools.product(range(V), repeat=m):
                weight = math.prod(float(q[x]) for x in draw)
                total += weight * emitted_distribution(p, [(x, q) for x in draw])
            torch.testing.assert_close(total, p, rtol=0, atol=1e-12)
        for draw in itertools.permutations(range(V), 2):  # deterministic distinct children (point masses)
            torch.testing.assert_close(emitted_distribution(p, [(x, None) for x in draw]), p, rtol=0, atol=1e-12)


def test_sampler_follows_the_rule():
    """The sampling code path (uniform draws, residual sampling) matches the exact distribution."""
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.6, 0.2, 0.1], dtype=torch.float64)
    children = [(1, q), (2, q)]
    expected = emitted_distribution(p, children)
    counts = torch.zeros(4, dtype=torch.float64)
    n = 20000
    for _ in range(n):
        idx, left = accept_child(p, children, lambda: float(torch.rand((), generator=g, dtype=torch.float64)))
        token = children[idx][0] if idx is not None else int(torch.multinomial(left, 1, generator=g))
        counts[token] += 1
    possible = expected > 0
    assert counts[~possible].sum() == 0  # a token the rule can never emit here was never emitted
    chi2 = float(((counts[possible] - n * expected[possible]) ** 2 / (n * expected[possible])).sum())
    assert chi2_sf(chi2, int(possible.sum()) - 1) > 0.01, chi2


def _tiny(seed: int, vocab: int = 8) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=vocab, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peakier distributions than the random init's near-uniform ones
    return model


@pytest.mark.slow  # 20k speculative decodes (minutes on 2 cores); chains are covered exactly by the tests above
@pytest.mark.parametrize("tree", ["dynamic:6", "dynamic:6@0.25"])
def test_sampled_output_keeps_the_target_distribution(tree):
    """Chi-square over 20k speculative samples of the first two tokens against the target's exact joint
    distribution, computed from plain forwards."""
    target, other = _tiny(0), _tiny(1)
    prompt = [1, 2, 3]
    T = 1.0
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double() / T, -1)
        joint = torch.stack([p1[a] * torch.softmax(target(torch.tensor([prompt + [a]])).logits[0, -1].double() / T, -1)
                             for a in range(8)])
    draft = ModelDraft(other, "other")
    counts = torch.zeros(8, 8, dtype=torch.float64)
    n = 20000
    spec = parse_tree(tree, 2)
    for i in range(n):
        out = speculative_generate(target, draft, prompt, SpecConfig(spec, 2, temperature=T, seed=i)).tokens
        counts[out[0], out[1]] += 1
    expected = joint * n
    keep = expected > 5  # the usual validity condition of the chi-square approximation
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert chi2_sf(chi2, int(keep.sum()) - 1) > 0.01, chi2


def test_plain_generate_equals_transformers(models):
    target, _ = models
    tokens, _ = plain_generate(target, PROMPTS[0], 10)
    assert tokens == _hf_greedy(target, PROMPTS[0], 10)


class _FixedDraft:
    """A draft whose distribution is the same everywhere: top token with probability 0.4, three more at 0.2."""

    def __init__(self):
        self.q = torch.tensor([0.4, 0.2, 0.2, 0.2] + [0.0] * 4)

    def root(self):
        return self.q

    def expand(self, tree, nodes):
        return [self.q for _ in nodes]


def test_dynamic_trees_follow_the_measured_acceptance_not_the_drafts_own_confidence():
    from quantkit.runtime.speculative.trees import AcceptanceRates, DraftTree, build_dynamic

    draft = _FixedDraft()
    # Uncalibrated (EAGLE-2's raw confidence): 0.4 * 0.4 = 0.16 < 0.2, so the 8-node tree spends its budget on
    # the root's siblings and their children, two levels deep.
    raw = build_dynamic(draft, 8, 6, False, None)
    assert max(raw.depths) == 1
    # The draft is under-confident: its 0.4 tokens are always accepted, its 0.2 ones never. Measured that way,
    # the chain of top tokens is worth the whole budget.
    rates = AcceptanceRates()
    for _ in range(50):
        t = DraftTree()
        top = t.add(0, -1, None, 0, prob=0.4)
        t.add(1, -1, None, 1, prob=0.2)
        rates.record(t, [top])
    assert rates.calibrated(0.4) > 0.95 and rates.calibrated(0.2) < 0.05
    tuned = build_dynamic(draft, 8, 6, False, None, rates)
    assert max(tuned.depths) == 5  # the depth limit: a chain of the top tokens, 6 deep
    chain_nodes = [i for i in range(len(tuned)) if tuned.ranks[i] == 0]
    assert len(chain_nodes) == 6 and all(tuned.tokens[i] == 0 for i in chain_nodes)


def test_a_confidence_floor_drafts_only_the_nodes_likely_enough():
    """The fixed draft: top token 0.4, three more at 0.2, everywhere. Uncalibrated, a node's confidence is the
    product of those along its path; the floor keeps exactly the nodes at or above it."""
    from quantkit.runtime.speculative.trees import build_dynamic

    draft = _FixedDraft()
    assert len(build_dynamic(draft, 8, 4, False, None, floor=0.5)) == 0  # nothing reaches 0.5: a plain step
    one = build_dynamic(draft, 8, 4, False, None, floor=0.3)
    assert (one.tokens, one.parents) == ([0], [-1])  # 0.4 alone; its children are worth 0.16 at most
    # 0.1: the root's four children (0.4, 0.2, 0.2, 0.2) and the top token's top child (0.4 * 0.4 = 0.16); every
    # other node is 0.08 or less.
    some = build_dynamic(draft, 8, 4, False, None, floor=0.1)
    assert sorted(zip(some.depths, some.tokens)) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    assert some.parents[some.depths.index(1)] == some.tokens.index(0)
    # Sampled children come as whole sets, decided on the draft's distribution: none when its top token is below
    # the floor, all four draws otherwise, whatever was drawn (keeping only likely draws would bias the proposal).
    assert len(build_dynamic(draft, 8, 4, True, torch.Generator().manual_seed(0), floor=0.5)) == 0
    for seed in range(20):
        sampled = build_dynamic(draft, 4, 4, True, torch.Generator().manual_seed(seed), floor=0.3)
        assert sampled.depths == [0, 0, 0, 0]


@pytest.mark.parametrize("text", ["dynamic:8@0", "dynamic:8@1", "opt:6@0.3", "dynamic:8@x"])
def test_a_confidence_floor_outside_0_1_or_on_other_trees_is_refused(text):
    from quantkit.errors import InputError

    with pytest.raises(InputError, match="--tree"):
        parse_tree(text, 4)
    assert parse_tree("dynamic:8@0.3", 4).floor == 0.3
    assert parse_tree("dynamic:8@0.3", 4).describe() == "dynamic:8@0.3"
