"""EAGLE and Medusa drafts (runtime/speculative/heads.py): lossless with every tree shape, the drafter's cached
tree expansion equal to running each path alone, the features they read equal to transformers' own last hidden
state, and drafters of another model refused in one line."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.errors import InputError
from quantkit.runtime.speculative import SpecConfig, parse_tree, speculative_generate
from quantkit.runtime.speculative.heads import (DraftKV, EagleDraft, EagleDrafter, FeatureTap, MedusaDraft,
                                                MedusaHeads, eagle_layer_config)
from quantkit.runtime.speculative.trees import AcceptanceRates, TreeSpec

TREES = ["chain", "static:2x3", "dynamic:6", "dynamic:6@0.3", "opt:6"]
PROMPTS = [[5, 9, 12, 5, 9, 12, 5, 9], [30, 31, 40, 41, 42, 30, 31, 40, 41, 50, 51, 30, 31], [7]]


@pytest.fixture(scope="module")
def target(tiny_models):
    return AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).eval()


def _eagle(target, seed=0):
    torch.manual_seed(seed)
    return EagleDrafter(eagle_layer_config(target.config))


def _medusa(target, heads=3, seed=0):
    torch.manual_seed(seed)
    m = MedusaHeads(target.config.hidden_size, heads)
    for b in m.blocks:  # zero-initialised heads would all repeat the target: give each its own guess
        torch.nn.init.normal_(b.weight, std=0.2)
    return m


def _hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("kind", ["eagle", "medusa", "eagle-vocab"])
def test_greedy_with_a_feature_draft_is_the_targets_own_greedy(target, kind, tree):
    vocab = torch.arange(0, 256, 3) if kind == "eagle-vocab" else None
    draft = (MedusaDraft(target, _medusa(target), "m", vocab) if kind == "medusa"
             else EagleDraft(target, _eagle(target), "e", vocab))
    for prompt in PROMPTS:  # [7]: one token, no feature yet: the first step verifies the root alone
        got = speculative_generate(target, draft, prompt, SpecConfig(tree=parse_tree(tree, 3), max_new_tokens=16))
        assert got.tokens == _hf_greedy(target, prompt, 16), (kind, tree, prompt)


def test_feature_tap_reads_transformers_last_hidden_state(target):
    ids = torch.tensor([[3, 8, 20, 7, 9]])
    tap = FeatureTap(target)
    try:
        with torch.no_grad():
            out = target(ids, output_hidden_states=True)
        got = tap.take()
    finally:
        tap.close()
    torch.testing.assert_close(got, out.hidden_states[-1])  # the normed state the head reads
    torch.testing.assert_close(target.lm_head(got), out.logits)


def test_cached_drafting_equals_the_full_causal_forward(target):
    drafter = _eagle(target).eval()
    h = target.config.hidden_size
    e, f = torch.randn(1, 10, h), torch.randn(1, 10, h)
    pos = torch.arange(10)[None]
    with torch.no_grad():
        full = drafter(e, f, pos)
        cache = DraftKV()
        a = drafter(e[:, :6], f[:, :6], pos[:, :6], cache, torch.ones(1, 1, 6, 6, dtype=torch.bool).tril_())
        b = drafter(e[:, 6:], f[:, 6:], pos[:, 6:], cache, torch.ones(1, 1, 4, 10, dtype=torch.bool).tril_(6))
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=1e-5, atol=1e-5)


def test_every_tree_node_gets_what_its_path_run_alone_gives(target):
    """A static 3x3 tree drafted with one cache and masks: each node's distribution equals the drafter run from
    scratch over the committed text and that node's path only (predicted features fed back by hand)."""
    drafter = _eagle(target, seed=3).eval()
    draft = EagleDraft(target, drafter, "e")
    prompt = [5, 9, 12, 5, 9, 12, 5, 9, 14]
    with torch.no_grad():
        feats = target(torch.tensor([prompt[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    draft.reset(None)
    draft.observe(0, feats)
    seen = {}
    real_expand = draft.expand

    def spy(tree, nodes):
        out = real_expand(tree, nodes)
        seen.update(zip(nodes, out))
        return out

    draft.expand = spy
    tree = draft.propose(prompt, TreeSpec("static", 3, width=3), 0.0, None, AcceptanceRates())
    assert len(tree) == 9 and not tree.is_chain()
    embed = target.get_input_embeddings()

    def from_scratch(path: list[int]) -> torch.Tensor:
        # Positions 0..n-2 read the target's features; each path token then reads the previous position's output.
        tokens, inputs = list(prompt[1:]), list(feats)
        with torch.no_grad():
            pred = drafter(embed(torch.tensor([tokens])), torch.stack(inputs)[None], torch.arange(len(tokens))[None])[0, -1]
            for tok in path:
                tokens.append(tok)
                inputs.append(pred)
                pred = drafter(embed(torch.tensor([tokens])), torch.stack(inputs)[None],
                               torch.arange(len(tokens))[None])[0, -1]
        return pred

    for node, dist in seen.items():
        path, v = [], node
        while v >= 0:
            path.append(tree.tokens[v])
            v = tree.parents[v]
        last = from_scratch(path[::-1])
        ref = torch.softmax(target.lm_head(last).double(), -1)
        torch.testing.assert_close(dist, ref, rtol=1e-4, atol=1e-6)


def test_medusa_node_at_depth_d_takes_head_d_plus_one_of_the_last_feature(target):
    heads = _medusa(target, heads=3).eval()
    draft = MedusaDraft(target, heads, "m")
    prompt = [4, 8, 15, 16, 23, 42]
    with torch.no_grad():
        feats = target(torch.tensor([prompt[:-1]]), output_hidden_states=True).hidden_states[-1][0]
        # Independently: feature n-2 through block k then the head, a softmax per head
        refs = [torch.softmax(target.lm_head(feats[-1] + torch.nn.functional.silu(b(feats[-1]))).double(), -1)
                for b in heads.blocks]
    draft.reset(None)
    draft.observe(0, feats)
    tree = draft.propose(prompt, TreeSpec("static", 5, width=2), 0.0, None, AcceptanceRates())
    assert max(tree.depths) == 2  # three heads: three levels however deep the spec asks
    for v in range(len(tree)):
        ranked = torch.topk(refs[tree.depths[v]], 2).indices.tolist()
        assert tree.tokens[v] == ranked[tree.ranks[v]] if tree.depths[v] == 0 else tree.tokens[v] == ranked[0]


def test_a_drafter_for_another_model_is_refused(target, tiny_models):
    wide = EagleDrafter(eagle_layer_config(target.config.__class__(**{**target.config.to_dict(), "hidden_size": 128})))
    with pytest.raises(InputError, match="hidden size 128 is not the target's 64"):
        EagleDraft(target, wide, "eagle:x")
    with pytest.raises(InputError, match="outside the target's 256"):
        MedusaDraft(target, MedusaHeads(64, 2), "medusa:x", torch.tensor([1, 300]))
