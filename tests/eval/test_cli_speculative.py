"""`quantkit eval --speculative` end to end on tiny models: greedy speculative output equals plain greedy output
through the CLI, and every kind of bad input is one line and a non-zero exit, before any decoding."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from quantkit.cli import app
from tests.conftest import make_tiny_model

runner = CliRunner()


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))


@pytest.fixture()
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"ids": ids}) for ids in ([5, 9, 12, 5, 9, 12], [30, 31, 40, 30, 31])))
    return path


def _eval(target, *args):
    # The target is its own baseline (a plain HF folder has no manifest naming one); a small KL set.
    args = [target, "--baseline", target, "--num-samples", 2, "--seq-len", 16, *args]
    return runner.invoke(app, ["eval", *map(str, args)], catch_exceptions=False)


def _one_line(result, needle):
    assert result.exit_code not in (0, None), (result.exit_code, result.output)
    err = result.stderr.strip()
    assert "Traceback" not in result.output and len(err.splitlines()) == 1 and needle in err, err
    assert not result.stdout.strip(), result.stdout  # nothing that looks like a report


def test_greedy_speculative_through_the_cli_reproduces_plain_decoding(tiny_models, prompts, tmp_path):
    common = ["--prompts", prompts, "--max-new-tokens", 12, "--temperature", 0]
    plain_file, spec_file = tmp_path / "plain.jsonl", tmp_path / "spec.jsonl"
    plain = _eval(tiny_models["llama"], *common, "--save-outputs", plain_file)
    spec = _eval(tiny_models["llama"], *common, "--speculative", "self:W4A8", "--save-outputs", spec_file, "--json")
    assert plain.exit_code == 0 and spec.exit_code == 0, (plain.output, spec.output)

    def tokens(path):
        return {r["prompt_index"]: r["tokens"] for r in map(json.loads, path.read_text().splitlines())}

    assert tokens(spec_file) == tokens(plain_file) and len(tokens(plain_file)) == 2
    assert all(0 < len(t) <= 12 for t in tokens(plain_file).values())  # 12 new tokens, fewer at an EOS
    result = json.loads(spec.stdout)["results"][0]["speculative"]
    assert result["identical_to_plain"] is True
    assert result["diverged_prompts"] == 0 and result["first_divergence"] == [None, None]
    assert result["generated_tokens"] == sum(len(t) for t in tokens(plain_file).values())


def test_bad_speculative_input_is_one_line(tiny_models, prompts, tmp_path):
    target = tiny_models["llama"]
    other_vocab = make_tiny_model(tmp_path / "other_vocab", "llama", vocab_size=200)
    _one_line(_eval(target, "--speculative", other_vocab, "--prompts", prompts), "does not share the target's tokenizer")
    (tmp_path / "not_a_model").mkdir()
    (tmp_path / "not_a_model" / "notes.txt").write_text("hello")
    _one_line(_eval(target, "--speculative", tmp_path / "not_a_model", "--prompts", prompts), "config.json")
    _one_line(_eval(target, "--speculative", "medusa-heads", "--prompts", prompts), "is neither")
    _one_line(_eval(target, "--speculative", "ngram", "--draft-tokens", 0, "--prompts", prompts),
              "--draft-tokens must be at least 1")
    _one_line(_eval(target, "--speculative", "self:W4A8", "--tree", "dynamic:400", "--prompts", prompts),
              "positions but the model has 256")
    _one_line(_eval(target, "--speculative", "self:W4A8", "--tree", "bushy", "--prompts", prompts), "unknown --tree")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "In the beginning"}\n{"prompt": oops}\n')
    _one_line(_eval(target, "--speculative", "ngram", "--prompts", bad), f"{bad}:2: not valid JSON")
    empty_prompt = tmp_path / "empty.jsonl"
    empty_prompt.write_text('{"prompt": ""}\n')
    _one_line(_eval(target, "--speculative", "ngram", "--prompts", empty_prompt), f"{empty_prompt}:1:")
    huge_id = tmp_path / "ids.jsonl"
    huge_id.write_text('{"ids": [1, 2, 99999]}\n')
    _one_line(_eval(target, "--speculative", "ngram", "--prompts", huge_id), "outside the tokenizer's")


def test_a_bad_draft_is_refused_before_any_model_work(tiny_models, monkeypatch):
    """The draft was once resolved only after the KL pass and plain decoding of every prompt (20 minutes)."""
    import quantkit.eval.runner as runner_module

    def no_model_work(*a, **k):
        raise AssertionError("a model was loaded before the draft was checked")

    monkeypatch.setattr(runner_module, "load_model", no_model_work)
    target = tiny_models["llama"]
    _one_line(_eval(target, "--speculative", "nonsense"), "is neither")
    _one_line(_eval(target, "--speculative", "self:W9A9"), "unknown self-draft")
    _one_line(_eval(target, "--speculative", "self:skip:0"), "positive number of layers")
    _one_line(_eval(target, "--speculative", "ngram", "--draft-vocab", 64), "--draft-vocab applies to a model draft")
    _one_line(_eval(target, "--speculative", "self:W4A8", "--draft-vocab", -1), "--draft-vocab must be >= 0")
    _one_line(_eval(target, "--speculative", "eagle:/nowhere"), "is not a drafter folder")
    _one_line(_eval(target, "--speculative", "medusa:/nowhere", "--draft-vocab", 64), "chosen when it is fitted")


def test_early_exit_with_a_restricted_vocabulary_through_the_cli(tiny_models, prompts, tmp_path, text_file):
    """self:skip:1 scoring the 64 most frequent tokens of the calibration text: greedy output is plain decoding's,
    and the report says how many tokens the draft scored."""
    common = ["--prompts", prompts, "--max-new-tokens", 10, "--dataset", text_file]
    spec = _eval(tiny_models["llama"], *common, "--speculative", "self:skip:1", "--draft-vocab", 64, "--json")
    assert spec.exit_code == 0, spec.output
    result = json.loads(spec.stdout)["results"][0]["speculative"]
    assert result["draft"] == "self:skip:1" and result["draft_vocab"] == 64
    assert result["identical_to_plain"] is True
    # One of two layers and a 64-row head: a fraction of what the target's step reads.
    assert 0 < result["draft_bytes_per_token"] < result["target_bytes_per_token"]
    assert result["draft_bytes_ratio"] == pytest.approx(result["draft_bytes_per_token"] / result["target_bytes_per_token"])


def test_first_divergence_points_at_the_first_differing_generated_token():
    from quantkit.eval.speculative import first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([7], [8, 9]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one output stopped early (an EOS): they differ from there
