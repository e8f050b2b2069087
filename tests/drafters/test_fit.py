"""`quantkit draft-heads`: fitting lowers the held-out distillation loss, the draft vocabulary is what the target
predicts most, a fitted folder round-trips into `eval --speculative`, and bad input is one line."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.drafters.fit import FitConfig, fit, select_vocabulary

runner = CliRunner()


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))


def _target(tiny_models):
    from quantkit.runtime.model import load_model

    return load_model(tiny_models["llama"], torch.float32, "cpu")


def _text_ids(n=24, length=48, seed=0):
    """Token blocks with structure to learn: repeated short motifs, as real text repeats words."""
    g = torch.Generator().manual_seed(seed)
    motifs = torch.randint(4, 200, (12, 6), generator=g)
    rows = [torch.cat([motifs[i] for i in torch.randint(0, 12, (length // 6,), generator=g)]) for _ in range(n)]
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_fitting_lowers_the_heldout_distillation_loss(tiny_models, kind):
    result = fit(_target(tiny_models), _text_ids(), FitConfig(kind=kind, steps=80, eval_every=40, draft_vocab=0,
                                                             lr=3e-3), [0, 1, 2])
    before, after = result.untrained, result.history[-1]
    assert after["heldout_loss"] < 0.8 * before["heldout_loss"], (before, after)
    # EAGLE sees the next token; a Medusa head guesses further ahead in a random model, where little is predictable
    gain = 0.1 if kind == "eagle" else 0.0
    assert after["top1_agreement"][0] >= before["top1_agreement"][0] + gain, (before, after)


def test_draft_vocabulary_is_the_targets_most_predicted_tokens_and_the_special_ones():
    g = torch.Generator().manual_seed(1)
    predicted = torch.randint(0, 50, (4, 30), generator=g)
    ids = torch.randint(0, 50, (4, 30), generator=g)
    vocab = select_vocabulary(ids, predicted, 10, 64, special=[63, 62])
    counts = Counter(predicted.flatten().tolist())
    chosen = set(vocab.tolist())
    assert {62, 63} <= chosen and len(chosen) == 10 and vocab.tolist() == sorted(vocab.tolist())
    # Every chosen ordinary token is predicted at least as often as any token left out
    least_in = min(counts[t] for t in chosen - {62, 63})
    assert all(counts[t] <= least_in for t in set(range(62)) - chosen)
    assert select_vocabulary(ids, predicted, 0, 64, []) is None and select_vocabulary(ids, predicted, 64, 64, []) is None


def _draft_heads(target, out, *args):
    return runner.invoke(app, ["draft-heads", str(target), "--output", str(out), *map(str, args)],
                         catch_exceptions=False)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_fitted_folder_round_trips_into_eval(tiny_models, tmp_path, text_file, kind):
    from safetensors.torch import load_file

    from quantkit.runtime.speculative.heads import load_draft

    target = tiny_models["llama"]
    out = tmp_path / kind
    res = _draft_heads(target, out, "--kind", kind, "--dataset", text_file, "--num-samples", 8, "--seq-len", 32,
                       "--steps", 4, "--draft-vocab", 64, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["draft_vocab"] == 64 and report["trained"]["heldout_loss"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == kind and config["quantkit"]["vocab_size"] == 256
    draft = load_draft(f"{kind}:{out}", _target(tiny_models))
    stored = load_file(str(out / "model.safetensors"))
    assert torch.equal(draft.vocabulary, stored.pop("draft_vocabulary"))
    for name, tensor in draft.module.state_dict().items():
        assert torch.equal(tensor, stored[name].to(tensor.dtype)), name
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"ids": [5, 9, 12, 5, 9, 12]}\n{"ids": [30, 31, 40, 30]}\n')
    ev = runner.invoke(app, ["eval", str(target), "--baseline", str(target), "--num-samples", "2", "--seq-len", "16",
                             "--speculative", f"{kind}:{out}", "--tree", "dynamic:6", "--prompts", str(prompts),
                             "--max-new-tokens", "10", "--compute-dtype", "float32", "--json"], catch_exceptions=False)
    assert ev.exit_code == 0, ev.output
    spec = json.loads(ev.stdout)["results"][0]["speculative"]
    assert spec["identical_to_plain"] is True and spec["draft_vocab"] == 64
    assert 0 < spec["draft_bytes_per_token"] < spec["target_bytes_per_token"]


def _one_line(result, needle):
    assert result.exit_code not in (0, None), (result.exit_code, result.output)
    err = result.stderr.strip()
    assert "Traceback" not in result.output and len(err.splitlines()) == 1 and needle in err, err


def test_bad_input_is_one_line(tiny_models, tmp_path, text_file):
    from tests.conftest import make_tiny_model

    target = tiny_models["llama"]
    _one_line(_draft_heads(target, tmp_path / "a", "--kind", "hydra"), "unknown --kind")
    _one_line(_draft_heads(target, tmp_path / "a", "--steps", 0), "--steps must be at least 1")
    _one_line(_draft_heads(target, tmp_path / "a", "--num-samples", 1), "--num-samples must be at least 2")
    (tmp_path / "exists").mkdir()
    _one_line(_draft_heads(target, tmp_path / "exists"), "pass --overwrite")
    _one_line(_draft_heads(tmp_path / "nowhere", tmp_path / "a"), "nowhere")
    # A drafter fitted to one model, used on another (other vocabulary) or as the other kind
    out = tmp_path / "eagle"
    assert _draft_heads(target, out, "--dataset", text_file, "--num-samples", 4, "--seq-len", 16, "--steps", 1,
                        "--draft-vocab", 0).exit_code == 0
    other = make_tiny_model(tmp_path / "other", "llama", vocab_size=200)

    def ev(model, draft):
        return runner.invoke(app, ["eval", str(model), "--baseline", str(model), "--num-samples", "2", "--seq-len",
                                   "16", "--speculative", draft, "--max-new-tokens", "4"], catch_exceptions=False)

    _one_line(ev(other, f"eagle:{out}"), "fitted to a vocabulary of 256 tokens, the target has 200")
    wider = make_tiny_model(tmp_path / "wider", "llama", hidden_size=128)
    _one_line(ev(wider, f"eagle:{out}"), "its hidden size 64 is not the target's 128")
    _one_line(ev(target, f"medusa:{out}"), "holds a eagle checkpoint, not medusa")
    _one_line(ev(target, f"eagle:{tmp_path / 'none'}"), "is not a drafter folder")


@pytest.mark.slow
def test_an_eagle_drafter_fitted_to_smollm2_drafts_losslessly_in_fp32(smollm2_path):
    """On the real model: a short fit already beats the untrained drafter on held-out text, and fp32 greedy
    speculative decoding with it is plain greedy decoding token for token, with drafted tokens accepted."""
    from transformers import AutoTokenizer

    from quantkit.data.calibration import build_token_blocks
    from quantkit.eval.speculative import first_divergence
    from quantkit.runtime.model import load_model
    from quantkit.runtime.speculative import SpecConfig, parse_tree, speculative_generate
    from quantkit.runtime.speculative.decode import plain_generate
    from quantkit.runtime.speculative.heads import EagleDraft

    rt = load_model(smollm2_path, torch.float32, "cpu")
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = build_token_blocks(tok, "kjv", 16, 128, 0).input_ids
    result = fit(rt, ids, FitConfig(kind="eagle", steps=40, eval_every=40, draft_vocab=4096),
                 sorted(set(tok.all_special_ids)))
    before, after = result.untrained, result.history[-1]
    assert after["heldout_loss"] < 0.7 * before["heldout_loss"], (before, after)
    assert after["top1_agreement"][0] > before["top1_agreement"][0] + 0.05, (before, after)
    draft = EagleDraft(rt, result.module, "eagle", result.vocabulary)
    accepted = 0
    for text in ["And the LORD spake unto Moses, saying,", "Question: what is the capital of France? Answer:"]:
        prompt = tok(text)["input_ids"]
        plain, _ = plain_generate(rt, prompt, 24)
        spec = speculative_generate(rt, draft, prompt, SpecConfig(tree=parse_tree("dynamic:8", 4), max_new_tokens=24))
        assert len(plain) == 24 and first_divergence(spec.tokens, plain) is None, (text, spec.tokens, plain)
        accepted += spec.accepted
    assert accepted > 0


def test_distillation_loss_is_the_kl_of_the_top_tokens_and_one_bucket_for_the_rest():
    from quantkit.drafters.fit import _kl, target_top

    g = torch.Generator().manual_seed(3)
    feats, head = torch.randn(5, 7, 16, generator=g), torch.randn(40, 16, generator=g)
    logits = torch.randn(5, 7, 40, generator=g) * 2
    p, q = torch.softmax(feats @ head.T, -1).double(), torch.softmax(logits, -1).double()
    full = (p * (p.log() - q.log())).sum(-1).mean()
    # Every token kept: the exact KL
    assert float(_kl(logits, *target_top(feats, head, k=40))) == pytest.approx(float(full), rel=1e-4)
    # Top 6 of the target and the rest as one token: the KL of those coarser distributions, below the exact one
    logp, idx = target_top(feats, head, k=6)
    top = torch.topk(p, 6, -1).indices
    assert torch.equal(idx.long(), top)
    pc = torch.cat([p.gather(-1, top), 1 - p.gather(-1, top).sum(-1, keepdim=True)], -1)
    qc = torch.cat([q.gather(-1, top), 1 - q.gather(-1, top).sum(-1, keepdim=True)], -1)
    coarse = (pc * (pc.log() - qc.log())).sum(-1).mean()
    assert float(_kl(logits, logp, idx)) == pytest.approx(float(coarse), rel=1e-4) and coarse < full
