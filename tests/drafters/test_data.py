"""The fit text of `draft-heads`: `self` is the target continuing seeded openers in quantkit's runtime; a mixture
takes its shares of whole blocks from each source."""

from __future__ import annotations

import torch

from quantkit.data.calibration import build_token_blocks
from quantkit.drafters.data import _prompts, fit_text, target_text


def _target(path):
    from quantkit.runtime.model import load_model

    return load_model(path, torch.float32, "cpu")


def test_self_text_is_the_targets_continuation_of_the_openers(tiny_models):
    from transformers import AutoTokenizer

    path = tiny_models["llama"]
    tok = AutoTokenizer.from_pretrained(path)
    target = _target(path)
    ids = target_text(target, tok, 3, 48, seed=5)
    assert ids.shape == (3, 48)
    for row, prompt in zip(ids.tolist(), _prompts(tok, 3, 5)):
        prompt = prompt[: 48 // 2]  # a prompt takes at most half the row
        assert row[: len(prompt)] == prompt
    assert torch.equal(ids, target_text(target, tok, 3, 48, seed=5))  # seeded
    assert not torch.equal(ids, target_text(target, tok, 3, 48, seed=6))
    # Every continuation token lies in the target's own top-p 0.95 nucleus at T 0.8 (a uniform draw would leave
    # the nucleus at ~5% of the ~40 positions)
    with torch.no_grad():
        probs = torch.softmax(target.model(ids).logits[:, :-1].double() / 0.8, -1)
    start = max(len(p[:24]) for p in _prompts(tok, 3, 5))
    sorted_p, order = probs.sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # the mass ranked above each token
    rank = (order == ids[:, 1:, None]).long().argmax(-1)
    mass_above = before.gather(-1, rank[..., None])[..., 0][:, start - 1 :]
    assert bool((mass_above < 0.95 + 1e-6).all())


def test_a_mixture_takes_whole_blocks_of_each_source(tiny_models, text_file):
    from transformers import AutoTokenizer

    path = tiny_models["llama"]
    tok = AutoTokenizer.from_pretrained(path)
    ids = fit_text(_target(path), tok, f"{text_file}:0.5,self:0.5", 4, 16, seed=0)
    assert ids.shape == (4, 16)
    text_rows = {tuple(r) for r in build_token_blocks(tok, str(text_file), 2, 16, 0).input_ids.tolist()}
    assert sum(tuple(r) in text_rows for r in ids.tolist()) == 2
