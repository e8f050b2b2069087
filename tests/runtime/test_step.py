"""The step API (prefill / step / crop / tree masks) against transformers' own model run with no cache.

Tolerance: fp32 throughout. The cached path and the oracle do the same arithmetic in different shapes
(attention over a [T, cache + T] block instead of the full square, an explicit SDPA mask instead of
`is_causal`, matmuls over other row counts), so only the summation order differs: measured gaps are
~2e-7 of the largest logit. A wrong slot, position, window or padding flag moves logits by ~1e-1 on these
random models, so 1e-5 (relative, and absolute relative to the largest logit) sits 50x above the noise and
four orders below a bug.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.runtime import generate, load_model
from quantkit.runtime.step import KVCache, prefill, step, tree_mask, tree_positions
from tests.conftest import FAMILIES, make_tiny_model

# Windows of 5, so the 10-20 token sequences below cross them; mixed full/sliding layer stacks where the
# architecture has them (those models take one mask per layer type, mistral one for all layers).
SLIDING = {
    "mistral_window": ("mistral", {"sliding_window": 5}),
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    "gemma2": ("gemma2", {"head_dim": 16, "sliding_window": 5,
                          "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma3_text": ("gemma3_text", {"head_dim": 16, "sliding_window": 5,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
}
ALL = [*FAMILIES, *SLIDING]


@pytest.fixture(scope="module")
def paths(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("sliding")
    out = dict(tiny_models)
    for name, (family, overrides) in SLIDING.items():
        out[name] = make_tiny_model(root / name, family, **overrides)
    return out


def _pair(paths, name):
    """(quantkit's runtime model, transformers' model) of the same checkpoint."""
    return load_model(paths[name]), AutoModelForCausalLM.from_pretrained(paths[name]).eval()


@torch.no_grad()
def _oracle(hf, ids: list[int]) -> torch.Tensor:
    """Logits [len, V] of one sequence, full forward, no cache."""
    return hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(4, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", ALL)
def test_step_after_crop_equals_fresh_forward(paths, name):
    rt, hf = _pair(paths, name)
    prompt, drafted, other = _tokens(12, 1), _tokens(5, 2), _tokens(3, 3)
    cache = KVCache()  # no capacity: the buffers grow (12 -> 24 slots) on the way
    first = step(rt, torch.tensor([prompt]), torch.arange(12)[None], cache)
    step(rt, torch.tensor([drafted]), torch.arange(12, 17)[None], cache)
    assert cache.length == 17
    cache.crop(14)  # keep two of the five drafted tokens
    assert cache.length == 14
    last = step(rt, torch.tensor([other]), torch.arange(14, 17)[None], cache)
    expected = _oracle(hf, prompt + drafted[:2] + other)
    _close(first[0], expected[:12])
    _close(last[0], expected[14:])


# Seven nodes, depth 3: two roots; node 3 is a grandchild, node 6 a great-grandchild of root 0.
PARENTS = [-1, 0, 0, 1, -1, 4, 3]


def _chain(parents: list[int], node: int) -> list[int]:
    chain = []
    while node >= 0:
        chain.append(node)
        node = parents[node]
    return chain[::-1]


@pytest.mark.parametrize("name", ["llama", "qwen2_moe", "deepseek_v3", "gemma2", "gemma3_text", "mistral_window"])
def test_tree_step_gives_each_node_its_chain_logits(paths, name):
    rt, hf = _pair(paths, name)
    prefix, nodes = _tokens(10, 4), _tokens(len(PARENTS), 5)
    cache = KVCache()
    step(rt, torch.tensor([prefix]), torch.arange(10)[None], cache)
    logits = step(rt, torch.tensor([nodes]), tree_positions(PARENTS, 10), cache, tree_mask(PARENTS, cache.length))
    for i in range(len(PARENTS)):
        chain = [nodes[j] for j in _chain(PARENTS, i)]
        _close(logits[0, i], _oracle(hf, prefix + chain)[-1])
    # Verification done: keep the prefix, then continue along one accepted chain (root 4, child 5).
    cache.crop(10)
    accepted = [nodes[4], nodes[5]]
    after = step(rt, torch.tensor([accepted]), torch.arange(10, 12)[None], cache)
    _close(after[0], _oracle(hf, prefix + accepted)[10:])


@pytest.mark.parametrize("name", ["llama", "gemma2", "mistral_window"])
def test_tree_step_over_left_padded_prefixes(paths, name):
    rt, hf = _pair(paths, name)
    prompts = [_tokens(4, 6), _tokens(11, 7)]
    nodes = [_tokens(len(PARENTS), 8), _tokens(len(PARENTS), 9)]
    cache = KVCache()
    first = prefill(rt, prompts, cache)
    positions = tree_positions(PARENTS, first.next_positions)
    logits = step(rt, torch.tensor(nodes), positions, cache, tree_mask(PARENTS, cache.length))
    for row, prompt in enumerate(prompts):
        for i in range(len(PARENTS)):
            chain = [nodes[row][j] for j in _chain(PARENTS, i)]
            _close(logits[row, i], _oracle(hf, prompt + chain)[-1])


@pytest.mark.parametrize("name", ["llama", "mistral_window"])
def test_crop_into_left_padded_prompts(paths, name):
    rt, hf = _pair(paths, name)
    prompts = [_tokens(4, 18), _tokens(9, 19)]  # 9 slots: row 0 is padding in slots 0-4
    cache = KVCache()
    first = prefill(rt, prompts, cache)
    step(rt, torch.tensor([_tokens(3, 20)] * 2), first.next_positions[:, None] + torch.arange(3), cache)
    cache.crop(7)  # back into the prompts: row 0 keeps 2 real tokens, row 1 keeps 7
    other = [_tokens(3, 21), _tokens(3, 22)]
    logits = step(rt, torch.tensor(other), torch.tensor([[2, 3, 4], [7, 8, 9]]), cache)
    _close(logits[0], _oracle(hf, prompts[0][:2] + other[0])[2:])
    _close(logits[1], _oracle(hf, prompts[1][:7] + other[1])[7:])


def _greedy_alone(hf, prompt: list[int], new: int) -> list[int]:
    ids = list(prompt)
    for _ in range(new):
        ids.append(int(_oracle(hf, ids)[-1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "deepseek_v3", "gemma2", "qwen2_window", "mistral_window"])
def test_batched_unequal_prompts_decode_like_each_alone(paths, name):
    rt, hf = _pair(paths, name)
    prompts = [_tokens(3, 10), _tokens(11, 11), _tokens(7, 12)]
    new = 8
    expected = [_greedy_alone(hf, p, new) for p in prompts]

    cache = KVCache()
    first = prefill(rt, prompts, cache)
    for row, prompt in enumerate(prompts):
        _close(first.logits[row], _oracle(hf, prompt)[-1])
    token, pos, out = first.logits.argmax(-1), first.next_positions, []
    for _ in range(new):
        out.append(token)
        logits = step(rt, token[:, None], pos[:, None], cache)
        token, pos = logits[:, -1].argmax(-1), pos + 1
    assert torch.stack(out, 1).tolist() == expected

    assert generate(rt, prompts, new).tokens.tolist() == expected


def test_generate_stops_rows_at_eos(paths):
    rt, hf = _pair(paths, "llama")
    prompts = [_tokens(5, 13), _tokens(9, 14)]
    free = generate(rt, prompts, 6).tokens
    eos = int(free[0, 2])  # row 0 reaches it at step 2; row 1 may or may not
    out = generate(rt, prompts, 6, eos_token_id=eos).tokens
    for row in range(2):
        stop = free[row].tolist().index(eos) if eos in free[row].tolist() else 6
        assert out[row, : stop + 1].tolist() == free[row, : stop + 1].tolist()
        assert (out[row, stop + 1:] == eos).all()


def test_sampling_is_seeded_and_top_k_1_is_greedy(paths):
    rt, _ = _pair(paths, "qwen2")
    prompts = [_tokens(5, 15), _tokens(2, 16)]
    a = generate(rt, prompts, 6, temperature=1.0, seed=3).tokens
    b = generate(rt, prompts, 6, temperature=1.0, seed=3).tokens
    c = generate(rt, prompts, 6, temperature=1.0, seed=4).tokens
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(generate(rt, prompts, 6, temperature=0.7, top_k=1, seed=5).tokens,
                       generate(rt, prompts, 6).tokens)


def test_step_rejects_masks_of_the_wrong_shape(paths):
    rt, _ = _pair(paths, "llama")
    cache = KVCache()
    step(rt, torch.tensor([_tokens(4, 17)]), torch.arange(4)[None], cache)
    with pytest.raises(ValueError, match="4-D attention_mask"):
        step(rt, torch.tensor([[5, 6]]), torch.tensor([[4, 5]]), cache, tree_mask([-1, 0], 3))
    with pytest.raises(ValueError, match="parent"):
        tree_mask([1, -1], 4)
    assert cache.length == 4


@pytest.mark.slow
def test_generate_matches_transformers_generate_on_smollm2(smollm2_path):
    from transformers import AutoTokenizer

    # fp32 on both sides: the batched run pads, so its matmuls and SDPA calls differ in shape from a prompt
    # run alone, and bf16 rounding of those differences can flip a near-tie token; fp32 makes it a
    # comparison of the algorithms.
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    rt = load_model(smollm2_path, dtype=torch.float32)
    texts = ["The capital of France is", "In the beginning God created the heaven and the earth. And the earth was"]
    prompts = [tok(t).input_ids for t in texts]
    assert len(prompts[0]) != len(prompts[1])
    ours = generate(rt, prompts, 16, eos_token_id=tok.eos_token_id).tokens
    for row, prompt in enumerate(prompts):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                          pad_token_id=tok.eos_token_id)[0, len(prompt):].tolist()
        assert ours[row, : len(ref)].tolist() == ref
        assert (ours[row, len(ref):] == tok.eos_token_id).all()
