"""The compute-dtype chooser: measured speeds decide, forced dtypes are honoured, measurements are cached per
machine, and a run records its choice; a bf16 model calibrated in fp32 writes the same bf16 layout."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit import compute
from quantkit.compute import choose_compute_dtype, measure_gflops
from tests.conftest import make_tiny_model

SHAPES = ((64, 128, 128),)


def fake(speeds: dict):
    calls = []

    def measure(dtype, shapes):
        calls.append(dtype)
        return speeds[dtype]

    measure.calls = calls
    return measure


def never(dtype, shapes):
    raise AssertionError("a forced or cached choice must not measure")


def test_picks_fp32_for_a_bf16_model_when_bf16_is_slower():
    # An AVX2-only CPU: torch's bf16 matmul is emulated (measured 2 vs 270 GFLOP/s).
    m = fake({torch.bfloat16: 2.0, torch.float32: 270.0})
    choice = choose_compute_dtype("auto", torch.bfloat16, "cpu", SHAPES, measure=m, use_cache=False)
    assert choice.dtype == torch.float32 and not choice.autocast and choice.reason == "measured"
    assert set(m.calls) == {torch.bfloat16, torch.float32}
    assert choice.gflops == {"bfloat16": 2.0, "float32": 270.0}


def test_keeps_bf16_where_it_is_faster_and_on_a_near_tie():
    fast = fake({torch.bfloat16: 1400.0, torch.float32: 270.0})
    assert choose_compute_dtype("auto", torch.bfloat16, "cpu", SHAPES, measure=fast, use_cache=False).dtype == torch.bfloat16
    # fp32 5% faster is within the tie margin: the model's own dtype stays.
    tie = fake({torch.bfloat16: 100.0, torch.float32: 105.0})
    assert choose_compute_dtype("auto", torch.bfloat16, "cpu", SHAPES, measure=tie, use_cache=False).dtype == torch.bfloat16


def test_fp32_model_runs_bf16_autocast_only_when_much_faster_and_allowed():
    fast = fake({torch.bfloat16: 1400.0, torch.float32: 270.0})
    choice = choose_compute_dtype("auto", torch.float32, "cpu", SHAPES, measure=fast, use_cache=False)
    assert choice.dtype == torch.bfloat16 and choice.autocast
    slow = fake({torch.bfloat16: 2.0, torch.float32: 270.0})
    assert choose_compute_dtype("auto", torch.float32, "cpu", SHAPES, measure=slow, use_cache=False).dtype == torch.float32
    # Evaluation never narrows an fp32 model: nothing to measure, fp32 stays.
    kept = choose_compute_dtype("auto", torch.float32, "cpu", SHAPES, measure=never, use_cache=False, narrower=False)
    assert kept.dtype == torch.float32 and kept.reason == "no-candidates"


@pytest.mark.parametrize("forced,model,expect_autocast", [("float32", torch.bfloat16, False),
                                                           ("bfloat16", torch.bfloat16, False),
                                                           ("bfloat16", torch.float32, True)])
def test_forced_dtypes_are_honoured_without_measuring(forced, model, expect_autocast):
    choice = choose_compute_dtype(forced, model, "cpu", SHAPES, measure=never)
    assert choice.name == forced and choice.autocast == expect_autocast and choice.reason == "forced"


def test_unknown_dtype_is_refused():
    from quantkit.errors import InputError

    with pytest.raises(InputError, match="valid: auto, bfloat16, float32"):
        choose_compute_dtype("int8", torch.bfloat16, "cpu", SHAPES, measure=never)


def test_measurements_are_cached_per_machine_and_isa_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(compute, "_load_per_core", lambda: 0.2)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    m = fake({torch.bfloat16: 2.0, torch.float32: 270.0})
    first = choose_compute_dtype("auto", torch.bfloat16, "cpu", SHAPES, measure=m)
    again = choose_compute_dtype("auto", torch.bfloat16, "cpu", SHAPES, measure=never)
    assert (first.reason, again.reason) == ("measured", "cached") and again.dtype == first.dtype == torch.float32
    assert json.loads((tmp_path / "compute-dtype.json").read_text())
    # Capping oneDNN's instruction set changes what is fast: that is another machine to the cache.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    m2 = fake({torch.bfloat16: 1400.0, torch.float32: 270.0})
    other = choose_compute_dtype("auto", torch.bfloat16, "cpu", SHAPES, measure=m2)
    assert other.reason == "measured" and other.dtype == torch.bfloat16 and "ONEDNN_MAX_CPU_ISA=AVX2" in other.cpu


def test_real_probe_reports_positive_speeds():
    for dtype in (torch.float32, torch.bfloat16):
        speed = measure_gflops(dtype, SHAPES)
        assert 0 < speed < 1e6  # GFLOP/s: beyond a petaflop on a CPU would mean the timer is broken


def _run(model, out, compute):
    from quantkit.pipeline.engine import quantize_model
    from quantkit.recipe import Recipe

    r = Recipe()
    r.model.source = str(model)
    r.quantization.method, r.quantization.scheme, r.quantization.group_size = "gptq", "W4A16", 32
    r.calibration.num_samples, r.calibration.seq_len = 4, 32
    return quantize_model(r, out, compute_dtype=compute)


def test_bf16_model_calibrated_in_fp32_writes_the_same_bf16_layout(tmp_path):
    from tests.pipeline.test_engine import _oracle_dense, _tensors

    model = make_tiny_model(tmp_path / "m", "llama", dtype=torch.bfloat16)
    a = _run(model, tmp_path / "fp32", "float32")
    b = _run(model, tmp_path / "bf16", "bfloat16")
    ta, tb = _tensors(tmp_path / "fp32"), _tensors(tmp_path / "bf16")
    assert {k: (v.dtype, v.shape) for k, v in ta.items()} == {k: (v.dtype, v.shape) for k, v in tb.items()}
    assert ta["model.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.bfloat16
    # The two calibrations differ by rounding only: GPTQ lands on other grid points here and there (its solve is
    # sensitive on 128 random tokens), but each checkpoint is as far from the original weights as the other.
    original = _tensors(model)
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        w = original[f"{module}.weight"].float()
        err_a = (_oracle_dense(ta, module, 4, 32, torch.float32) - w).norm() / w.norm()
        err_b = (_oracle_dense(tb, module, 4, 32, torch.float32) - w).norm() / w.norm()
        assert abs(err_a - err_b) < 0.1 * err_b
    for out, summary, name in ((tmp_path / "fp32", a, "float32"), (tmp_path / "bf16", b, "bfloat16")):
        manifest = json.loads((out / "quantkit_manifest.json").read_text())
        assert manifest["compute"]["dtype"] == name and manifest["compute"]["reason"] == "forced"
        assert summary["compute"]["dtype"] == name


def test_cli_refuses_an_unknown_compute_dtype(tmp_path, tiny_models):
    result = CliRunner().invoke(app, ["quantize", "--model", str(tiny_models["llama"]), "--method", "rtn",
                                      "--compute-dtype", "fp64", "--output", str(tmp_path / "o")])
    assert result.exit_code == 2 and "valid: auto, bfloat16, float32" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_a_probe_taken_on_a_busy_machine_is_taken_again_once_it_is_quiet(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))
    load = {"now": 4.0}
    monkeypatch.setattr(compute, "_load_per_core", lambda: load["now"])
    busy = choose_compute_dtype("auto", torch.bfloat16, "cpu", SHAPES,
                                measure=fake({torch.bfloat16: 2.0, torch.float32: 9.0}))
    assert busy.reason == "measured" and busy.dtype == torch.float32
    # Still as busy: the busy probe is what this machine is like now.
    assert choose_compute_dtype("auto", torch.bfloat16, "cpu", SHAPES, measure=never).reason == "cached"
    load["now"] = 0.3
    quiet = choose_compute_dtype("auto", torch.bfloat16, "cpu", SHAPES,
                                 measure=fake({torch.bfloat16: 1400.0, torch.float32: 270.0}))
    assert quiet.reason == "measured" and quiet.dtype == torch.bfloat16
    # A quiet probe stands from then on, even when the machine is busy again.
    load["now"] = 4.0
    assert choose_compute_dtype("auto", torch.bfloat16, "cpu", SHAPES, measure=never).dtype == torch.bfloat16
