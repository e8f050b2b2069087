"""`quantkit eval --attribution`: each decoder layer's share of the KL, against known answers (a layer left
unquantised contributes exactly nothing; restoring the only quantised layer removes the whole KL)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from quantkit.cli import app

runner = CliRunner()
DATA = ["--num-samples", "3", "--seq-len", "40"]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))


def _quantize(src, out, ignore=()):
    from quantkit.pipeline.engine import quantize_model
    from quantkit.recipe import Recipe

    r = Recipe()
    r.model.source = str(src)
    r.quantization.scheme, r.quantization.group_size = "W4A16", 32
    r.quantization.ignore = ["lm_head", *ignore]
    r.calibration.num_samples, r.calibration.seq_len = 2, 16
    quantize_model(r, out)
    return out


def _attribution(path, *extra):
    res = runner.invoke(app, ["eval", str(path), "--attribution", "--json", *DATA, *extra], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    row = json.loads(res.stdout)["results"][0]
    return row, row["attribution"]


def test_an_unquantised_layer_contributes_nothing_and_the_quantised_one_everything(tiny_models, tmp_path):
    path = _quantize(tiny_models["llama"], tmp_path / "q", ignore=["re:model\\.layers\\.0\\..*"])
    row, a = _attribution(path)
    assert [x["layer"] for x in a["layers"]] == [0, 1]
    assert a["kl_mean"] == pytest.approx(row["kl_mean"], rel=1e-5) and row["kl_mean"] > 0
    first, second = a["layers"]
    assert first["contribution"] == 0.0  # layer 0 is the baseline's already: swapping changes no bit
    assert second["kl_without"] == 0.0  # the model is then the baseline itself
    assert second["contribution"] == pytest.approx(a["kl_mean"]) and a["explained"] == pytest.approx(1.0)


def test_every_layer_quantised_sums_and_reports(tiny_models, tmp_path):
    path = _quantize(tiny_models["qwen3_moe"], tmp_path / "q")
    res = runner.invoke(app, ["eval", str(path), "--attribution", *DATA, "--report", str(tmp_path / "rep")],
                        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    a = report["results"][0]["attribution"]
    assert all(x["contribution"] > 0 for x in a["layers"])  # each quantised layer adds error here
    assert a["sum_of_contributions"] == pytest.approx(sum(x["contribution"] for x in a["layers"]), rel=1e-4)
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Attribution" in md and (tmp_path / "rep" / "attribution_0.png").is_file()
