"""`quantkit release` on a tiny model: variants built once, one evaluation, gates, cards, determinism."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from typer.testing import CliRunner

from quantkit.cli import app

runner = CliRunner()


def _recipe(path, model, text_file, gates=None, variant_gates=None, evaluation=None):
    data = {
        "name": "tiny",
        "base": {"source": str(model)},
        "calibration": {"dataset": str(text_file), "num_samples": 4, "seq_len": 32},
        "variants": [
            {"name": "w4-rtn", "method": "rtn", "scheme": "W4A16", "group_size": 32, "gates": variant_gates or {}},
            {"name": "fp8", "method": "fp8", "scheme": "FP8_DYNAMIC"},
        ],
        "evaluation": {"dataset": str(text_file), "num_samples": 4, "seq_len": 32, **(evaluation or {})},
        "gates": gates or {"max_kl": 10.0, "min_top1": 0.0},
        "serving": {"gpu": "cpu"},
    }
    path.write_text(yaml.safe_dump(data))
    return path


def _card_numbers(card: str) -> dict:
    rows = dict(re.findall(r"^\| (perplexity|KL mean|top-1 agreement) \| ([^|]+) \|$", card, re.M))
    size = int(re.search(r"^- size: (\d+) bytes", card, re.M).group(1))
    return {"ppl": float(rows["perplexity"]), "kl_mean": float(rows["KL mean"]),
            "top1_agree": float(rows["top-1 agreement"]), "size_bytes": size}


def test_release_builds_evaluates_gates_and_documents(tmp_path, tiny_models, text_file, monkeypatch):
    import quantkit.eval.runner as runner_mod

    calls = []
    real_eval = runner_mod.run_eval
    monkeypatch.setattr(runner_mod, "run_eval", lambda opts: calls.append(opts) or real_eval(opts))
    out = tmp_path / "rel"
    recipe = _recipe(tmp_path / "release.yaml", tiny_models["llama"], text_file)
    result = runner.invoke(app, ["release", str(recipe), "--output", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    on_disk = json.loads((out / "release.json").read_text())
    assert [v["name"] for v in on_disk["variants"]] == ["w4-rtn", "fp8"]
    for v in on_disk["variants"]:
        assert {"name", "output", "scheme", "method", "kl_mean", "ppl", "size_bytes", "gates", "passed"} <= set(v)
        assert v["built"] and v["passed"] and [g["gate"] for g in v["gates"]] == ["max_kl", "min_top1"]
        card = (out / v["name"] / "README.md").read_text()
        assert _card_numbers(card) == {"ppl": v["ppl"], "kl_mean": v["kl_mean"], "top1_agree": v["top1_agree"],
                                       "size_bytes": v["size_bytes"]}
        assert v["size_bytes"] == sum(p.stat().st_size for p in (out / v["name"]).glob("*.safetensors"))
        assert (out / v["name"] / "kl_distribution.png").stat().st_size > 1000
        assert "vllm serve" in card and "```yaml" in card and "sha256" in card
        # The card and plot sit outside the manifest: the checkpoint still verifies.
        assert runner.invoke(app, ["inspect", str(out / v["name"])]).exit_code == 0
    assert summary["variants"] == on_disk["variants"]
    assert len(calls) == 1 and len(calls[0].checkpoints) == 2  # one evaluation, one baseline pass
    assert (out / "release.md").read_text().count("| [") == 2 and (out / "eval" / "report.json").is_file()

    # Same recipe, a gate tightened on one variant: nothing is rebuilt, and the failing gate exits 3 by name.
    before = (out / "w4-rtn" / "model.safetensors").stat().st_mtime_ns
    strict = _recipe(tmp_path / "strict.yaml", tiny_models["llama"], text_file, variant_gates={"max_kl": 0.0})
    failed = runner.invoke(app, ["release", str(strict), "--output", str(out)])
    assert failed.exit_code == 3, failed.output
    lines = [line for line in failed.stderr.splitlines() if line.startswith("gate failed")]
    assert len(lines) == 1 and lines[0].startswith("gate failed: w4-rtn: gate max_kl failed (kl_mean = ")
    assert "Traceback" not in failed.output
    again = json.loads((out / "release.json").read_text())
    assert [v["built"] for v in again["variants"]] == [False, False]
    assert [v["passed"] for v in again["variants"]] == [False, True]
    assert (out / "w4-rtn" / "model.safetensors").stat().st_mtime_ns == before


def test_release_verify_determinism(tmp_path, tiny_models, text_file):
    out = tmp_path / "rel"
    recipe = _recipe(tmp_path / "release.yaml", tiny_models["qwen2"], text_file, evaluation={"throughput": True})
    result = runner.invoke(app, ["release", str(recipe), "--output", str(out), "--verify-determinism", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert [d["variant"] for d in summary["determinism"]] == ["w4-rtn", "fp8"]  # every variant by default
    for d in summary["determinism"]:
        assert d["identical"] and d["mismatched"] == [] and "model.safetensors" in d["files"]
    assert not (out / ".determinism").exists()
    # Throughput, base and variant from the one evaluation, is in every card with the engine that measured it.
    base = summary["base"]["throughput"]
    for v in summary["variants"]:
        card = (out / v["name"] / "README.md").read_text()
        row = re.search(r"^\| decode tokens/s, batch 1 \| ([^|]+) \| ([^|]+) \| ([\d.]+)x \|$", card, re.M)
        mine, ref = v["throughput"]["decode_tok_s_b1"], base["decode_tok_s_b1"]
        assert float(row.group(1)) == pytest.approx(mine, rel=1e-3)
        assert float(row.group(2)) == pytest.approx(ref, rel=1e-3)
        assert float(row.group(3)) == pytest.approx(mine / ref, abs=0.006)
        assert "Measured by quantkit" in card and "load average" in card
    assert "decode tok/s b1" in (out / "release.md").read_text()


def test_release_determinism_variants_named(tmp_path, tiny_models, text_file):
    from quantkit.errors import InputError
    from quantkit.release import ReleaseRecipe

    recipe = _recipe(tmp_path / "release.yaml", tiny_models["qwen2"], text_file)
    data = yaml.safe_load(recipe.read_text())
    recipe.write_text(yaml.safe_dump({**data, "determinism_variants": "fp8"}))
    assert ReleaseRecipe.load(recipe).determinism_variants == ["fp8"]
    recipe.write_text(yaml.safe_dump({**data, "determinism_variants": ["nope"]}))
    with pytest.raises(InputError, match="nope not a variant"):
        ReleaseRecipe.load(recipe)
    recipe.write_text(yaml.safe_dump({**data, "evaluation": {"engine": "tgi"}}))
    with pytest.raises(InputError, match="evaluation.engine 'tgi'"):
        ReleaseRecipe.load(recipe)


def test_release_recipe_errors_are_one_line(tmp_path, tiny_models, text_file):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "x", "variants": [{"name": "a", "method": "rtn", "scheme": "W4A16",
                                                              "colour": "blue"}]}))
    result = runner.invoke(app, ["release", str(bad)])
    assert result.exit_code == 2 and "unknown field(s): colour" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    missing = runner.invoke(app, ["release", str(tmp_path / "none.yaml")])
    assert missing.exit_code == 2 and "does not exist" in missing.stderr


def test_shipped_release_recipe_parses():
    from quantkit.release import ReleaseRecipe

    rec = ReleaseRecipe.load("recipes/release-smollm2.yaml")
    assert [(v.method, v.scheme) for v in rec.variants] == [("gptq", "W4A16"), ("smoothquant+gptq", "W8A8"),
                                                            ("fp8", "FP8_BLOCK")]
